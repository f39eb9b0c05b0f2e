// routing.cu: depth routing (DESIGN.md section 2) for one site, any number of heads H
// dividing d. Layouts: history and dhistory [S, N, d] (slot i = source v_i; slots >= n_src
// are never touched), inv_rms [S, N] (F32), query and gain [d] (BF16 or F32), weights
// [N, H, n_src] (F32), x and dx [N, d]. Head h owns features [h*d/H, (h+1)*d/H).
//
// - routing_source_stats: inv_rms[n] = 1/sqrt(mean_c v[n,c]^2 + eps), overwritten. One warp
//   per token.
// - routing_forward: one pass over the sources per token with an online softmax per head,
//   fp32 logits and statistics:
//     s[n,i,h] = inv_rms[i,n] * sum_{c in h} q[c] g[c] v_i[n,c]
//     weights[n,h,i] = softmax_i s (overwritten);  x[n,c] = sum_i weights v_i[n,c] (overwritten)
//   The raw logits are parked in `weights` during the pass and normalised at the end.
// - routing_backward (+= into dhistory[0..n_src), dquery, dgain), with a = weights,
//   r_i = inv_rms[i,n], u_{i,h} = sum_{c in h} dx[c] v_i[c]:
//     ds_{i,h} = a_{i,h} (u_{i,h} - sum_k a_{k,h} u_{k,h})          (softmax)
//     value path: dv_i[c] += a_{i,head(c)} dx[c]
//     key path:   dv_i[c] += r_i q[c] g[c] ds_{i,head(c)} - v_i[c] r_i^2 / d * t_i,
//                 t_i = sum_h ds_{i,h} s_{i,h}   (through inv_rms: dr_i/dv_i[c] = -r_i^3 v_i[c]/d)
//     dq[c] += sum_{n,i} ds_{i,head(c)} g[c] v_i[c] r_i;  dg[c] += sum_{n,i} ds q[c] v_i[c] r_i
//   Pass 1 over the sources forms u and s (per-head block sums), pass 2 writes dhistory.
//   dq/dg are summed in registers over a block's tokens and added with one fp32 atomic
//   per feature per block.
// Block layout (forward and backward): one token per block iteration; thread t owns
// features t + k*blockDim for k < kmax (at most kMaxPerThread). Per-head sums are a warp
// reduction plus one shared atomic when every warp lies inside one head (head size a
// multiple of 32), else one shared atomic per feature.
// Correctness-first: the multi-site tiling of DESIGN.md section 3 is a later issue.
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

// Each thread keeps about six fp32 registers per owned feature; 8 features at up to 512
// threads (d <= 4096) stays within the register file at one block per SM.
constexpr int kMaxPerThread = 8;
constexpr int kMaxThreads = 512;

struct Layout {
  int threads, kmax;
};
Layout layout_for(int64_t d) {
  int64_t threads = ceil_div(d, 32) * 32;
  if (threads > 256) threads = 256;
  if (ceil_div(d, threads) > kMaxPerThread) threads = ceil_div(ceil_div(d, kMaxPerThread), 32) * 32;
  if (threads > kMaxThreads)
    fail("CUDA routing: d = ", d, " too large (at most ", kMaxThreads * kMaxPerThread, ")");
  return {int(threads), int(ceil_div(d, threads))};
}

// Adds this thread's value for head h into sums[h]. warp_uniform: the whole warp is
// active and inside head h.
__device__ __forceinline__ void head_add(float* sums, int h, float v, bool active,
                                         bool warp_uniform) {
  if (warp_uniform) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) atomicAdd(sums + h, v);
  } else if (active) {
    atomicAdd(sums + h, v);
  }
}

// ---------------------------------------------------------------- source statistics
template <class T>
__global__ void source_stats_kernel(float* inv_rms, const T* v, int64_t N, int64_t d, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;
  const T* row = v + n * d;
  float ss = 0.f;
  for (int64_t c = lane; c < d; c += 32) {
    const float x = load(row[c]);
    ss += x * x;
  }
  ss = warp_sum(ss);
  if (lane == 0) inv_rms[n] = rsqrtf(ss / float(d) + eps);
}

// ---------------------------------------------------------------- forward
template <class T, class W>
__global__ void __launch_bounds__(kMaxThreads) routing_forward_kernel(T* x, float* weights, const T* hist, const float* inv_rms,
                                       const W* query, const W* gain, int64_t N, int d,
                                       int n_src, int H, int kmax) {
  extern __shared__ float smem[];
  float* logit_buf = smem;        // [3][H]: per-source head sums, triple-buffered
  float* head_m = smem + 3 * H;   // [H] final running max
  float* head_l = head_m + H;     // [H] final running sum
  const int dh = d / H;
  const bool uniform_heads = dh % 32 == 0;

  float qg[kMaxPerThread];
  int head[kMaxPerThread];
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool active = k < kmax && c < d;
    qg[k] = active ? load(query[c]) * load(gain[c]) : 0.f;
    head[k] = active ? c / dh : 0;
  }

  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    float acc[kMaxPerThread], m[kMaxPerThread], l[kMaxPerThread];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      acc[k] = 0.f;
      m[k] = -INFINITY;
      l[k] = 0.f;
    }
    __syncthreads();  // previous token's reads of logit_buf / head_m / head_l are done
    for (int t = threadIdx.x; t < 2 * H; t += blockDim.x) logit_buf[t] = 0.f;
    __syncthreads();
    for (int i = 0; i < n_src; ++i) {
      float* cur = logit_buf + (i % 3) * H;
      // The buffer source i+1 will use was last read for source i-2, before the barrier
      // of source i-1 that every thread has passed.
      float* next = logit_buf + ((i + 1) % 3) * H;
      for (int t = threadIdx.x; t < H; t += blockDim.x) next[t] = 0.f;
      const T* v = hist + (int64_t(i) * N + n) * d;
      float val[kMaxPerThread];
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        const bool active = k < kmax && c < d;
        val[k] = active ? load(v[c]) : 0.f;
        if (k < kmax) {
          const bool warp_in_range = (c - (threadIdx.x & 31)) < d;  // d % 32 == 0 if uniform
          if (!uniform_heads || warp_in_range)
            head_add(cur, head[k], qg[k] * val[k], active, uniform_heads);
        }
      }
      __syncthreads();
      const float r = inv_rms[int64_t(i) * N + n];
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (k < kmax && c < d) {
          const float s = cur[head[k]] * r;
          const float m_new = fmaxf(m[k], s);
          const float alpha = __expf(m[k] - m_new);
          const float p = __expf(s - m_new);
          acc[k] = acc[k] * alpha + p * val[k];
          l[k] = l[k] * alpha + p;
          m[k] = m_new;
        }
      }
      for (int h = threadIdx.x; h < H; h += blockDim.x)
        weights[(n * H + h) * n_src + i] = cur[h] * r;  // raw logit, normalised below
    }
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (k < kmax && c < d) {
        x[n * d + c] = store<T>(acc[k] / l[k]);
        if (c % dh == 0) {
          head_m[head[k]] = m[k];
          head_l[head[k]] = l[k];
        }
      }
    }
    __syncthreads();  // head_m/head_l and the raw logits in `weights` are visible
    for (int t = threadIdx.x; t < H * n_src; t += blockDim.x) {
      const int h = t / n_src;
      float* w = weights + n * H * n_src + t;
      *w = __expf(*w - head_m[h]) / head_l[h];
    }
  }
}

// ---------------------------------------------------------------- backward
template <class T, class DH, class W>
__global__ void __launch_bounds__(kMaxThreads) routing_backward_kernel(DH* dhist, float* dquery, float* dgain, const T* dx,
                                        const T* hist, const float* inv_rms,
                                        const float* weights, const W* query, const W* gain,
                                        int64_t N, int d, int n_src, int H, int kmax) {
  extern __shared__ float smem[];
  float* u_sum = smem;                      // [n_src][H]  sum_{c in h} dx v_i
  float* s_raw = u_sum + n_src * H;         // [n_src][H]  sum_{c in h} q g v_i (no r_i)
  float* ds = s_raw + n_src * H;            // [n_src][H]
  float* t_src = ds + n_src * H;            // [n_src]     sum_h ds s
  const int dh = d / H;
  const bool uniform_heads = dh % 32 == 0;
  const float inv_d = 1.f / float(d);

  float q[kMaxPerThread], g[kMaxPerThread], dq_acc[kMaxPerThread], dg_acc[kMaxPerThread];
  int head[kMaxPerThread];
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    const bool active = k < kmax && c < d;
    q[k] = active ? load(query[c]) : 0.f;
    g[k] = active ? load(gain[c]) : 0.f;
    head[k] = active ? c / dh : 0;
    dq_acc[k] = dg_acc[k] = 0.f;
  }

  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();  // previous token done with the shared arrays
    for (int t = threadIdx.x; t < 2 * n_src * H; t += blockDim.x) smem[t] = 0.f;
    float dxv[kMaxPerThread];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      dxv[k] = (k < kmax && c < d) ? load(dx[n * d + c]) : 0.f;
    }
    __syncthreads();
    // Pass 1: per-head sums u and s for every source.
    for (int i = 0; i < n_src; ++i) {
      const T* v = hist + (int64_t(i) * N + n) * d;
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        const bool active = k < kmax && c < d;
        if (k < kmax) {
          const float val = active ? load(v[c]) : 0.f;
          const bool warp_in_range = (c - (threadIdx.x & 31)) < d;
          if (!uniform_heads || warp_in_range) {
            head_add(u_sum + i * H, head[k], dxv[k] * val, active, uniform_heads);
            head_add(s_raw + i * H, head[k], q[k] * g[k] * val, active, uniform_heads);
          }
        }
      }
    }
    __syncthreads();
    // Softmax backward per head, then t_i per source.
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      const float* a = weights + (n * H + h) * n_src;
      float mean_u = 0.f;
      for (int i = 0; i < n_src; ++i) mean_u += a[i] * u_sum[i * H + h];
      for (int i = 0; i < n_src; ++i) ds[i * H + h] = a[i] * (u_sum[i * H + h] - mean_u);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_src; i += blockDim.x) {
      const float r = inv_rms[int64_t(i) * N + n];
      float t = 0.f;
      for (int h = 0; h < H; ++h) t += ds[i * H + h] * s_raw[i * H + h];
      t_src[i] = t * r;
    }
    __syncthreads();
    // Pass 2: dhistory, and the query/gain partial sums.
    for (int i = 0; i < n_src; ++i) {
      const float r = inv_rms[int64_t(i) * N + n];
      const float radial = r * r * inv_d * t_src[i];
      const T* v = hist + (int64_t(i) * N + n) * d;
      DH* dv = dhist + (int64_t(i) * N + n) * d;
      const float* a_n = weights + n * H * n_src + i;
#pragma unroll
      for (int k = 0; k < kMaxPerThread; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (k < kmax && c < d) {
          const float val = load(v[c]);
          const float dsih = ds[i * H + head[k]];
          const float a = a_n[head[k] * n_src];
          const float grad = a * dxv[k] + r * q[k] * g[k] * dsih - val * radial;
          dv[c] = store<DH>(load(dv[c]) + grad);
          dq_acc[k] += dsih * g[k] * val * r;
          dg_acc[k] += dsih * q[k] * val * r;
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (k < kmax && c < d) {
      atomicAdd(dquery + c, dq_acc[k]);
      atomicAdd(dgain + c, dg_acc[k]);
    }
  }
}

struct SiteShape {
  int64_t S, N, d;
};

SiteShape check_site(const char* what, const Tensor& x, const Tensor& weights,
                     const Tensor& history, const Tensor& inv_rms, const Tensor& query,
                     const Tensor& gain, int n_src, int heads) {
  MHAR_CHECK(history.ndim == 3, what, ": history must be [S, N, d], got ", history.shape_str());
  const SiteShape sh{history.dim(0), history.dim(1), history.dim(2)};
  MHAR_CHECK(n_src >= 1 && n_src <= sh.S, what, ": n_src ", n_src, " outside [1, ", sh.S, "]");
  MHAR_CHECK(heads >= 1 && sh.d % heads == 0, what, ": heads ", heads, " must divide d ", sh.d);
  check_numel(x, sh.N * sh.d, what, "x/dx");
  check_numel(weights, sh.N * heads * n_src, what, "weights");
  check_dtype(weights, DType::F32, what, "weights");
  check_numel(inv_rms, sh.S * sh.N, what, "inv_rms");
  check_dtype(inv_rms, DType::F32, what, "inv_rms");
  check_numel(query, sh.d, what, "query");
  check_numel(gain, sh.d, what, "gain");
  MHAR_CHECK(query.dtype == gain.dtype, what, ": query and gain dtypes differ");
  MHAR_CHECK(sh.d < (int64_t(1) << 31), what, ": d too large");
  return sh;
}

}  // namespace

void routing_source_stats(cudaStream_t s, Tensor inv_rms, Tensor v, double eps) {
  check_dtype(inv_rms, DType::F32, "routing_source_stats", "inv_rms");
  const int64_t N = inv_rms.numel();
  MHAR_CHECK(N > 0 && v.numel() % N == 0, "routing_source_stats: v ", v.shape_str(),
             " for inv_rms ", inv_rms.shape_str());
  const int64_t d = v.numel() / N;
  dispatch_float(v.dtype, "routing_source_stats", [&](auto tag) {
    using T = decltype(tag);
    source_stats_kernel<T><<<ceil_div(N, 8), 256, 0, s>>>(inv_rms.ptr<float>(),
                                                          static_cast<const T*>(v.data), N, d,
                                                          float(eps));
    CUDA_CHECK_LAUNCH();
  });
}

void routing_forward(cudaStream_t s, Tensor x, Tensor weights, Tensor history, Tensor inv_rms,
                     Tensor query, Tensor gain, int n_src, int heads) {
  const SiteShape sh =
      check_site("routing_forward", x, weights, history, inv_rms, query, gain, n_src, heads);
  check_dtype(x, history.dtype, "routing_forward", "x");
  if (sh.N == 0) return;
  const Layout lay = layout_for(sh.d);
  const size_t smem = sizeof(float) * 5 * heads;
  const int blocks = int(sh.N < 1048576 ? sh.N : 1048576);
  dispatch_float(history.dtype, "routing_forward", [&](auto th) {
    dispatch_float(query.dtype, "routing_forward", [&](auto tw) {
      using T = decltype(th);
      using W = decltype(tw);
      routing_forward_kernel<T, W><<<blocks, lay.threads, smem, s>>>(
          static_cast<T*>(x.data), weights.ptr<float>(), static_cast<const T*>(history.data),
          inv_rms.ptr<float>(), static_cast<const W*>(query.data),
          static_cast<const W*>(gain.data), sh.N, int(sh.d), n_src, heads, lay.kmax);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void routing_backward(cudaStream_t s, Tensor dhistory, Tensor dquery, Tensor dgain, Tensor dx,
                      Tensor history, Tensor inv_rms, Tensor weights, Tensor query, Tensor gain,
                      int n_src, int heads) {
  const SiteShape sh =
      check_site("routing_backward", dx, weights, history, inv_rms, query, gain, n_src, heads);
  MHAR_CHECK(dhistory.numel() >= int64_t(n_src) * sh.N * sh.d, "routing_backward: dhistory ",
             dhistory.shape_str(), " smaller than n_src sources");
  check_dtype(dx, history.dtype, "routing_backward", "dx");
  check_numel(dquery, sh.d, "routing_backward", "dquery");
  check_numel(dgain, sh.d, "routing_backward", "dgain");
  check_dtype(dquery, DType::F32, "routing_backward", "dquery");
  check_dtype(dgain, DType::F32, "routing_backward", "dgain");
  if (sh.N == 0) return;
  const Layout lay = layout_for(sh.d);
  const size_t smem = sizeof(float) * (3 * size_t(n_src) * heads + n_src);
  MHAR_CHECK(smem <= 48 * 1024, "routing_backward: n_src * heads too large");
  const int blocks = grid_stride_blocks(sh.N * lay.threads, lay.threads);
  dispatch_float(history.dtype, "routing_backward", [&](auto th) {
    dispatch_float(dhistory.dtype, "routing_backward", [&](auto td) {
      dispatch_float(query.dtype, "routing_backward", [&](auto tw) {
        using T = decltype(th);
        using DH = decltype(td);
        using W = decltype(tw);
        routing_backward_kernel<T, DH, W><<<blocks, lay.threads, smem, s>>>(
            static_cast<DH*>(dhistory.data), dquery.ptr<float>(), dgain.ptr<float>(),
            static_cast<const T*>(dx.data), static_cast<const T*>(history.data),
            inv_rms.ptr<float>(), weights.ptr<float>(), static_cast<const W*>(query.data),
            static_cast<const W*>(gain.data), sh.N, int(sh.d), n_src, heads, lay.kmax);
        CUDA_CHECK_LAUNCH();
      });
    });
  });
}

}  // namespace mhar::cuda
