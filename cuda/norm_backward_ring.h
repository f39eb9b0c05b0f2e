// norm_backward_ring.h: the RMSNorm backward fed by the copy engine (norm backward lab
// versions 7 and 8; norm.cu dispatches to it). Internal to cuda/.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {

// rmsnorm_backward for BF16 x, dy, dx and weight w [D] with 512 < D <= 2048 (D a multiple
// of 8, every pointer 16-byte aligned) by the ring kernel, blocks_per_sm (1 or 2) blocks an
// SM sharing its shared memory; hold_rows (one block an SM, D <= 1536) keeps a row in
// registers between its two passes. The same dx bits as norm.cu's version 1, dw summed
// over this kernel's own grid. Returns false, having launched nothing, where it does not
// apply (another D, no cooperative launch on the device, or the blocks do not fit an SM).
bool rmsnorm_backward_ring(cudaStream_t s, int blocks_per_sm, bool hold_rows, bf16* dx,
                           float* dw, const bf16* dy, const bf16* x, const bf16* w,
                           const float* rstd, int64_t R, int D, bool accumulate_dx,
                           const ScratchFn& scratch);

}  // namespace mhar::cuda
