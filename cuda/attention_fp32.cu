// attention_fp32.cu: the first, correctness-first attention kernels, on fp32 CUDA cores:
// every storage type (BF16, F32), any alignment, and incremental decoding (Tk >= T cached
// keys). They also served as the reference the tensor-core paths were developed against
// (cuda/NOTES.md). Conventions: attention.cu's header.
// The tiles live in shared memory as fp32:
// - forward (and dq): a block owns 16 query rows of one (b, h), 4 per warp; it walks key
//   tiles of 32 with an online softmax. Lane j scores key j against the warp's 4 rows;
//   then each lane accumulates the output for its hd/32 features.
// - dk/dv: a block owns 16 keys of one (b, kv head), 4 per warp, and walks every query
//   tile of 32 that can see them, for every query head of the group, so a group's sums
//   never race and need no atomics. Lane i handles query i of the tile.
// Backward recomputes p = exp(scale q.k - lse), D = dout . out, ds = p (dout.v - D):
//   dq = scale sum_u ds k_u;  dk = scale sum_t ds q_t;  dv = sum_t p dout_t.
#include "cuda/attention_paths.h"
#include "cuda/common.cuh"

namespace mhar::cuda::attn_fp32 {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kQueryRows = kWarps * kRowsPerWarp;  // query rows per block (forward, dq)
constexpr int kKeyTile = 32;                        // keys per tile (forward, dq)
constexpr int kKeysPerBlock = kWarps * kRowsPerWarp;  // keys per block (dk/dv)
constexpr int kQueryTile = 32;                        // queries per tile (dk/dv)

struct Dims {
  int64_t B, T, Hq, Hkv;  // T: query rows (and keys, except in the cached forward)
  float scale;
  int64_t Tk = 0, offset = 0;  // forward only: key rows; query t sits at offset + t
};

__device__ __forceinline__ int64_t row_index(int64_t b, int64_t t, int64_t h, int64_t heads,
                                             int64_t T_len) {
  return (b * T_len + t) * heads + h;
}

// ---------------------------------------------------------------- forward
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_forward_kernel(T* __restrict__ out, float* __restrict__ lse,
                             const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, Dims dm) {
  constexpr int DPL = HD / 32;  // features per lane
  extern __shared__ float smem[];
  float* qs = smem;                        // [kQueryRows][HD], pre-scaled
  float* ks = qs + kQueryRows * HD;        // [kKeyTile][HD + 1] (lane j reads row j)
  float* vs = ks + kKeyTile * (HD + 1);    // [kKeyTile][HD]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t hkv = h / (dm.Hq / dm.Hkv);
  // Longest causal rows first, for load balance.
  const int64_t r0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * kQueryRows;
  const int64_t r_end = min(dm.T, r0 + kQueryRows);

  for (int idx = threadIdx.x; idx < kQueryRows * HD; idx += blockDim.x) {
    const int r = idx / HD, c = idx % HD;
    const int64_t t = r0 + r;
    qs[idx] = t < dm.T ? load(q[row_index(b, t, h, dm.Hq, dm.T) * HD + c]) * dm.scale : 0.f;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][DPL];
  int64_t my_row[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.f;
    // Rows past the end mask like the last row (keeps the arithmetic finite); not written.
    my_row[rr] = dm.offset + min(r0 + warp * kRowsPerWarp + rr, dm.T - 1);  // its position
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[rr][e] = 0.f;
  }

  const int64_t n_tiles = (dm.offset + r_end - 1) / kKeyTile + 1;
  for (int64_t kt = 0; kt < n_tiles; ++kt) {
    const int64_t k0 = kt * kKeyTile;
    __syncthreads();  // previous tile fully consumed (and qs written, first time)
    for (int idx = threadIdx.x; idx < kKeyTile * HD; idx += blockDim.x) {
      const int j = idx / HD, c = idx % HD;
      const int64_t u = k0 + j;
      float kv = 0.f, vv = 0.f;
      if (u < dm.Tk) {
        const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.Tk) * HD + c;
        kv = load(k[base]);
        vv = load(v[base]);
      }
      ks[j * (HD + 1) + c] = kv;
      vs[j * HD + c] = vv;
    }
    __syncthreads();

    float s[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = 0.f;
    const float* kr = ks + lane * (HD + 1);
    const float* qw = qs + warp * kRowsPerWarp * HD;
#pragma unroll 8
    for (int c = 0; c < HD; ++c) {
      const float kc = kr[c];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] += qw[rr * HD + c] * kc;
    }
    const int64_t u = k0 + lane;
    float p[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      if (u > my_row[rr]) s[rr] = -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s[rr]));  // finite: key 0 <= every row
      const float alpha = __expf(m[rr] - m_new);
      p[rr] = __expf(s[rr] - m_new);
      l[rr] = l[rr] * alpha + warp_sum(p[rr]);
      m[rr] = m_new;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[rr][e] *= alpha;
    }
#pragma unroll 4
    for (int j = 0; j < kKeyTile; ++j) {
      float vj[DPL];
#pragma unroll
      for (int e = 0; e < DPL; ++e) vj[e] = vs[j * HD + lane + 32 * e];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float pj = __shfl_sync(0xffffffffu, p[rr], j);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[rr][e] += pj * vj[e];
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t t = r0 + warp * kRowsPerWarp + rr;
    if (t >= dm.T) continue;
    const float inv_l = 1.f / l[rr];
    T* o = out + row_index(b, t, h, dm.Hq, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[lane + 32 * e] = store<T>(acc[rr][e] * inv_l);
    if (lse && lane == 0) lse[(b * dm.Hq + h) * dm.T + t] = m[rr] + logf(l[rr]);
  }
}

// ---------------------------------------------------------------- backward: dq
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_backward_dq_kernel(T* __restrict__ dq, const T* __restrict__ dout,
                                 const T* __restrict__ q, const T* __restrict__ k,
                                 const T* __restrict__ v, const T* __restrict__ out,
                                 const float* __restrict__ lse, Dims dm) {
  constexpr int DPL = HD / 32;
  extern __shared__ float smem[];
  float* qs = smem;                      // [kQueryRows][HD], pre-scaled
  float* dos = qs + kQueryRows * HD;     // [kQueryRows][HD]
  float* ks = dos + kQueryRows * HD;     // [kKeyTile][HD + 1]
  float* vs = ks + kKeyTile * (HD + 1);  // [kKeyTile][HD + 1]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t hkv = h / (dm.Hq / dm.Hkv);
  const int64_t r0 = (int64_t(gridDim.x) - 1 - blockIdx.x) * kQueryRows;
  const int64_t r_end = min(dm.T, r0 + kQueryRows);

  for (int idx = threadIdx.x; idx < kQueryRows * HD; idx += blockDim.x) {
    const int r = idx / HD, c = idx % HD;
    const int64_t t = r0 + r;
    float qv = 0.f, dv = 0.f;
    if (t < dm.T) {
      const int64_t base = row_index(b, t, h, dm.Hq, dm.T) * HD + c;
      qv = load(q[base]) * dm.scale;
      dv = load(dout[base]);
    }
    qs[idx] = qv;
    dos[idx] = dv;
  }

  float lse_r[kRowsPerWarp], D[kRowsPerWarp], acc[kRowsPerWarp][DPL];
  int64_t my_row[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    my_row[rr] = min(r0 + warp * kRowsPerWarp + rr, dm.T - 1);
    const int64_t base = row_index(b, my_row[rr], h, dm.Hq, dm.T) * HD;
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      d += load(dout[base + lane + 32 * e]) * load(out[base + lane + 32 * e]);
    D[rr] = warp_sum(d);
    lse_r[rr] = lse[(b * dm.Hq + h) * dm.T + my_row[rr]];
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[rr][e] = 0.f;
  }

  const int64_t n_tiles = (r_end - 1) / kKeyTile + 1;
  for (int64_t kt = 0; kt < n_tiles; ++kt) {
    const int64_t k0 = kt * kKeyTile;
    __syncthreads();
    for (int idx = threadIdx.x; idx < kKeyTile * HD; idx += blockDim.x) {
      const int j = idx / HD, c = idx % HD;
      const int64_t u = k0 + j;
      float kv = 0.f, vv = 0.f;
      if (u < dm.T) {
        const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD + c;
        kv = load(k[base]);
        vv = load(v[base]);
      }
      ks[j * (HD + 1) + c] = kv;
      vs[j * (HD + 1) + c] = vv;
    }
    __syncthreads();

    float s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = dp[rr] = 0.f;
    const float* kr = ks + lane * (HD + 1);
    const float* vr = vs + lane * (HD + 1);
    const float* qw = qs + warp * kRowsPerWarp * HD;
    const float* dw = dos + warp * kRowsPerWarp * HD;
#pragma unroll 8
    for (int c = 0; c < HD; ++c) {
      const float kc = kr[c], vc = vr[c];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        s[rr] += qw[rr * HD + c] * kc;
        dp[rr] += dw[rr * HD + c] * vc;
      }
    }
    const int64_t u = k0 + lane;
    float ds[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const float p = u <= my_row[rr] ? __expf(s[rr] - lse_r[rr]) : 0.f;
      ds[rr] = p * (dp[rr] - D[rr]);
    }
#pragma unroll 4
    for (int j = 0; j < kKeyTile; ++j) {
      float kj[DPL];
#pragma unroll
      for (int e = 0; e < DPL; ++e) kj[e] = ks[j * (HD + 1) + lane + 32 * e];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float dsj = __shfl_sync(0xffffffffu, ds[rr], j);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[rr][e] += dsj * kj[e];
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t t = r0 + warp * kRowsPerWarp + rr;
    if (t >= dm.T) continue;
    T* o = dq + row_index(b, t, h, dm.Hq, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[lane + 32 * e] = store<T>(acc[rr][e] * dm.scale);
  }
}

// ---------------------------------------------------------------- backward: dk, dv
template <int HD, class T>
__global__ void __launch_bounds__(kWarps * 32)
    attention_backward_dkdv_kernel(T* __restrict__ dk, T* __restrict__ dv,
                                   const T* __restrict__ dout, const T* __restrict__ q,
                                   const T* __restrict__ k, const T* __restrict__ v,
                                   const T* __restrict__ out, const float* __restrict__ lse,
                                   Dims dm) {
  constexpr int DPL = HD / 32;
  extern __shared__ float smem[];
  float* qs = smem;                            // [kQueryTile][HD + 1] (lane i reads row i)
  float* dos = qs + kQueryTile * (HD + 1);     // [kQueryTile][HD + 1]
  float* ks = dos + kQueryTile * (HD + 1);     // [kKeysPerBlock][HD]
  float* vs = ks + kKeysPerBlock * HD;         // [kKeysPerBlock][HD]
  float* lse_s = vs + kKeysPerBlock * HD;      // [kQueryTile]
  float* D_s = lse_s + kQueryTile;             // [kQueryTile]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.z, hkv = blockIdx.y;
  const int64_t group = dm.Hq / dm.Hkv;
  const int64_t u0 = int64_t(blockIdx.x) * kKeysPerBlock;

  for (int idx = threadIdx.x; idx < kKeysPerBlock * HD; idx += blockDim.x) {
    const int j = idx / HD, c = idx % HD;
    const int64_t u = u0 + j;
    float kv = 0.f, vv = 0.f;
    if (u < dm.T) {
      const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD + c;
      kv = load(k[base]);
      vv = load(v[base]);
    }
    ks[idx] = kv;
    vs[idx] = vv;
  }

  float dk_acc[kRowsPerWarp][DPL], dv_acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int kk = 0; kk < kRowsPerWarp; ++kk)
#pragma unroll
    for (int e = 0; e < DPL; ++e) dk_acc[kk][e] = dv_acc[kk][e] = 0.f;
  const int64_t my_key0 = u0 + warp * kRowsPerWarp;
  const float* kw = ks + warp * kRowsPerWarp * HD;
  const float* vw = vs + warp * kRowsPerWarp * HD;

  const int64_t first_tile = u0 / kQueryTile;
  const int64_t n_tiles = ceil_div(dm.T, kQueryTile);
  for (int64_t hq = hkv * group; hq < (hkv + 1) * group; ++hq) {
    for (int64_t qt = first_tile; qt < n_tiles; ++qt) {
      const int64_t t0 = qt * kQueryTile;
      __syncthreads();  // previous tile consumed; ks/vs written (first time)
      for (int idx = threadIdx.x; idx < kQueryTile * HD; idx += blockDim.x) {
        const int i = idx / HD, c = idx % HD;
        const int64_t t = t0 + i;
        float qv = 0.f, dv_ = 0.f;
        if (t < dm.T) {
          const int64_t base = row_index(b, t, hq, dm.Hq, dm.T) * HD + c;
          qv = load(q[base]);
          dv_ = load(dout[base]);
        }
        qs[i * (HD + 1) + c] = qv;
        dos[i * (HD + 1) + c] = dv_;
      }
      // D_t = dout_t . out_t for the tile's 32 queries, 8 per warp.
      for (int i = warp; i < kQueryTile; i += kWarps) {
        const int64_t t = t0 + i;
        float d = 0.f;
        if (t < dm.T) {
          const int64_t base = row_index(b, t, hq, dm.Hq, dm.T) * HD;
#pragma unroll
          for (int e = 0; e < DPL; ++e)
            d += load(dout[base + lane + 32 * e]) * load(out[base + lane + 32 * e]);
        }
        d = warp_sum(d);
        if (lane == 0) {
          D_s[i] = d;
          lse_s[i] = t < dm.T ? lse[(b * dm.Hq + hq) * dm.T + t] : 0.f;
        }
      }
      __syncthreads();

      const int64_t t = t0 + lane;
      float s[kRowsPerWarp], dp[kRowsPerWarp];
#pragma unroll
      for (int kk = 0; kk < kRowsPerWarp; ++kk) s[kk] = dp[kk] = 0.f;
      const float* qr = qs + lane * (HD + 1);
      const float* dr = dos + lane * (HD + 1);
#pragma unroll 8
      for (int c = 0; c < HD; ++c) {
        const float qc = qr[c], dc = dr[c];
#pragma unroll
        for (int kk = 0; kk < kRowsPerWarp; ++kk) {
          s[kk] += qc * kw[kk * HD + c];
          dp[kk] += dc * vw[kk * HD + c];
        }
      }
      float p[kRowsPerWarp], ds[kRowsPerWarp];
#pragma unroll
      for (int kk = 0; kk < kRowsPerWarp; ++kk) {
        const int64_t u = my_key0 + kk;
        const bool visible = t < dm.T && u < dm.T && u <= t;
        p[kk] = visible ? __expf(s[kk] * dm.scale - lse_s[lane]) : 0.f;
        ds[kk] = p[kk] * (dp[kk] - D_s[lane]);
      }
#pragma unroll 4
      for (int i = 0; i < kQueryTile; ++i) {
        float qi[DPL], di[DPL];
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          qi[e] = qs[i * (HD + 1) + lane + 32 * e];
          di[e] = dos[i * (HD + 1) + lane + 32 * e];
        }
#pragma unroll
        for (int kk = 0; kk < kRowsPerWarp; ++kk) {
          const float pi = __shfl_sync(0xffffffffu, p[kk], i);
          const float dsi = __shfl_sync(0xffffffffu, ds[kk], i);
#pragma unroll
          for (int e = 0; e < DPL; ++e) {
            dv_acc[kk][e] += pi * di[e];
            dk_acc[kk][e] += dsi * qi[e];
          }
        }
      }
    }
  }

#pragma unroll
  for (int kk = 0; kk < kRowsPerWarp; ++kk) {
    const int64_t u = my_key0 + kk;
    if (u >= dm.T) continue;
    const int64_t base = row_index(b, u, hkv, dm.Hkv, dm.T) * HD;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      dk[base + lane + 32 * e] = store<T>(dk_acc[kk][e] * dm.scale);
      dv[base + lane + 32 * e] = store<T>(dv_acc[kk][e]);
    }
  }
}

template <int HD> size_t forward_smem() {
  return sizeof(float) * (kQueryRows * HD + kKeyTile * (HD + 1) + kKeyTile * HD);
}
template <int HD> size_t dq_smem() {
  return sizeof(float) * (2 * kQueryRows * HD + 2 * kKeyTile * (HD + 1));
}
template <int HD> size_t dkdv_smem() {
  return sizeof(float) * (2 * kQueryTile * (HD + 1) + 2 * kKeysPerBlock * HD + 2 * kQueryTile);
}

template <int HD, class T>
void forward_impl(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v,
                  const AttentionArgs& sh, int64_t Tk) {
  Dims dm{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(HD))), Tk, Tk - sh.T};
  const size_t smem = forward_smem<HD>();
  auto kernel = attention_forward_kernel<HD, T>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  dim3 grid(unsigned(ceil_div(sh.T, kQueryRows)), unsigned(sh.Hq), unsigned(sh.B));
  kernel<<<grid, kWarps * 32, smem, s>>>(static_cast<T*>(out.data),
                                         lse.empty() ? nullptr : lse.ptr<float>(),
                                         static_cast<const T*>(q.data),
                                         static_cast<const T*>(k.data),
                                         static_cast<const T*>(v.data), dm);
  CUDA_CHECK_LAUNCH();
}

template <int HD, class T>
void backward_impl(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                   Tensor k, Tensor v, Tensor out, Tensor lse, const AttentionArgs& sh) {
  Dims dm{sh.B, sh.T, sh.Hq, sh.Hkv, float(1.0 / std::sqrt(double(HD)))};
  {
    const size_t smem = dq_smem<HD>();
    auto kernel = attention_backward_dq_kernel<HD, T>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(unsigned(ceil_div(sh.T, kQueryRows)), unsigned(sh.Hq), unsigned(sh.B));
    kernel<<<grid, kWarps * 32, smem, s>>>(
        static_cast<T*>(dq.data), static_cast<const T*>(dout.data), static_cast<const T*>(q.data),
        static_cast<const T*>(k.data), static_cast<const T*>(v.data),
        static_cast<const T*>(out.data), lse.ptr<float>(), dm);
    CUDA_CHECK_LAUNCH();
  }
  {
    const size_t smem = dkdv_smem<HD>();
    auto kernel = attention_backward_dkdv_kernel<HD, T>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(unsigned(ceil_div(sh.T, kKeysPerBlock)), unsigned(sh.Hkv), unsigned(sh.B));
    kernel<<<grid, kWarps * 32, smem, s>>>(
        static_cast<T*>(dk.data), static_cast<T*>(dv.data), static_cast<const T*>(dout.data),
        static_cast<const T*>(q.data), static_cast<const T*>(k.data),
        static_cast<const T*>(v.data), static_cast<const T*>(out.data), lse.ptr<float>(), dm);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void forward(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, int64_t hd,
             const AttentionArgs& a, int64_t Tk) {
  dispatch_float(q.dtype, "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    if (hd == 64) forward_impl<64, T>(s, out, lse, q, k, v, a, Tk);
    else forward_impl<128, T>(s, out, lse, q, k, v, a, Tk);
  });
}

void backward(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
              Tensor v, Tensor out, Tensor lse, int64_t hd, const AttentionArgs& a) {
  dispatch_float(q.dtype, "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    if (hd == 64) backward_impl<64, T>(s, dq, dk, dv, dout, q, k, v, out, lse, a);
    else backward_impl<128, T>(s, dq, dk, dv, dout, q, k, v, out, lse, a);
  });
}

}  // namespace mhar::cuda::attn_fp32
