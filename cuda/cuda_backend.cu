// cuda_backend.cu: the CUDA implementation of mhar::Backend. Owns the device selection,
// the stream, the cuBLASLt/cuBLAS handles and workspace, and a small scratch for
// sum_squares (its per-block sums); memory ops and host transfers live here, kernels in
// one .cu per op family (kernels.h).
// - Side work (Backend::side_work_begin): with side_stream version 2 the ops between a
//   begin and an end go to a second stream, which first waits for everything issued on the
//   main stream, with their own cuBLAS handle and matmul workspace (a workspace serves one
//   product at a time); side_work_join makes the main stream wait for them. Version 1
//   (MHAR_KERNEL_VERSIONS=side_stream=1) runs them in issue order on the main stream. A
//   matmul timed at its shape's first call (cuda/matmul.cu) is timed on the side stream
//   too, synchronously, so it never runs beside main-stream work that the begin's wait did
//   not already finish.
// - act_dtype BF16, stat_dtype F32, grad_dtype F32.
// - allocate() is cudaMalloc, zero-filled and synchronous (not on the hot path). The
//   handles, workspace and sum_squares scratch are allocated in the constructor.
// - The ops' temporaries (kernels.h, ScratchSlot) come from the model's op scratch while
//   one is bound (Backend::op_scratch_bytes; scratch_layout below says what each slot
//   holds and where), so a model's step allocates nothing; with none bound, from
//   grow-only buffers of the backend's own (ops called without a model).
// - upload/download convert on the host between float64 and the tensor's dtype (BF16
//   rounds to nearest even; NaN stays NaN) through a host staging vector.
#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/device.h"
#include "cuda/kernels.h"

namespace mhar {

namespace cuda {
namespace {
// side_stream lab versions: 1 issue order on one stream, 2 side work on a second stream
// (the default: 100M mhar's step 41.5 -> 41.1 ms on an H100, standard's unchanged;
// BENCHMARKS.md, forty-fourth session), 3 as 2 with the routing backward's key gradients
// on the second stream too (kernels.h, KeyGradsBeside): from a pass's first side work, so
// never where side work is not asked for (a profile's ForwardingBackend does not forward
// it), to routing_param_grads, which joins them.
constexpr int kSideStreamVersions = 3, kSideStreamDefault = 2;
int side_stream_version = kSideStreamDefault;
}  // namespace
int side_stream_set_version(int version) {
  return set_lab_version(side_stream_version, version, kSideStreamVersions, kSideStreamDefault,
                         "side_stream_set_version");
}
int side_stream_versions() { return kSideStreamVersions; }
}  // namespace cuda

namespace {

uint16_t host_float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return uint16_t(bits >> 16);
}
float host_bf16_to_float(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr size_t kSlots = size_t(cuda::ScratchSlot::Count);

// A model's op scratch (Backend::op_scratch_bytes) by slot: each slot's most bytes for the model's
// shapes (the requests of attention_backward and hyper_workspace below, norm.cu and routing_mix.cu,
// routing_backward.cu), and where it sits. A depth tile carries its slot from one op to the next
// (routing_mix.cu, routing_backward.cu), so the two tile slots come first and share their bytes: a
// mix tile lives inside one forward pass, a backward tile inside one backward pass. The RoPE table
// lasts from one call to the next as well: it has its own bytes after the tiles. Every other slot
// is used within one op, and ops run one at a time on the one stream, so the ops' groups share the
// bytes after the tiles and the table: attention's backward (row dots, score-gradient tiles); the
// norms' partial sums; hyper's partial sums; the embedding gradient's sorted token ids; the
// matmul timing's output; the routing tables, value and key rows and pair split
// side by side (one routing source backward uses all four, and the backward tile, at once).
struct ScratchLayout {
  size_t offset[kSlots] = {}, bytes[kSlots] = {};
  size_t total = 0;
};
ScratchLayout scratch_layout(const OpScratchShapes& s) {
  using Slot = cuda::ScratchSlot;
  static_assert(kSlots == 14, "every slot is sized and placed below");
  ScratchLayout l;
  auto bytes = [&](Slot slot) -> size_t& { return l.bytes[size_t(slot)]; };
  const size_t N = size_t(std::max<int64_t>(s.tokens(), 0));
  const size_t d = size_t(std::max<int64_t>(s.d_model, 0));
  if (N > 0 && s.heads > 0)
    bytes(Slot::AttentionBackward) =
        cuda::attention_backward_workspace_bytes(s.batch, s.seq_len, s.heads, s.head_dim);
  bytes(Slot::NormPartials) = std::max(cuda::rmsnorm_backward_scratch_bytes(s.d_model),
                                       cuda::rmsnorm_backward_scratch_bytes(s.head_dim));
  // The timing of an accumulating product's algorithms (matmul.cu) at its first call: a
  // fixed size, shared with the other ops' groups (at 1B it adds 64 MiB to standard's
  // scratch, nothing to routing's, whose group is larger).
  if (N > 0) bytes(Slot::MatmulTune) = cuda::kMatmulTuneScratchBytes;
  bytes(Slot::EmbeddingSort) = cuda::embedding_backward_scratch_bytes(int64_t(N));
  const RoutingLayout& lay = s.routing;
  if (lay.sites > 0 && s.routing_heads > 0) {
    const size_t H = size_t(s.routing_heads);
    size_t ns = 0;  // the most sites that read one slot (the tables' and the pairs' rows)
    for (int i = 0; i < lay.sources; ++i) ns = std::max(ns, size_t(lay.last_site(i) - i + 1));
    bytes(Slot::RoutingTables) = ns * d * sizeof(float);  // fp32 (backward); bf16 hi + lo (logits)
    // Every site's q*g for the whole pass: fp32 rows, then the logits kernel's records.
    bytes(Slot::RoutingPassTables) = cuda::routing_pass_tables_bytes(lay.sites, s.d_model);
    bytes(Slot::RoutingValueGrad) = N * d * sizeof(float);
    bytes(Slot::RoutingKeyGrad) = N * d * sizeof(float);
    bytes(Slot::RoutingPairSplit) = 2 * ns * H * N * sizeof(uint16_t);  // bf16 hi + lo
    const int k =
        std::min(s.mix_tile_sites, cuda::routing_tile_sites(lay, s.d_model, s.routing_heads));
    if (k >= 2) bytes(Slot::RoutingTile) = size_t(k - 1) * (N * d + 2 * H * N) * sizeof(float);
    if (std::min(s.backward_tile_slots,
                 cuda::routing_backward_tile_slots(lay, s.d_model, s.routing_heads)) >= 2) {
      bytes(Slot::RoutingBackTile) = N * (d + 1) * sizeof(float);  // row + radial sum
      bytes(Slot::RoutingPairDs) = cuda::routing_pair_ds_bytes(int64_t(N), int(ns), int(H));
    } else {  // the plain calls' share (value versions 8-9)
      bytes(Slot::RoutingPairDs) = cuda::routing_value_ds_bytes(int64_t(N), int(ns), int(H));
    }
  }
  const int n = s.hyper_streams;
  if (n >= 1 && n <= cuda::kHyperMaxStreams && N > 0) {
    size_t floats = cuda::hyper_workspace_floats(int64_t(N * d), n);
    if (s.hyper_dynamic)
      floats = std::max(floats, cuda::hyper_dynamic_workspace_floats(int64_t(N), int64_t(d), n));
    bytes(Slot::HyperPartials) = floats * sizeof(float);
  }
  bytes(Slot::RopeTable) = cuda::rope_table_bytes(s.head_dim, s.seq_len);
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };  // MemoryPlan::kAlignment
  // The slots that outlive an op: the two depth tiles (never in flight together), the RoPE
  // table and the pass's q*g tables, apart from each other and from the groups below.
  l.offset[size_t(Slot::RopeTable)] =
      std::max(up(bytes(Slot::RoutingTile)), up(bytes(Slot::RoutingBackTile)));
  l.offset[size_t(Slot::RoutingPassTables)] =
      l.offset[size_t(Slot::RopeTable)] + up(bytes(Slot::RopeTable));
  const size_t tiles =
      l.offset[size_t(Slot::RoutingPassTables)] + up(bytes(Slot::RoutingPassTables));
  size_t local = 0;
  static const std::vector<std::vector<Slot>> groups = {
      {Slot::AttentionBackward},
      {Slot::NormPartials},
      {Slot::HyperPartials},
      {Slot::MatmulTune},
      {Slot::EmbeddingSort},
      {Slot::RoutingTables, Slot::RoutingValueGrad, Slot::RoutingKeyGrad, Slot::RoutingPairSplit,
       Slot::RoutingPairDs}};
  for (const std::vector<Slot>& group : groups) {
    size_t at = tiles;
    for (Slot slot : group) {
      l.offset[size_t(slot)] = at;
      at += up(bytes(slot));
    }
    local = std::max(local, at - tiles);
  }
  l.total = tiles + local;
  return l;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int n = cuda::device_count();
    if (device < 0 || device >= n)
      fail("CUDA device ", device, " does not exist (", n, " device(s) found)");
    CUDA_CHECK(cudaSetDevice(device_));
    cuda::apply_kernel_versions_from_env();
    CUDA_CHECK(cudaStreamCreateWithFlags(&main_stream_, cudaStreamNonBlocking));
    stream_ = main_stream_;
    CUBLAS_CHECK(cublasLtCreate(&mm_.lt));
    CUBLAS_CHECK(cublasCreate(&mm_.blas));
    CUBLAS_CHECK(cublasSetStream(mm_.blas, stream_));
    // 32 MiB: cuBLASLt's recommendation for Hopper is at least 32 MiB for the best kernels.
    mm_.workspace_bytes = size_t(32) << 20;
    CUDA_CHECK(cudaMalloc(&mm_.workspace, mm_.workspace_bytes));
    count(mm_.workspace, mm_.workspace_bytes);
    CUBLAS_CHECK(cublasSetWorkspace(mm_.blas, mm_.workspace, mm_.workspace_bytes));
    mm_.tune_scratch = [this](size_t bytes) -> void* {
      const size_t slot = size_t(cuda::ScratchSlot::MatmulTune);
      if (bytes > cuda::kMatmulTuneScratchBytes || (bound_.memory.data && bytes > layout_.bytes[slot]))
        return nullptr;
      return scratch(cuda::ScratchSlot::MatmulTune, bytes);
    };
    CUDA_CHECK(cudaMalloc(&scratch_, cuda::kSumSquaresScratch * sizeof(double)));
    count(scratch_, cuda::kSumSquaresScratch * sizeof(double));
    routing_ctx_.blas = mm_.blas;
    make_side_stream();  // here, not at the first side work: a model's step allocates nothing
    routing_ctx_.scratch = [this](cuda::ScratchSlot slot, size_t bytes) {
      return scratch(slot, bytes);
    };
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(main_stream_);
    cudaStreamSynchronize(side_stream_);
    cudaEventDestroy(side_ready_);
    cudaEventDestroy(side_done_);
    cudaEventDestroy(routing_ctx_.key_beside.ready);
    cudaEventDestroy(routing_ctx_.key_beside.done);
    cudaFree(mm_side_.workspace);
    cublasDestroy(mm_side_.blas);
    cudaStreamDestroy(side_stream_);
    cudaFree(scratch_);
    for (cudaEvent_t e : marks_) cudaEventDestroy(e);
    for (auto& buf : scratch_bufs_)
      if (buf.ptr) cudaFree(buf.ptr);
    cudaFree(mm_.workspace);
    cublasDestroy(mm_.blas);
    cublasLtDestroy(mm_.lt);
    cudaStreamDestroy(main_stream_);
  }

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  DType act_dtype() const override { return DType::BF16; }
  DType stat_dtype() const override { return DType::F32; }
  DType grad_dtype() const override { return DType::F32; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (bytes == 0) return nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      fail("CUDA: cannot allocate ", bytes, " bytes on device ", device_, " (", free_b,
           " free of ", total_b, "): ", cudaGetErrorString(err));
    }
    count(p, bytes);
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    uncount(p);
    CUDA_CHECK(cudaFree(p));
  }
  int64_t peak_bytes_in_use() const override { return peak_; }
  int64_t device_allocations() const override { return allocations_; }
  std::string timed_choices() const override { return cuda::matmul_choices(); }
  int use_timed_choices(const std::string& text, std::string* why_not) override {
    return cuda::matmul_use_choices(text, why_not);
  }
  size_t op_scratch_bytes(const OpScratchShapes& shapes) const override {
    return scratch_layout(shapes).total;
  }
  OpScratch bind_op_scratch(const OpScratch& scratch) override {
    ScratchLayout layout;
    if (scratch.memory.data) {
      layout = scratch_layout(scratch.shapes);
      MHAR_CHECK(scratch.memory.bytes() >= layout.total, "CUDA op scratch: ",
                 scratch.memory.bytes(), " bytes bound for shapes that need ", layout.total);
    }
    // A depth tile in flight (routing_mix.cu) keeps its partial sums in the scratch it began in.
    if (scratch.memory.data != bound_.memory.data) {
      routing_ctx_.tile = cuda::MixTile{};
      routing_ctx_.back_tile = cuda::BackTile{};
    }
    // The RoPE table is refilled after every binding (a pass's; one small kernel): a slot
    // at the same address may belong to another plan and hold anything. So are the routing
    // q*g tables, once per pass: a binding starts a pass, unbinding ends it.
    rope_table_ = cuda::RopeTable{};
    routing_ctx_.qg = cuda::QgPassTables{};
    routing_ctx_.qg.pass = scratch.memory.data != nullptr;
    join_key_grads();
    routing_ctx_.key_beside.stream = nullptr;  // until the pass's first side work
    OpScratch previous = bound_;
    bound_ = scratch;
    layout_ = layout;
    return previous;
  }
  void zero(Tensor t) override {
    if (t.bytes()) CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), stream_));
  }
  void copy(Tensor dst, Tensor src) override {
    MHAR_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy ", dst.shape_str(),
               dtype_name(dst.dtype), " <- ", src.shape_str(), dtype_name(src.dtype));
    if (dst.bytes() && dst.data != src.data)
      CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.bytes(), cudaMemcpyDeviceToDevice,
                                 stream_));
  }

  void upload(Tensor dst, const double* host) override {
    const int64_t n = dst.numel();
    std::vector<unsigned char> staging(dst.bytes());
    switch (dst.dtype) {
      case DType::F64: std::memcpy(staging.data(), host, dst.bytes()); break;
      case DType::F32: {
        auto* p = reinterpret_cast<float*>(staging.data());
        for (int64_t i = 0; i < n; ++i) p[i] = float(host[i]);
        break;
      }
      case DType::BF16: {
        auto* p = reinterpret_cast<uint16_t*>(staging.data());
        for (int64_t i = 0; i < n; ++i) p[i] = host_float_to_bf16(float(host[i]));
        break;
      }
      case DType::I32: {
        auto* p = reinterpret_cast<int32_t*>(staging.data());
        for (int64_t i = 0; i < n; ++i) p[i] = int32_t(host[i]);
        break;
      }
    }
    put(dst, staging.data());
  }
  void download(double* host, Tensor src) override {
    join_key_grads();  // src may be what they add into
    const int64_t n = src.numel();
    std::vector<unsigned char> staging(src.bytes());
    if (src.bytes()) {
      CUDA_CHECK(cudaMemcpyAsync(staging.data(), src.data, src.bytes(), cudaMemcpyDeviceToHost,
                                 stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    switch (src.dtype) {
      case DType::F64: std::memcpy(host, staging.data(), src.bytes()); break;
      case DType::F32: {
        auto* p = reinterpret_cast<const float*>(staging.data());
        for (int64_t i = 0; i < n; ++i) host[i] = p[i];
        break;
      }
      case DType::BF16: {
        auto* p = reinterpret_cast<const uint16_t*>(staging.data());
        for (int64_t i = 0; i < n; ++i) host[i] = host_bf16_to_float(p[i]);
        break;
      }
      case DType::I32: {
        auto* p = reinterpret_cast<const int32_t*>(staging.data());
        for (int64_t i = 0; i < n; ++i) host[i] = p[i];
        break;
      }
    }
  }
  void upload_tokens(Tensor dst, const int32_t* host) override {
    cuda::check_dtype(dst, DType::I32, "upload_tokens", "dst");
    put(dst, host);
  }
  void synchronize() override {
    MHAR_CHECK(!on_side(), "synchronize() between side_work_begin() and side_work_end()");
    side_work_join();
    join_key_grads();
    CUDA_CHECK(cudaStreamSynchronize(main_stream_));
  }
  void side_work_begin() override {
    MHAR_CHECK(!on_side(), "side_work_begin() twice without side_work_end()");
    if (cuda::side_stream_version < 2) return;
    if (cuda::side_stream_version == 3 && bound_.memory.data)
      routing_ctx_.key_beside.stream = side_stream_;
    CUDA_CHECK(cudaEventRecord(side_ready_, main_stream_));
    CUDA_CHECK(cudaStreamWaitEvent(side_stream_, side_ready_, 0));
    stream_ = side_stream_;
  }
  void side_work_end() override {
    if (!on_side()) return;
    CUDA_CHECK(cudaEventRecord(side_done_, side_stream_));
    stream_ = main_stream_;
    side_pending_ = true;
  }
  void side_work_join() override {
    MHAR_CHECK(!on_side(), "side_work_join() between side_work_begin() and side_work_end()");
    if (!side_pending_) return;
    CUDA_CHECK(cudaStreamWaitEvent(main_stream_, side_done_, 0));
    side_pending_ = false;
  }
  // Events recorded on the stream; the pool grows to the most marks one profile needs.
  int timing_mark() override {
    if (used_marks_ == marks_.size()) {
      cudaEvent_t e;
      CUDA_CHECK(cudaEventCreate(&e));
      marks_.push_back(e);
    }
    CUDA_CHECK(cudaEventRecord(marks_[used_marks_], stream_));
    return int(used_marks_++);
  }
  double timing_ms(int a, int b) override {
    MHAR_CHECK(a >= 0 && b >= 0 && size_t(a) < used_marks_ && size_t(b) < used_marks_, "timing marks ", a,
               " and ", b, " of ", used_marks_);
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[size_t(a)], marks_[size_t(b)]));
    return double(ms);
  }
  void timing_reset() override { used_marks_ = 0; }

  void embedding_forward(Tensor out, Tensor tokens, Tensor table) override {
    cuda::embedding_forward(stream_, out, tokens, table);
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) override {
    cuda::embedding_backward(stream_, dtable, dout, tokens, routing_ctx_.scratch);
  }
  void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) override {
    cuda::rmsnorm_forward(stream_, y, rstd, x, w, eps);
  }
  void add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b, Tensor w,
                           double eps) override {
    cuda::add_rmsnorm_forward(stream_, x, y, rstd, a, b, w, eps);
  }
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool accumulate_dx) override {
    cuda::rmsnorm_backward(stream_, dx, dw, dy, x, w, rstd, accumulate_dx, routing_ctx_.scratch);
  }
  void matmul(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, bool accumulate) override {
    cuda::matmul(stream_, on_side() ? mm_side_ : mm_, c, a, b, trans_a, trans_b, accumulate);
  }
  void qk_norm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                            double theta, int64_t first_position) override {
    const int64_t T = y.ndim == 4 ? y.dim(1) : 0;
    cuda::qk_norm_rope_forward(stream_, y, rstd, x, w, eps, theta, first_position,
                               rope_table(theta, w.numel(), first_position + T));
  }
  void qk_norm_rope_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                             double theta, bool accumulate_dx) override {
    const int64_t T = dy.ndim == 4 ? dy.dim(1) : 0;
    cuda::qk_norm_rope_backward(stream_, dx, dw, dy, x, w, rstd, theta, accumulate_dx,
                                routing_ctx_.scratch, rope_table(theta, w.numel(), T));
  }
  void qk_norm_rope_forward_qk(const QkNormRopeOperands& q, const QkNormRopeOperands& k,
                               double eps, double theta, int64_t first_position) override {
    const int64_t T = q.y.ndim == 4 ? q.y.dim(1) : 0;
    cuda::qk_norm_rope_forward_qk(stream_, q, k, eps, theta, first_position,
                                  rope_table(theta, q.w.numel(), first_position + T));
  }
  void qk_norm_rope_backward_qk(const QkNormRopeGradOperands& q, const QkNormRopeGradOperands& k,
                                double theta, bool accumulate_dx) override {
    const int64_t T = q.dy.ndim == 4 ? q.dy.dim(1) : 0;
    cuda::qk_norm_rope_backward_qk(stream_, q, k, theta, accumulate_dx, routing_ctx_.scratch,
                                   rope_table(theta, q.w.numel(), T));
  }
  void rope(Tensor x, double theta, bool backward) override {
    cuda::rope(stream_, x, theta, backward);
  }
  void rope_at(Tensor x, double theta, int64_t first_position) override {
    MHAR_CHECK(first_position >= 0, "rope_at position ", first_position);
    cuda::rope(stream_, x, theta, false, first_position);
  }
  void attention_cached(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache) override {
    cuda::attention_cached(stream_, out, q, k_cache, v_cache);
  }
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override {
    cuda::attention_forward(stream_, out, lse, q, k, v);
  }
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override {
    // Scratch for the backward's row dots and (Hopper) score-gradient tiles.
    const size_t need = q.ndim == 4 ? cuda::attention_backward_workspace_bytes(
                                          q.dim(0), q.dim(1), q.dim(2), q.dim(3))
                                    : 0;
    void* workspace = need ? scratch(cuda::ScratchSlot::AttentionBackward, need) : nullptr;
    cuda::attention_backward(stream_, dq, dk, dv, dout, q, k, v, out, lse, workspace, need);
  }
  void swiglu_forward(Tensor h, Tensor gate_up) override {
    cuda::swiglu_forward(stream_, h, gate_up);
  }
  void swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) override {
    cuda::swiglu_backward(stream_, d_gate_up, h, dh, gate_up);
  }
  void add(Tensor out, Tensor a, Tensor b) override { cuda::add(stream_, out, a, b); }
  void add_inplace(Tensor y, Tensor x) override { cuda::add_inplace(stream_, y, x); }
  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                     bool compute_grad) override {
    cuda::cross_entropy(stream_, losses, logits, targets, grad_scale, compute_grad);
  }
  void routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v, const RoutingParams& p,
                             const RoutingLayout& layout, int source, int heads,
                             double eps) override {
    cuda::routing_source_logits(stream_, routing_ctx_, weights, inv_rms, v, p, layout, source, heads, eps);
  }
  void routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout,
                   int site, int heads) override {
    cuda::routing_mix(stream_, routing_ctx_, x, weights, history, layout, site, heads);
  }
  void routing_mix_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                           const RoutingLayout& layout, int site, int heads, Tensor norm_w,
                           double eps) override {
    cuda::routing_mix_rmsnorm(stream_, routing_ctx_, x, y, rstd, weights, history, layout, site,
                              heads, norm_w, eps);
  }
  void routing_mix_tile(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout,
                        int site, int count, int heads) override {
    cuda::routing_mix_tile(stream_, routing_ctx_, x, weights, history, layout, site, count, heads);
  }
  void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                                const RoutingLayout& layout, int site, int count, int heads,
                                Tensor norm_w, double eps) override {
    cuda::routing_mix_tile_rmsnorm(stream_, routing_ctx_, x, y, rstd, weights, history, layout,
                                   site, count, heads, norm_w, eps);
  }
  int routing_tile_sites(const RoutingLayout& layout, int64_t d, int heads) const override {
    return cuda::routing_tile_sites(layout, d, heads);
  }
  std::vector<int> routing_tile_plan(const RoutingLayout& layout, int64_t d,
                                     int heads) const override {
    return cuda::routing_tile_plan(layout, d, heads);
  }
  void routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                               const std::vector<Tensor>& site_dx, Tensor x, Tensor v,
                               Tensor inv_rms,
                               const RoutingParams& p, const RoutingLayout& layout, int source,
                               int heads) override {
    cuda::routing_source_backward(stream_, routing_ctx_, dv, weights, ubar, gsum, site_dx, x, v, inv_rms, p,
                                  layout, source, heads);
  }
  void routing_source_backward_tile(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                    const std::vector<Tensor>& site_dx, Tensor x, Tensor history,
                                    Tensor inv_rms, const RoutingParams& p,
                                    const RoutingLayout& layout, int source, int count,
                                    int heads) override {
    cuda::routing_source_backward_tile(stream_, routing_ctx_, dv, weights, ubar, gsum, site_dx, x,
                                       history, inv_rms, p, layout, source, count, heads);
  }
  int routing_backward_tile_slots(const RoutingLayout& layout, int64_t d, int heads) const override {
    return cuda::routing_backward_tile_slots(layout, d, heads);
  }
  void routing_param_grads(const RoutingParams& p, Tensor gsum) override {
    join_key_grads();  // gsum's last adds
    cuda::routing_param_grads(stream_, p, gsum);
  }
  void routing_stats(Tensor stats, Tensor weights, const RoutingLayout& layout, int site,
                     int heads) override {
    cuda::routing_stats(stream_, stats, weights, layout, site, heads);
  }
  bool has_hyper_ops() const override { return true; }
  // Static and dynamic Hyper-Connections take the same stream counts.
  void check_hyper(int n, bool /*dynamic*/) const override {
    if (n < 1 || n > cuda::kHyperMaxStreams)
      fail("residual.hyper_n = ", n, ": the CUDA kernels of residual.mode hyper take 1 to ",
           cuda::kHyperMaxStreams, " streams; use fewer or run it with --device cpu");
  }
  void hyper_mix(Tensor x, Tensor H, Tensor coef) override { cuda::hyper_mix(stream_, x, H, coef); }
  void hyper_mix_backward(Tensor dH, Tensor dcoef, Tensor dx, Tensor H, Tensor coef,
                          bool accumulate) override {
    cuda::hyper_mix_backward(stream_, dH, dcoef, dx, H, coef, accumulate,
                             hyper_workspace(dx.numel(), int(dH.ndim ? dH.dim(0) : 0)));
  }
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override {
    cuda::hyper_update(stream_, out, in, v, Ar, B);
  }
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override {
    cuda::hyper_update_backward(stream_, din, dv, dAr, dB, dout, in, v, Ar, B,
                                hyper_workspace(v.numel(), int(dout.ndim ? dout.dim(0) : 0)));
  }
  void hyper_dynamic_coef(Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W, Tensor Am,
                          Tensor Ar, Tensor B, Tensor s_a, Tensor s_b, double eps) override {
    cuda::hyper_dynamic_coef(stream_, C, T, rstd, H, W, Am, Ar, B, s_a, s_b, eps);
  }
  void hyper_mix_dynamic(Tensor x, Tensor H, Tensor C) override {
    cuda::hyper_mix_dynamic(stream_, x, H, C);
  }
  void hyper_mix_dynamic_backward(Tensor dH, Tensor dC, Tensor dx, Tensor H, Tensor C) override {
    cuda::hyper_mix_dynamic_backward(stream_, dH, dC, dx, H, C);
  }
  void hyper_update_dynamic(Tensor out, Tensor in, Tensor v, Tensor C) override {
    cuda::hyper_update_dynamic(stream_, out, in, v, C);
  }
  void hyper_update_dynamic_backward(Tensor din, Tensor dv, Tensor dC, Tensor dout, Tensor in,
                                     Tensor v, Tensor C) override {
    cuda::hyper_update_dynamic_backward(stream_, din, dv, dC, dout, in, v, C);
  }
  void hyper_dynamic_coef_backward(Tensor dH, Tensor dW, Tensor dAm, Tensor dAr, Tensor dB,
                                   Tensor ds_a, Tensor ds_b, Tensor dC, Tensor H, Tensor W,
                                   Tensor T, Tensor rstd, Tensor s_a, Tensor s_b) override {
    cuda::HyperWorkspace ws;
    if (H.ndim == 3 && H.dim(0) >= 1 && H.dim(0) <= cuda::kHyperMaxStreams && H.numel() > 0) {
      const size_t need = cuda::hyper_dynamic_workspace_floats(H.dim(1), H.dim(2), int(H.dim(0)));
      ws = {static_cast<float*>(scratch(cuda::ScratchSlot::HyperPartials, need * sizeof(float))),
            need};
    }
    cuda::hyper_dynamic_coef_backward(stream_, dH, dW, dAm, dAr, dB, ds_a, ds_b, dC, H, W, T,
                                      rstd, s_a, s_b, ws);
  }
  bool has_delta_ops() const override { return true; }
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override {
    cuda::delta_gate(stream_, x, base, alpha, r);
  }
  void delta_gate_backward(Tensor dr, Tensor dalpha, Tensor dx, Tensor r, Tensor alpha,
                           Tensor scratch) override {
    cuda::delta_gate_backward(stream_, dr, dalpha, dx, r, alpha, scratch);
  }
  void delta_null_forward(Tensor out, Tensor row) override {
    cuda::delta_null_forward(stream_, out, row);
  }
  void delta_null_backward(Tensor drow, Tensor dout, Tensor scratch) override {
    cuda::delta_null_backward(stream_, drow, dout, scratch);
  }
  void delta_stream_advance(Tensor stream, Tensor slot, Tensor prev) override {
    cuda::delta_stream_advance(stream_, stream, slot, prev);
  }
  void delta_resid_gate_backward(Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx, Tensor r,
                                 Tensor alpha, Tensor scratch) override {
    cuda::delta_resid_gate_backward(stream_, dresid, dr, dalpha, dx, r, alpha, scratch);
  }
  void delta_source_grad(Tensor out, Tensor dresid, Tensor slot, Tensor next) override {
    cuda::delta_source_grad(stream_, out, dresid, slot, next);
  }
  void delta_site_forward(const DeltaSiteForward& a) override {
    // One fused kernel where the shapes allow it (cuda/routing_delta_forward.cu), else the
    // sequence.
    if (!cuda::routing_delta_site_forward(stream_, routing_ctx_, a)) Backend::delta_site_forward(a);
  }
  void delta_site_backward(const DeltaSiteBackward& a) override {
    // One fused kernel where the shapes allow it (cuda/routing_backward.cu), else the
    // sequence.
    if (!cuda::routing_delta_site_backward(stream_, routing_ctx_, a)) Backend::delta_site_backward(a);
  }
  double sum_squares(Tensor t) override { return cuda::sum_squares(stream_, t, scratch_); }
  void adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
             const AdamW& hp) override {
    cuda::adamw(stream_, param, master, grad, m, v, hp);
  }
  std::unique_ptr<AdamWGroup> adamw_group(std::vector<AdamWSegment> segments) override {
    return cuda::adamw_group(std::move(segments), this, [this](size_t b) { return allocate(b); },
                             [this](void* p) { release(p); });
  }
  void adamw_step(const AdamWGroup& group, const AdamW& hp) override {
    if (!cuda::adamw_step(stream_, group, this, hp)) Backend::adamw_step(group, hp);
  }

 private:
  std::vector<cudaEvent_t> marks_;
  size_t used_marks_ = 0;
  // Every cudaMalloc of this backend, for peak_bytes_in_use and device_allocations.
  void count(void* p, size_t bytes) {
    ++allocations_;
    sizes_[p] = bytes;
    in_use_ += int64_t(bytes);
    peak_ = std::max(peak_, in_use_);
  }
  void uncount(void* p) {
    auto it = sizes_.find(p);
    if (it == sizes_.end()) return;
    in_use_ -= int64_t(it->second);
    sizes_.erase(it);
  }
  // Scratch for the hyper coefficient-gradient partial sums (kernels.h's grow-only slots).
  cuda::HyperWorkspace hyper_workspace(int64_t M, int n) {
    const size_t need = n >= 1 && n <= cuda::kHyperMaxStreams && M > 0
                            ? cuda::hyper_workspace_floats(M, n) : 0;
    if (need == 0) return {};
    return {static_cast<float*>(scratch(cuda::ScratchSlot::HyperPartials, need * sizeof(float))),
            need};
  }
  void put(Tensor dst, const void* host) {
    join_key_grads();  // dst may be what they read or add into
    if (!dst.bytes()) return;
    CUDA_CHECK(cudaMemcpyAsync(dst.data, host, dst.bytes(), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffer may go away on return
  }

  int device_;
  // The stream ops are issued to: the main stream, or between side_work_begin() and
  // side_work_end() the side stream.
  cudaStream_t stream_ = nullptr;
  cudaStream_t main_stream_ = nullptr;

 public:
  // For the NCCL communicator, which orders its stream against this one.
  cudaStream_t stream() const { return main_stream_; }
  int device() const { return device_; }

 private:
  cuda::MatmulContext mm_;
  // Side work (made with the backend, whichever side_stream version runs): its stream, the
  // events that order it against the main stream (side_ready_: the main stream's work
  // before the begin; side_done_: the side work up to the last end), and its matmul context
  // (Lt's handle shared; its own cuBLAS handle and workspace).
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t side_ready_ = nullptr, side_done_ = nullptr;
  cuda::MatmulContext mm_side_;
  bool side_pending_ = false;  // side work ended and not yet joined
  // The main stream waits for the key gradients issued beside (side_stream version 3).
  void join_key_grads() {
    cuda::KeyGradsBeside& b = routing_ctx_.key_beside;
    if (!b.pending) return;
    CUDA_CHECK(cudaStreamWaitEvent(main_stream_, b.done, 0));
    b.pending = false;
  }
  bool on_side() const { return stream_ == side_stream_; }
  void make_side_stream() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&side_ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&side_done_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&routing_ctx_.key_beside.ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&routing_ctx_.key_beside.done, cudaEventDisableTiming));
    mm_side_.lt = mm_.lt;
    mm_side_.tune_scratch = mm_.tune_scratch;
    mm_side_.workspace_bytes = mm_.workspace_bytes;
    CUDA_CHECK(cudaMalloc(&mm_side_.workspace, mm_side_.workspace_bytes));
    count(mm_side_.workspace, mm_side_.workspace_bytes);
    CUBLAS_CHECK(cublasCreate(&mm_side_.blas));
    CUBLAS_CHECK(cublasSetWorkspace(mm_side_.blas, mm_side_.workspace, mm_side_.workspace_bytes));
  }
  double* scratch_ = nullptr;
  // The ops' temporaries (kernels.h, ScratchSlot): the bound op scratch's part for the
  // slot (scratch_layout), or with none bound the slot's grow-only buffer (allocated when
  // first needed, counted in the peak).
  OpScratch bound_;
  ScratchLayout layout_;
  struct ScratchBuf {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  ScratchBuf scratch_bufs_[kSlots];
  // The fused QK-norm + RoPE's cos/sin table covering positions [0, positions) (computed
  // once, then kept while theta and head_dim stay), or none where its slot cannot hold
  // them: the model's plan sizes it for seq_len positions; unbound (tests, tools), up to
  // kUnboundRopeTableBytes. Without a table the kernels compute cos/sin themselves.
  static constexpr size_t kUnboundRopeTableBytes = size_t(16) << 20;
  cuda::RopeTable rope_table(double theta, int64_t head_dim, int64_t positions) {
    const size_t bytes = cuda::rope_table_bytes(head_dim, positions);
    if (bytes == 0) return {};
    const cuda::RopeTable& t = rope_table_;
    if (t.data && t.theta == theta && t.head_dim == head_dim && t.positions >= positions) return t;
    const size_t slot = size_t(cuda::ScratchSlot::RopeTable);
    if (bound_.memory.data ? bytes > layout_.bytes[slot] : bytes > kUnboundRopeTableBytes)
      return {};
    // Unbound, whole blocks of 1024 positions: decoding one token a call refills it rarely.
    int64_t fill = positions;
    if (!bound_.memory.data) {
      fill = std::max(fill, (positions + 1023) / 1024 * 1024);
      if (cuda::rope_table_bytes(head_dim, fill) > kUnboundRopeTableBytes) fill = positions;
    } else {
      fill = int64_t(layout_.bytes[slot] / cuda::rope_table_bytes(head_dim, 1));
    }
    void* p = scratch(cuda::ScratchSlot::RopeTable, cuda::rope_table_bytes(head_dim, fill));
    rope_table_ = cuda::rope_table_fill(stream_, p, theta, head_dim, fill);
    return rope_table_;
  }
  cuda::RopeTable rope_table_;

  void* scratch(cuda::ScratchSlot slot, size_t bytes) {
    if (bound_.memory.data) {
      const size_t i = size_t(slot);
      MHAR_CHECK(bytes <= layout_.bytes[i], "CUDA op scratch: the ", cuda::scratch_slot_name(slot),
                 " need ", bytes, " bytes, the model planned ", layout_.bytes[i],
                 " (Backend::op_scratch_bytes for its shapes)");
      return static_cast<char*>(bound_.memory.data) + layout_.offset[i];
    }
    ScratchBuf& b = scratch_bufs_[size_t(slot)];
    if (bytes > b.bytes) {
      CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be in use
      if (b.ptr) {
        uncount(b.ptr);
        CUDA_CHECK(cudaFree(b.ptr));
      }
      b = ScratchBuf{};
      CUDA_CHECK(cudaMalloc(&b.ptr, bytes));
      count(b.ptr, bytes);
      b.bytes = bytes;
    }
    return b.ptr;
  }
  cuda::RoutingContext routing_ctx_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t in_use_ = 0, peak_ = 0, allocations_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

namespace cuda {
void* backend_stream(Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  if (!b) fail(backend.name(), " is not the CUDA backend (NCCL needs its stream)");
  return b->stream();
}
int backend_device(Backend& backend) {
  auto* b = dynamic_cast<CudaBackend*>(&backend);
  if (!b) fail(backend.name(), " is not the CUDA backend (NCCL needs its device)");
  return b->device();
}

int sm_count() {
  static int sms = [] {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return sms;
}
int grid_stride_blocks(int64_t work_items, int threads) {
  const int sms = sm_count();
  int64_t want = ceil_div(work_items, threads);
  int64_t cap = int64_t(sms) * 8;
  return int(want < 1 ? 1 : (want < cap ? want : cap));
}
}  // namespace cuda

}  // namespace mhar
