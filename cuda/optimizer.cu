// optimizer.cu: AdamW (engine/backend.h), elementwise:
//   g = grad * grad_scale;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   w -= lr * ( m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + weight_decay * w )
// - With a master (F32): w is the master, updated in place, then rounded (nearest even)
//   into param (BF16 or F32). Without one, param must be F32 and is itself the master.
// - m, v are F32; grad is F32 (grad dtype) or BF16. Bias corrections are formed in fp64 on
//   the host; the per-element update runs in fp32, in one inline function (adamw_element)
//   that every kernel calls, its operations spelled as rounding intrinsics (no fma left
//   for the compiler to choose), so every path does the same fp32 operations: the same bits.
// Two entry points:
// - adamw: one tensor, the scalar grid-stride kernel (4-byte accesses). The reference the
//   group is tested against, and what Backend's default group loop calls.
// - adamw_group / adamw_step: the optimizer's whole shard in one launch per kind of
//   segment (param dtype, grad dtype, master or not: one kind in practice). The group
//   keeps two device tables, built once: one descriptor per segment (its five pointers,
//   its vector range, its weight-decay flag) and a list of chunks of kChunk elements that
//   never cross a segment (one block per chunk). A step passes only the hyperparameters
//   that change (lr, bias corrections, grad_scale) as kernel arguments. Within a segment,
//   from the first element `head` where all five pointers are 16-byte aligned, each thread
//   moves 8 elements per access: grad/m/v/master as two float4 each (grad bf16: one
//   16-byte load), the bf16 param as one 16-byte store; the head and the n - head % 8 tail
//   (and a whole segment whose pointers never align together) run the scalar update in the
//   same launch. Bytes per element (master, bf16 param, fp32 grad): read grad 4, m 4,
//   v 4, master 4; write m 4, v 4, master 4, param 2 = 30 bytes.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

struct Hyper {
  float lr, b1, b2, eps, wd, grad_scale, inv_c1, inv_c2;
};

Hyper make_hyper(const Backend::AdamW& hp) {
  MHAR_CHECK(hp.step >= 1, "adamw step ", hp.step, " (counts from 1)");
  const double c1 = 1.0 - std::pow(hp.beta1, double(hp.step));
  const double c2 = 1.0 - std::pow(hp.beta2, double(hp.step));
  return Hyper{float(hp.lr), float(hp.beta1), float(hp.beta2), float(hp.eps),
               float(hp.weight_decay), float(hp.grad_scale), float(1.0 / c1), float(1.0 / c2)};
}

// One element's update: m and v in place, the new weight returned. wd is the weight decay
// of the element's tensor. Every operation is written as its rounding intrinsic, so that
// no kernel's compilation can contract a different pair of them into an fma: the first
// GPU run of the group kernel, with the plain expression, differed from the scalar
// kernel in 40% of the moments (the same source, inlined into two kernels, fused
// differently). sqrtf and the division are IEEE-rounded (no fast-math in this build).
__device__ __forceinline__ float adamw_element(float grad, float& m, float& v, float w,
                                               const Hyper& hp, float wd) {
  const float g = __fmul_rn(grad, hp.grad_scale);
  const float mi = __fmaf_rn(hp.b1, m, __fmul_rn(__fsub_rn(1.f, hp.b1), g));
  const float vi = __fmaf_rn(hp.b2, v, __fmul_rn(__fmul_rn(__fsub_rn(1.f, hp.b2), g), g));
  m = mi;
  v = vi;
  const float denom = __fadd_rn(__fsqrt_rn(__fmul_rn(vi, hp.inv_c2)), hp.eps);
  const float update = __fmaf_rn(wd, w, __fdiv_rn(__fmul_rn(mi, hp.inv_c1), denom));
  return __fmaf_rn(-hp.lr, update, w);
}

template <class TP, class TG>
__global__ void adamw_kernel(TP* param, float* master, const TG* grad, float* m, float* v,
                             int64_t n, Hyper hp) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float mi = m[i], vi = v[i];
    const float w = master ? master[i] : load(param[i]);
    const float w_new = adamw_element(load(grad[i]), mi, vi, w, hp, hp.wd);
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = w_new;
    param[i] = store<TP>(w_new);
  }
}

// ---- the group: one launch over many segments

constexpr int kThreads = 256;
// Elements per chunk (one block's work): 8 vectors of 8 per thread.
constexpr int64_t kChunk = int64_t(kThreads) * 8 * 8;

struct SegDesc {
  void* param;
  float* master;  // null: param (F32) is the master
  const void* grad;
  float* m;
  float* v;
  int64_t head, vec_end;  // [head, vec_end): 8-element vectors, every pointer 16-byte aligned
  int decay;
};
struct Chunk {
  int64_t begin, end;  // elements of segment `seg`
  int seg;
};

template <class TP, class TG, bool kMaster>
__global__ void __launch_bounds__(kThreads) adamw_group_kernel(const SegDesc* __restrict__ segs,
                                                               const Chunk* __restrict__ chunks,
                                                               Hyper hp) {
  const Chunk c = chunks[blockIdx.x];
  const SegDesc s = segs[c.seg];
  TP* __restrict__ param = static_cast<TP*>(s.param);
  const TG* __restrict__ grad = static_cast<const TG*>(s.grad);
  float* __restrict__ master = s.master;
  float* __restrict__ m = s.m;
  float* __restrict__ v = s.v;
  const float wd = s.decay ? hp.wd : 0.f;
  const int64_t vb = c.begin > s.head ? c.begin : s.head;
  const int64_t ve = c.end < s.vec_end ? c.end : s.vec_end;
  for (int64_t i = vb + 8 * int64_t(threadIdx.x); i < ve; i += 8 * int64_t(kThreads)) {
    float g[8], mi[8], vi[8], w[8];
    load8(grad + i, g);
    load8(m + i, mi);
    load8(v + i, vi);
    if constexpr (kMaster) load8(master + i, w);
    else load8(param + i, w);
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = adamw_element(g[e], mi[e], vi[e], w[e], hp, wd);
    store8(m + i, mi);
    store8(v + i, vi);
    if constexpr (kMaster) store8(master + i, w);
    store8(param + i, w);
  }
  // The scalar head [begin, head) and tail [vec_end, end) (the whole chunk where the
  // segment never aligns: head = vec_end = n).
  const int64_t ranges[2][2] = {{c.begin, c.end < s.head ? c.end : s.head},
                                {c.begin > s.vec_end ? c.begin : s.vec_end, c.end}};
#pragma unroll
  for (int r = 0; r < 2; ++r)
    for (int64_t i = ranges[r][0] + threadIdx.x; i < ranges[r][1]; i += kThreads) {
      float mi = m[i], vi = v[i];
      const float w = kMaster ? master[i] : load(param[i]);
      const float w_new = adamw_element(load(grad[i]), mi, vi, w, hp, wd);
      m[i] = mi;
      v[i] = vi;
      if constexpr (kMaster) master[i] = w_new;
      param[i] = store<TP>(w_new);
    }
}

void check_segment(const Backend::AdamWSegment& s, const char* what) {
  const int64_t n = s.param.numel();
  check_numel(s.grad, n, what, "grad");
  check_numel(s.m, n, what, "m");
  check_numel(s.v, n, what, "v");
  check_dtype(s.m, DType::F32, what, "m");
  check_dtype(s.v, DType::F32, what, "v");
  if (s.master.empty()) {
    check_dtype(s.param, DType::F32, what, "param (no master)");
  } else {
    check_numel(s.master, n, what, "master");
    check_dtype(s.master, DType::F32, what, "master");
  }
  dispatch_float(s.param.dtype, what, [](auto) {});
  dispatch_float(s.grad.dtype, what, [](auto) {});
}

// The group of the CUDA backend: per kind, the device tables and the chunk count.
class CudaAdamWGroup final : public Backend::AdamWGroup {
 public:
  struct Kind {
    DType param, grad;
    bool master;
    SegDesc* segs = nullptr;
    Chunk* chunks = nullptr;
    int64_t num_chunks = 0;
  };
  CudaAdamWGroup(std::vector<Backend::AdamWSegment> segments, const void* owner,
                 std::function<void(void*)> release)
      : AdamWGroup(std::move(segments)), owner_(owner), release_(std::move(release)) {}
  ~CudaAdamWGroup() override {
    for (const Kind& k : kinds_) {
      release_(k.segs);
      release_(k.chunks);
    }
  }
  const void* owner() const { return owner_; }
  const std::vector<Kind>& kinds() const { return kinds_; }
  std::vector<Kind>& kinds() { return kinds_; }

 private:
  const void* owner_;
  std::function<void(void*)> release_;
  std::vector<Kind> kinds_;
};

bool aligned16_at(const void* p, int64_t elem, size_t elem_bytes) {
  return aligned16(static_cast<const char*>(p) + size_t(elem) * elem_bytes);
}

}  // namespace

void adamw(cudaStream_t s, Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
           const Backend::AdamW& hp) {
  check_segment({param, master, grad, m, v, false}, "adamw");
  const int64_t n = param.numel();
  const Hyper h = make_hyper(hp);
  if (n == 0) return;
  float* master_ptr = master.empty() ? nullptr : master.ptr<float>();
  dispatch_float(param.dtype, "adamw", [&](auto tp) {
    dispatch_float(grad.dtype, "adamw", [&](auto tg) {
      using TP = decltype(tp);
      using TG = decltype(tg);
      adamw_kernel<TP, TG><<<grid_stride_blocks(n, 256), 256, 0, s>>>(
          static_cast<TP*>(param.data), master_ptr, static_cast<const TG*>(grad.data),
          m.ptr<float>(), v.ptr<float>(), n, h);
      CUDA_CHECK_LAUNCH();
    });
  });
}

std::unique_ptr<Backend::AdamWGroup> adamw_group(std::vector<Backend::AdamWSegment> segments,
                                                 const void* owner,
                                                 const std::function<void*(size_t)>& allocate,
                                                 std::function<void(void*)> release) {
  // Every byte range a launch writes, to refuse overlapping segments (one launch updates
  // them all at once: an overlap would be a race, not the default loop's order).
  std::vector<std::pair<uintptr_t, uintptr_t>> written;
  for (const Backend::AdamWSegment& s : segments) {
    check_segment(s, "adamw group");
    for (const Tensor* t : {&s.param, &s.master, &s.m, &s.v})
      if (!t->empty() && t->numel() > 0) {
        const auto p = reinterpret_cast<uintptr_t>(t->data);
        written.push_back({p, p + size_t(t->bytes())});
      }
  }
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i)
    MHAR_CHECK(written[i].first >= written[i - 1].second,
               "adamw group: the tensors of its segments overlap (", written.size(),
               " written ranges)");
  // Gradients are read only (the kernel reads them through __restrict__ pointers): none
  // may overlap a written range.
  for (const Backend::AdamWSegment& s : segments) {
    if (s.grad.numel() == 0) continue;
    const auto lo = reinterpret_cast<uintptr_t>(s.grad.data), hi = lo + size_t(s.grad.bytes());
    auto it = std::lower_bound(written.begin(), written.end(), std::make_pair(hi, uintptr_t(0)));
    MHAR_CHECK(it == written.begin() || std::prev(it)->second <= lo,
               "adamw group: a gradient overlaps a tensor the step writes");
  }

  auto group = std::make_unique<CudaAdamWGroup>(std::move(segments), owner, std::move(release));
  std::vector<std::vector<SegDesc>> descs;
  std::vector<std::vector<Chunk>> chunks;
  for (const Backend::AdamWSegment& s : group->segments()) {
    const int64_t n = s.param.numel();
    if (n == 0) continue;
    const bool has_master = !s.master.empty();
    size_t k = 0;
    auto& kinds = group->kinds();
    while (k < kinds.size() && !(kinds[k].param == s.param.dtype && kinds[k].grad == s.grad.dtype &&
                                 kinds[k].master == has_master))
      ++k;
    if (k == kinds.size()) {
      kinds.push_back({s.param.dtype, s.grad.dtype, has_master});
      descs.emplace_back();
      chunks.emplace_back();
    }
    // head: the first element where all five pointers are 16-byte aligned (a multiple of
    // 8 elements later they are again); none within 8 elements: the segment runs scalar.
    int64_t head = n;
    for (int64_t h = 0; h < 8 && h < n; ++h)
      if (aligned16_at(s.param.data, h, dtype_size(s.param.dtype)) &&
          aligned16_at(s.grad.data, h, dtype_size(s.grad.dtype)) &&
          aligned16_at(s.m.data, h, 4) && aligned16_at(s.v.data, h, 4) &&
          (!has_master || aligned16_at(s.master.data, h, 4))) {
        head = h;
        break;
      }
    const int64_t vec_end = head + (n - head) / 8 * 8;
    const int seg = int(descs[k].size());
    MHAR_CHECK(descs[k].size() < size_t(INT32_MAX), "adamw group: too many segments");
    descs[k].push_back({s.param.data, has_master ? s.master.ptr<float>() : nullptr, s.grad.data,
                        s.m.ptr<float>(), s.v.ptr<float>(), head, vec_end, s.decay ? 1 : 0});
    // Chunk boundaries head + j * kChunk (vector-aligned), the first chunk taking the
    // scalar head, the last the tail; a segment that runs scalar is cut at j * kChunk.
    const int64_t base = head < n ? head : 0;
    int64_t begin = 0;
    for (int64_t b = base + kChunk; b < n; b += kChunk) {
      chunks[k].push_back({begin, b, seg});
      begin = b;
    }
    chunks[k].push_back({begin, n, seg});
  }
  for (size_t k = 0; k < group->kinds().size(); ++k) {
    auto& kind = group->kinds()[k];
    MHAR_CHECK(chunks[k].size() < size_t(INT32_MAX), "adamw group: ", chunks[k].size(),
               " chunks (the grid's limit is 2^31 - 1 blocks)");
    kind.segs = static_cast<SegDesc*>(allocate(descs[k].size() * sizeof(SegDesc)));
    kind.chunks = static_cast<Chunk*>(allocate(chunks[k].size() * sizeof(Chunk)));
    kind.num_chunks = int64_t(chunks[k].size());
    CUDA_CHECK(cudaMemcpy(kind.segs, descs[k].data(), descs[k].size() * sizeof(SegDesc),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(kind.chunks, chunks[k].data(), chunks[k].size() * sizeof(Chunk),
                          cudaMemcpyHostToDevice));
  }
  return group;
}

bool adamw_step(cudaStream_t s, const Backend::AdamWGroup& group, const void* owner,
                const Backend::AdamW& hp) {
  const auto* g = dynamic_cast<const CudaAdamWGroup*>(&group);
  if (!g || g->owner() != owner) return false;
  const Hyper h = make_hyper(hp);
  for (const CudaAdamWGroup::Kind& k : g->kinds()) {
    dispatch_float(k.param, "adamw group", [&](auto tp) {
      dispatch_float(k.grad, "adamw group", [&](auto tg) {
        using TP = decltype(tp);
        using TG = decltype(tg);
        if (k.master) {
          adamw_group_kernel<TP, TG, true>
              <<<unsigned(k.num_chunks), kThreads, 0, s>>>(k.segs, k.chunks, h);
        } else {
          // No master: the parameter is F32 (check_segment).
          adamw_group_kernel<float, TG, false>
              <<<unsigned(k.num_chunks), kThreads, 0, s>>>(k.segs, k.chunks, h);
        }
        CUDA_CHECK_LAUNCH();
      });
    });
  }
  return true;
}

}  // namespace mhar::cuda
