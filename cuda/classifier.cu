// classifier.cu: fused softmax cross-entropy over logits [N, V] (BF16 or F32), targets [N]
// (I32, in [0, V): an id outside traps), losses [N] (F32, overwritten):
//   losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
// With compute_grad the logits row is overwritten in place by its gradient
//   grad_scale * (softmax(logits[n]) - onehot(target[n])).
// One block per row: pass 1 keeps a per-thread online (max, sum of exp) in fp32, merged
// across the block; pass 2 (gradient only) re-reads the row and writes each element
// once. No fp32 copy of the probabilities exists at any point: memory is the logits.
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

template <class T>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, T* logits, const int32_t* targets, int64_t V,
                         float grad_scale, bool compute_grad) {
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  __shared__ float row_lse, target_logit;
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) __trap();
  if (threadIdx.x == 0) target_logit = load(row[target]);

  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
    const float x = load(row[c]);
    if (x > m) {
      s = s * __expf(m - x) + 1.f;
      m = x;
    } else {
      s += __expf(x - m);
    }
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
  for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
    const float p = __expf(load(row[c]) - lse);
    row[c] = store<T>(grad_scale * (c == target ? p - 1.f : p));
  }
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
