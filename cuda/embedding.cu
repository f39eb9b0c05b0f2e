// embedding.cu: token embedding lookup and its gradient.
// - forward: out [N, d] (overwritten) = table [V, d] rows at tokens [N] (I32).
// - backward: dtable [V, d] (grad dtype F32) += dout [N, d] rows, deterministic: the same
//   bits every run, and the CPU reference's (engine/cpu/embedding.h): each row of dtable
//   adds its tokens' gradient rows one at a time in token order, in fp32. The tokens are
//   sorted by id (CUB's radix sort, stable, so equal ids keep their order; the positions
//   travel with them), and one thread per column walks each run of equal ids. No atomics:
//   an earlier version scattered with fp32 atomics, which made GPU runs differ from run to
//   run in the last bits. Temporaries (sorted ids, positions, CUB's storage) come from
//   ScratchSlot::EmbeddingSort, embedding_backward_scratch_bytes(N) at most.
// Token ids must lie in [0, V): the data loader guarantees it; ids outside trap the kernel
// rather than read or write out of bounds.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

template <class TO, class TT>
__global__ void embedding_forward_kernel(TO* out, const int32_t* tokens, const TT* table,
                                         int64_t N, int64_t d, int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int32_t tok = tokens[n];
    if (tok < 0 || tok >= V) __trap();
    const TT* src = table + int64_t(tok) * d;
    TO* dst = out + n * d;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = store<TO>(load(src[c]));
  }
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = int32_t(i);
}

// Runs of equal ids in `sorted` (ascending; `order` their positions in dout, ascending within
// a run): the block whose index meets a run's first entry adds the run's rows into its id's
// row of dtable, one column a thread (blockIdx.y: columns blockDim.x * y on), in run order.
// A run's additions are serial (that is the order the CPU's are in), so its rows are fetched
// kUnroll at a time before they are added: a long run (a frequent token: ~650 of a 16,384-
// token micro-batch for " the") waits on ~20 rounds of loads, not ~650.
template <class TD>
__global__ void embedding_backward_runs_kernel(float* dtable, const TD* dout,
                                               const uint32_t* sorted, const int32_t* order,
                                               int64_t N, int64_t d, int64_t V) {
  constexpr int kUnroll = 32;
  const int64_t c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= d) return;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const uint32_t tok = sorted[i];
    if (i > 0 && sorted[i - 1] == tok) continue;  // inside a run another block owns
    if (tok >= uint64_t(V)) __trap();
    float* row = dtable + int64_t(tok) * d + c;
    float acc = *row;
    for (int64_t j = i; j < N && sorted[j] == tok; j += kUnroll) {
      float g[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in_run = j + u < N && sorted[j + u] == tok;
        g[u] = in_run ? load(dout[int64_t(order[j + u]) * d + c]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (j + u < N && sorted[j + u] == tok) acc += g[u];
    }
    *row = acc;
  }
}

// The bits that hold every id below V (at least 1).
int id_bits(int64_t V) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) < V) ++bits;
  return bits;
}

// CUB's temporary storage for sorting n (id, position) pairs over `bits` bits.
size_t cub_sort_bytes(int64_t n, int bits) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(n), 0, bits));
  return bytes;
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

int row_threads(int64_t d) { return d >= 256 ? 256 : int(ceil_div(d, 32) * 32); }

}  // namespace

void embedding_forward(cudaStream_t s, Tensor out, Tensor tokens, Tensor table) {
  check_dtype(tokens, DType::I32, "embedding_forward", "tokens");
  const int64_t N = tokens.numel(), d = table.dim(-1), V = table.numel() / d;
  check_numel(out, N * d, "embedding_forward", "out");
  if (N == 0) return;
  dispatch_float(out.dtype, "embedding_forward", [&](auto to) {
    dispatch_float(table.dtype, "embedding_forward", [&](auto tt) {
      using TO = decltype(to);
      using TT = decltype(tt);
      int blocks = int(N < 65535 * 8 ? N : 65535 * 8);
      embedding_forward_kernel<TO, TT><<<blocks, row_threads(d), 0, s>>>(
          static_cast<TO*>(out.data), tokens.ptr<int32_t>(),
          static_cast<const TT*>(table.data), N, d, V);
      CUDA_CHECK_LAUNCH();
    });
  });
}

size_t embedding_backward_scratch_bytes(int64_t N) {
  if (N <= 0) return 0;
  // Sorted ids, positions in and out, then CUB's storage for ids of any width (the most
  // over every bit count, rather than trusting it to grow with the bits). Remembered per N
  // and device: the backend lays its scratch out at every pass's binding.
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int>, size_t> known;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  size_t& sort = known[{N, dev}];
  if (sort == 0)
    for (int bits = 1; bits <= 32; ++bits) sort = std::max(sort, cub_sort_bytes(N, bits));
  return 3 * align256(size_t(N) * 4) + sort;
}

void embedding_backward(cudaStream_t s, Tensor dtable, Tensor dout, Tensor tokens,
                        const ScratchFn& scratch) {
  check_dtype(tokens, DType::I32, "embedding_backward", "tokens");
  check_dtype(dtable, DType::F32, "embedding_backward", "dtable");
  const int64_t N = tokens.numel(), d = dtable.dim(-1), V = dtable.numel() / d;
  check_numel(dout, N * d, "embedding_backward", "dout");
  if (N == 0) return;
  MHAR_CHECK(N < (int64_t(1) << 31), "embedding_backward: ", N,
             " tokens; positions are 32-bit (fewer than 2^31)");
  // The planned bytes (remembered per N): CUB takes any storage at least as large as the
  // sort over these ids' bits needs, so no query of its own here.
  const size_t bytes = embedding_backward_scratch_bytes(N);
  char* base = static_cast<char*>(scratch(ScratchSlot::EmbeddingSort, bytes));
  auto* sorted = reinterpret_cast<uint32_t*>(base);
  auto* positions = reinterpret_cast<int32_t*>(base + align256(size_t(N) * 4));
  auto* order = reinterpret_cast<int32_t*>(base + 2 * align256(size_t(N) * 4));
  void* cub_storage = base + 3 * align256(size_t(N) * 4);
  const int fill_blocks = int(std::min<int64_t>(ceil_div(N, 256), 4 * int64_t(sm_count())));
  iota_kernel<<<fill_blocks, 256, 0, s>>>(positions, N);
  CUDA_CHECK_LAUNCH();
  size_t storage_bytes = bytes - 3 * align256(size_t(N) * 4);
  // Ids as unsigned: one outside [0, V) (a negative one reads as >= 2^31) keeps its whole
  // value in `sorted`, whatever bits the sort compared, and traps in the run kernel.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_storage, storage_bytes,
                                             reinterpret_cast<const uint32_t*>(tokens.data), sorted,
                                             positions, order, int(N), 0, id_bits(V), s));
  dispatch_float(dout.dtype, "embedding_backward", [&](auto td) {
    using TD = decltype(td);
    const int threads = row_threads(d);
    const dim3 grid(unsigned(std::min<int64_t>(N, 8 * int64_t(sm_count()))),
                    unsigned(ceil_div(d, threads)));
    embedding_backward_runs_kernel<TD><<<grid, threads, 0, s>>>(
        dtable.ptr<float>(), static_cast<const TD*>(dout.data), sorted, order, N, d, V);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
