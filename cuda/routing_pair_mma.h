// routing_pair_mma.h: pair versions 12-13 (routing_pair_mma.cu), the routing backward depth
// tile's pass over its site gradients on tensor cores. Internal to cuda/ (routing_backward_tile.cu
// calls it).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace mhar::cuda {

constexpr int kPairMmaMaxSites = 256;  // as routing_rows.cuh's per-site pointer tables

// One backward depth tile's pass (the unfused form of routing_backward_tile.cu's pair kernels), for
// slots p0 = source and p1 (the tile's older slot) over the sites i = 0 .. ns - 1 after
// source (site source + i), token n, head h of the channels c in h:
//   u_s = sum_c dx_i[n][c] v_s[n][c], ds_s = a_s (u_s - ubar_i), a_s read from and ds_s r_s
//   written over the pair row w_s[i][h][n] (s = 0, 1; r_s = inv_rms_s[n]);
//   ubar_0 (site source) = sum_c dx_0[n][c] x[n][c], written to ubar_source[h][n];
//   val[n][c] = sum_i a_0 dx_i[n][c], partial[n][c] = sum_i a_1 dx_i[n][c] (fp32 rows).
// ubar_i for i > 0 is read from ubar_source + i H N. dx: the sites' bf16 rows [N][d]
// (entries past ns any valid row, e.g. x: the kernel reads the table without a branch).
struct PairMmaArgs {
  float* val;
  float* partial;
  float* w0;           // the pair rows of (p0, source), then of its later sites: [ns][H][N]
  float* w1;           // the same for p1
  float* ubar_source;  // ubar's row of site `source`: [H][N], later sites after it
  const bf16* x;       // the input of site `source`
  const bf16* v0;
  const bf16* v1;
  const float* inv_rms0;
  const float* inv_rms1;
  int64_t N;
  int ns;
  const bf16* dx[kPairMmaMaxSites];
};

// Whether the kernel is built for d and heads: head widths of 128 with 4 or 8 heads, or
// of 160 with 8 (the paper's 100M, 350M and 1B shapes).
bool pair_mma_applies(int d, int heads);
// Launches it on a grid of one wave, at most max_blocks blocks where max_blocks > 0 (the
// tests' routing_set_grid_cap): each warp 4-5 stages deep (pair version 12), or 2 stages
// with twice the warps an SM (two_stages: version 13). False (nothing launched) where
// pair_mma_applies says no or ns is outside [1, kPairMmaMaxSites].
bool pair_mma(cudaStream_t s, const PairMmaArgs& args, int d, int heads, bool two_stages,
              int max_blocks);

}  // namespace mhar::cuda
