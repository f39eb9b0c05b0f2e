// embedding.cu: token embedding lookup and its gradient.
// - forward: out [N, d] (overwritten) = table [V, d] rows at tokens [N] (I32).
// - backward: dtable [V, d] (grad dtype F32) += dout [N, d] rows, deterministic: the same
//   bits every run, and the CPU reference's (engine/cpu/embedding.h): each row of dtable
//   adds its tokens' gradient rows one at a time in token order, in fp32. The tokens are
//   sorted by id (CUB's radix sort, stable, so equal ids keep their order; the positions
//   travel with them), and each run of equal ids is summed column by column in that order
//   by whoever owns the run's first entry. No atomics: an earlier version scattered with
//   fp32 atomics, which made GPU runs differ from run to run in the last bits. Temporaries
//   (sorted ids, positions, CUB's storage) come from ScratchSlot::EmbeddingSort,
//   embedding_backward_scratch_bytes(N) at most.
// - Kernel lab (embedding_backward_set_version): how the runs are walked. 1: a block a
//   stride of sorted entries, a thread a column, the block's runs one after another. 2 (the
//   default, 5.5-7x faster than 1 on an H100; kEmbeddingBackwardDefault has the figures): a
//   warp a window of 32 sorted entries and 32 columns, every gradient row and dtable row of
//   the window fetched at once, then added in order; a run longer than its window goes on
//   in batches of 32, the next batch's ids fetched with this one's rows. 3: 2 fetching half
//   a window's rows at a time, in fewer registers. Every version gives the CPU's bits
//   (EmbeddingParity runs each).
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

// Version 1. Runs of equal ids in `sorted` (ascending; `order` their positions in dout, ascending
// within a run): the block whose index meets a run's first entry adds the run's rows into its id's
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

// Version 2. A warp owns the runs that start in a window of 32 sorted entries (blockIdx.x),
// over 32 columns (lane; warp threadIdx.y of block blockIdx.y picks which 32). Version 1
// walked a block's runs one after another, each a chain of dependent loads (id, position,
// gradient row, dtable row), and measured 0.52 ms at d 512 for 16,384 Zipf ids (cuda/
// NOTES.md); here a window's ids and positions come in one load a lane, then all 32
// gradient rows and the 32 dtable rows its runs start from in one round (every address
// valid, so nothing waits on a branch), and only the additions are serial. Entries before
// the window's first run start belong to a run an earlier window owns. A run that goes on
// past the window is finished here in batches of 32 entries, the next batch's ids and
// positions fetched while this batch's rows are. Version 3 is 2 fetching kBatch = 16 rows at
// a time, not 32: two rounds where 2 has one, in 63 registers where 2 holds 106 (ptxas, bf16
// rows: 4 blocks of 256 threads an SM against 2), so that more warps are in flight.
template <class TD, int kBatch>
__global__ void __launch_bounds__(256)
    embedding_backward_windows_kernel(float* dtable, const TD* dout, const uint32_t* sorted,
                                      const int32_t* order, int64_t N, int64_t d, int64_t V) {
  constexpr int kWindow = 32;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = int(threadIdx.x);
  const int64_t first_column = (int64_t(blockIdx.y) * blockDim.y + threadIdx.y) * 32;
  if (first_column >= d) return;  // the whole warp
  // Lanes past d fetch column d - 1 (a valid address) and store nothing.
  const bool live = first_column + lane < d;
  const int64_t c = live ? first_column + lane : d - 1;
  const int64_t base = int64_t(blockIdx.x) * kWindow;
  const int64_t e = base + lane;
  const bool valid = e < N;
  const uint32_t tok = valid ? sorted[e] : 0u;
  const int32_t pos = valid ? order[e] : 0;
  const uint32_t before = base > 0 ? sorted[base - 1] : 0u;
  const bool more = base + kWindow < N;
  const uint32_t after = more ? sorted[base + kWindow] : 0u;
  if (valid && tok >= uint64_t(V)) __trap();
  const uint32_t above = __shfl_up_sync(kAll, tok, 1);
  const uint32_t previous = lane == 0 ? before : above;
  const unsigned starts = __ballot_sync(kAll, valid && (e == 0 || previous != tok));
  if (starts == 0) return;  // the window lies inside a run an earlier window owns
  const int first = __ffs(int(starts)) - 1;
  const int count = int(N - base < kWindow ? N - base : kWindow);  // valid entries
  // Entries outside [first, count) fetch the first start's rows: valid, never added.
  // (Every lane runs each shuffle: one inside a ?: would run on some lanes only.)
  const bool owned = valid && lane >= first;
  const uint32_t first_tok = __shfl_sync(kAll, tok, first);
  const int32_t first_pos = __shfl_sync(kAll, pos, first);
  const uint32_t row_tok = owned ? tok : first_tok;
  const int32_t row_pos = owned ? pos : first_pos;
  float acc = 0.f;
  int64_t row = 0;
#pragma unroll
  for (int h = 0; h < kWindow; h += kBatch) {
    float g[kBatch], old[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      g[k] = load(dout[int64_t(__shfl_sync(kAll, row_pos, h + k)) * d + c]);
      old[k] = dtable[int64_t(__shfl_sync(kAll, row_tok, h + k)) * d + c];
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int u = h + k;
      const uint32_t u_tok = __shfl_sync(kAll, row_tok, u);
      if (u < first || u >= count) continue;  // the same for the whole warp
      if (starts >> u & 1u) {
        if (u > first && live) dtable[row * d + c] = acc;
        acc = old[k];
        row = int64_t(u_tok);
      }
      acc += g[k];
    }
  }
  // The last run goes on past the window when the next entry has its id.
  const uint32_t last_tok = __shfl_sync(kAll, tok, count - 1);
  if (more && after == last_tok) {
    int64_t j = base + kWindow;
    bool next_valid = j + lane < N;
    uint32_t next_tok = next_valid ? sorted[j + lane] : 0u;
    int32_t next_pos = next_valid ? order[j + lane] : 0;
    for (;;) {
      const unsigned in_run = __ballot_sync(kAll, next_valid && next_tok == last_tok);
      const int taken = __popc(in_run);  // a prefix: the ids are sorted
      if (taken == 0) break;
      const int32_t run_pos = __shfl_sync(kAll, next_pos, 0);
      const int32_t batch_pos = lane < taken ? next_pos : run_pos;
      if (taken == kWindow) {
        j += kWindow;
        next_valid = j + lane < N;
        next_tok = next_valid ? sorted[j + lane] : 0u;
        next_pos = next_valid ? order[j + lane] : 0;
      }
#pragma unroll
      for (int h = 0; h < kWindow; h += kBatch) {
        float gt[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          gt[k] = load(dout[int64_t(__shfl_sync(kAll, batch_pos, h + k)) * d + c]);
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (h + k < taken) acc += gt[k];
      }
      if (taken < kWindow) break;
    }
  }
  if (live) dtable[row * d + c] = acc;
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

// EmbeddingSort's layout for N tokens: sorted ids (at 0), positions in, positions out
// (sorted), each 256-byte aligned, then CUB's storage. One function for the size and the
// offsets, so that they cannot drift apart.
struct SortLayout {
  size_t positions, order, cub_storage;
};
SortLayout sort_layout(int64_t N) {
  const size_t array = align256(size_t(N) * 4);
  return {array, 2 * array, 3 * array};
}

int row_threads(int64_t d) { return d >= 256 ? 256 : int(ceil_div(d, 32) * 32); }

constexpr int kEmbeddingBackwardVersions = 3;
// Version 2: 0.094 / 0.135 ms at d 512 / 1280 on an H100 against version 1's 0.521 / 0.975
// and version 3's 0.100 / 0.146 (OpTiming.DISABLED_EmbeddingBackward, 2026-12-06).
constexpr int kEmbeddingBackwardDefault = 2;
int g_embedding_backward_version = kEmbeddingBackwardDefault;

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
  return sort_layout(N).cub_storage + sort;
}

int embedding_backward_set_version(int version) {
  return set_lab_version(g_embedding_backward_version, version, kEmbeddingBackwardVersions,
                         kEmbeddingBackwardDefault, "embedding_backward_set_version");
}
int embedding_backward_versions() { return kEmbeddingBackwardVersions; }

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
  const SortLayout layout = sort_layout(N);
  auto* sorted = reinterpret_cast<uint32_t*>(base);
  auto* positions = reinterpret_cast<int32_t*>(base + layout.positions);
  auto* order = reinterpret_cast<int32_t*>(base + layout.order);
  void* cub_storage = base + layout.cub_storage;
  size_t storage_bytes = bytes - layout.cub_storage;
  const int fill_blocks = int(std::min<int64_t>(ceil_div(N, 256), 4 * int64_t(sm_count())));
  iota_kernel<<<fill_blocks, 256, 0, s>>>(positions, N);
  CUDA_CHECK_LAUNCH();
  // Ids as unsigned: one outside [0, V) (a negative one reads as >= 2^31) keeps its whole
  // value in `sorted`, whatever bits the sort compared, and traps in the run kernel.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_storage, storage_bytes,
                                             reinterpret_cast<const uint32_t*>(tokens.data), sorted,
                                             positions, order, int(N), 0, id_bits(V), s));
  dispatch_float(dout.dtype, "embedding_backward", [&](auto td) {
    using TD = decltype(td);
    float* dt = dtable.ptr<float>();
    const TD* go = static_cast<const TD*>(dout.data);
    if (g_embedding_backward_version >= 2) {
      const dim3 block(32, 8);
      const dim3 grid(unsigned(ceil_div(N, 32)), unsigned(ceil_div(ceil_div(d, 32), 8)));
      auto kernel = g_embedding_backward_version == 2 ? embedding_backward_windows_kernel<TD, 32>
                                                      : embedding_backward_windows_kernel<TD, 16>;
      kernel<<<grid, block, 0, s>>>(dt, go, sorted, order, N, d, V);
    } else {
      const int threads = row_threads(d);
      const dim3 grid(unsigned(std::min<int64_t>(N, 8 * int64_t(sm_count()))),
                      unsigned(ceil_div(d, threads)));
      embedding_backward_runs_kernel<TD><<<grid, threads, 0, s>>>(dt, go, sorted, order, N, d, V);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
