// classifier.cu: fused softmax cross-entropy over logits [N, V] (BF16 or F32), targets [N]
// (I32, in [0, V): an id outside traps), losses [N] (F32, overwritten):
//   losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
// With compute_grad the logits row is overwritten in place by its gradient
//   grad_scale * (softmax(logits[n]) - onehot(target[n])).
// One block per row. The row is read in 16-byte vectors (8 bf16 or 4 floats; a scalar
// prologue up to the first 16-byte boundary and a scalar tail, so any V and any row
// alignment take the vector path): pass 1 keeps a per-thread online (max, sum of exp) in
// fp32, one rescale per vector, merged across the block; pass 2 (gradient only) re-reads
// the row and writes each element once. No fp32 copy of the probabilities exists at any
// point: memory is the logits. Bytes: 2 reads and 1 write of the row with the gradient,
// 1 read without; 512 threads with 16-byte loads and several blocks per SM keep enough
// loads in flight for the memory system (the scalar 2-byte loads of the first version
// reached 0.91 TB/s at 1B).
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

constexpr int kThreads = 512;

// Merge two (max, sum) online-softmax states.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  const float mn = fmaxf(m, m2);
  if (mn == -INFINITY) return;  // both empty
  s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
  m = mn;
}

// 16 bytes of T: the unit of the vector path.
template <class T> struct Pack {
  static constexpr int kN = 16 / int(sizeof(T));
  uint4 raw;
  __device__ __forceinline__ float get(int i) const {
    return load(reinterpret_cast<const T*>(&raw)[i]);
  }
  __device__ __forceinline__ void set(int i, float x) { reinterpret_cast<T*>(&raw)[i] = store<T>(x); }
};

// Folds values x[0..k) into the online state with one rescale.
template <int K>
__device__ __forceinline__ void fold(float& m, float& s, const float (&x)[K]) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < K; ++i) mx = fmaxf(mx, x[i]);
  if (mx == -INFINITY) return;  // every value -inf: contributes nothing
  if (mx > m) {
    s *= __expf(m - mx);  // m = -inf (nothing yet): s = 0 * 0
    m = mx;
  }
  float add = 0.f;
#pragma unroll
  for (int i = 0; i < K; ++i) add += __expf(x[i] - m);
  s += add;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                         float grad_scale, bool compute_grad) {
  using P = Pack<T>;
  constexpr int kN = P::kN;
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  __shared__ float row_lse, target_logit;
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();
  if (threadIdx.x == 0) target_logit = load(row[target]);

  // Scalar elements [0, head), vectors [head, head + nvec * kN), scalar tail after.
  const int64_t misalign = int64_t(reinterpret_cast<uintptr_t>(row) & 15) / int64_t(sizeof(T));
  const int64_t head = misalign == 0 ? 0 : (V < kN - misalign ? V : kN - misalign);
  const int64_t nvec = (V - head) / kN, tail = head + nvec * kN;
  P* vec = reinterpret_cast<P*>(row + head);

  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    const P p{*reinterpret_cast<const uint4*>(vec + i)};
    float x[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) x[k] = p.get(k);
    fold(m, s, x);
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x) {
    const float x[1] = {load(row[c])};
    fold(m, s, x);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_s[warp] = s;
  }
  __syncthreads();  // also publishes target_logit before any gradient write
  if (warp == 0) {
    m = lane < int(blockDim.x >> 5) ? sm_m[lane] : -INFINITY;
    s = lane < int(blockDim.x >> 5) ? sm_s[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      merge(m, s, m2, s2);
    }
    if (lane == 0) {
      row_lse = m + logf(s);
      losses[n] = row_lse - target_logit;
    }
  }
  if (!compute_grad) return;
  __syncthreads();
  const float lse = row_lse;
  auto grad = [&](float x, int64_t c) {
    const float p = __expf(x - lse);
    return grad_scale * (c == target ? p - 1.f : p);
  };
  for (int64_t c = threadIdx.x; c < head; c += blockDim.x) row[c] = store<T>(grad(load(row[c]), c));
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    P p{*reinterpret_cast<const uint4*>(vec + i)};
    const int64_t c0 = head + i * kN;
#pragma unroll
    for (int k = 0; k < kN; ++k) p.set(k, grad(p.get(k), c0 + k));
    *reinterpret_cast<uint4*>(vec + i) = p.raw;
  }
  for (int64_t c = tail + threadIdx.x; c < V; c += blockDim.x) row[c] = store<T>(grad(load(row[c]), c));
}

}  // namespace

void cross_entropy(cudaStream_t s, Tensor losses, Tensor logits, Tensor targets,
                   double grad_scale, bool compute_grad) {
  check_dtype(targets, DType::I32, "cross_entropy", "targets");
  check_dtype(losses, DType::F32, "cross_entropy", "losses");
  const int64_t N = targets.numel();
  check_numel(losses, N, "cross_entropy", "losses");
  MHAR_CHECK(N > 0 && logits.numel() % N == 0, "cross_entropy: logits ", logits.shape_str(),
             " for ", N, " targets");
  const int64_t V = logits.numel() / N;
  MHAR_CHECK(V > 0, "cross_entropy: empty vocabulary");
  MHAR_CHECK(N <= 0x7fffffff, "cross_entropy: too many rows");
  dispatch_float(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_kernel<T><<<unsigned(N), kThreads, 0, s>>>(
        losses.ptr<float>(), static_cast<T*>(logits.data), targets.ptr<int32_t>(), V,
        float(grad_scale), compute_grad);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace mhar::cuda
