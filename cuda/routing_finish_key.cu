// routing_finish_key.cu: the last step of an unfused slot's backward (routing_backward.cu,
// source_backward) in one kernel, RoutingKernel::SourceFinish versions 2-4: the key path
// key = (ds r) qg per head, from the pairs the value kernel has just written, and the finish
// dv = val + key - (r^2 / d) (v . key) v. Version 1 (routing_backward.cu) computes the key
// rows with a cuBLAS fp32 GEMM into an fp32 [N, d] scratch row, which source_finish_kernel
// reads back. Conventions: cuda/routing.cu.
//
// Why: at 350M (tools/kernel_times.sh, forty-sixth session, H100) the 41 unfused slots'
// key GEMMs ran on CUDA cores (cuBLAS's SIMT sgemm and ffma kernels: K = ns is too short
// for its tensor-core paths) at 50 us a slot for a 64 MB fp32 output, and the finishes at
// 71 us a slot moved 200 MB each, at about the copy rate: ~5 ms of the 160 ms of kernels.
// Here the key row never leaves registers: a slot moves val (fp32), v and dv once (140 MB
// at 350M) and its ds r, and the products (N d ns FMAs, ~0.5 G at 350M) run under them.
//
// Shape: a block of kWarps warps takes consecutive tokens, TPW tokens a warp; a lane holds
// the chunks ch = lane + 32 t of each row (source_finish_kernel's layout), so it keeps
// TPW x NT x 8 key accumulators, and every q*g value it reads from shared memory serves TPW
// tokens. The slot's q*g rows (fp32 [ns, d], the same for every token) and the block's ds r
// come through shared memory kSites sites a stage, two stages in flight (cp.async), so the
// next stage's loads run under this stage's products; the block's v and val rows are
// prefetched into L2 at its start, under the products too.
// Versions: 2 is TPW = 4 (one block of 8 warps an SM by registers: 4 tokens of FMAs for
// each shared-memory read), 3 is TPW = 2 (two blocks an SM: more warps for the finish's
// row loads, twice the shared-memory reads a product), 4 is version 2 on a grid of one
// wave whose blocks walk the token tiles, each issuing the next tile's first stage before
// this tile's finish (ncu of version 2: 16% of its stall samples waited on a tile's first
// stage, with nothing else in flight on the SM).
// Measured (H100, a step's unfused slots, kernel_times.sh): 350M (41 slots) version 1 4.96
// ms (GEMMs 2.05 + finish kernel 2.91), version 2 4.07, version 3 5.45 (before its L1
// prefetches), version 4 3.98; 1B (65 slots) version 1 10.68 (4.97 + 5.71), version 2
// 10.04, version 4 9.88. In the step they have not shown it: in alternating rounds at 1B
// version 1 was 0.4-0.9% faster than 4, with the side stream and without it, and at 350M
// they tied, every run at the card's power limit (BENCHMARKS.md, forty-seventh and
// forty-eighth sessions). So version 1 stays the default; the whole GPU suite passes with
// version 4 as the default.
// Sums: key[n][c] = sum over k ascending of fp32 fma((ds r)[k][head(c)][n], qg[k][c]),
// another order than cuBLAS's, so dv's last bits differ from version 1's (the parity tests
// hold both to the CPU reference's bounds; routing_backward_sum_order says so); the finish's
// operations are source_finish_kernel's.
#include "cuda/routing_backward_rows.cuh"

namespace mhar::cuda {
namespace routing_detail {
namespace {

constexpr int kWarps = 8;  // a block
constexpr int kSites = 8;  // q*g rows and ds r a stage
// The widest rows, in chunk rows a lane (d <= 1280): ptxas keeps TPW 4's accumulators
// without spills there (255 registers at NT 5, one block an SM); TPW 2 at NT 5 spills 64
// bytes under its two-block bound of 128, NT 6 more.
constexpr int kMaxNTFinishKey = 5;

template <int TPW>
constexpr int block_tokens() {
  return kWarps * TPW;
}
// Shared memory of one block: two stages of kSites q*g rows and kSites x H x tokens ds r.
size_t finish_key_smem(int d, int heads, int tokens) {
  return 2 * size_t(kSites) * (size_t(d) + size_t(heads) * size_t(tokens)) * sizeof(float);
}

// FULL: every lane's NT chunks lie inside the row (d = 256 NT, the paper widths), so the
// chunk checks go and nothing stands between a stage's shared-memory loads and its products.
// PERSIST (version 4): a grid of one block an SM walks the token tiles, and issues the next
// tile's first stage before this tile's finish, so that its copies land under the finish's
// row loads rather than ahead of the next tile's products.
template <int NT, int TPW, bool FULL, bool PERSIST>
__global__ void __launch_bounds__(32 * kWarps, TPW >= 4 ? 1 : 2)
    source_finish_key_kernel(bf16* __restrict__ dv, const float* __restrict__ val,
                             const float* __restrict__ dsr, const float* __restrict__ qg,
                             const bf16* __restrict__ v, const float* __restrict__ inv_rms,
                             const Geometry g, int ns) {
  constexpr int kTokens = block_tokens<TPW>();
  static_assert(TPW == 2 || TPW == 4, "a warp's tokens are read as one float2 or float4");
  extern __shared__ float4 finish_key_smem_raw[];
  float* qs = reinterpret_cast<float*>(finish_key_smem_raw);  // [2][kSites][d]
  float* ds = qs + 2 * kSites * g.d;                          // [2][kSites][H][kTokens]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t HN = int64_t(g.H) * g.N, tiles = (g.N + kTokens - 1) / kTokens;
  // Stage `buf` of the tile from token n0 holds the sites k0 .. k0 + kSites - 1 below ns;
  // every thread issues a share. A q*g row is stored as its chunks' first halves, then their
  // second halves, so that a warp's 16-byte reads of consecutive chunks are consecutive (no
  // bank conflicts).
  const int row4 = g.d / 4, half4 = g.d / 8;
  auto load_stage = [&](int buf, int64_t n0, int k0) {
    const int kc = min(kSites, ns - k0);
    float4* qd = reinterpret_cast<float4*>(qs + buf * kSites * g.d);
    const float4* qsrc = reinterpret_cast<const float4*>(qg + int64_t(k0) * g.d);
    for (int i = threadIdx.x; i < kc * row4; i += blockDim.x) {
      const int kk = i / row4, j = i - kk * row4;
      cp_async_cg16(qd + kk * row4 + (j & 1) * half4 + (j >> 1), qsrc + i);
    }
    float* dd = ds + buf * kSites * g.H * kTokens;
    for (int i = threadIdx.x; i < kc * g.H * kTokens; i += blockDim.x) {
      const int64_t n = n0 + i % kTokens;
      const int kh = i / kTokens;  // site k0 + kh / H, head kh % H: pair rows [k][h][N]
      if (n < g.N)
        cp_async_ca(dd + i, dsr + int64_t(k0) * HN + int64_t(kh) * g.N + n, 4);
      else
        dd[i] = 0.f;  // past the last token: its products are never stored
    }
    cp_async_group();
  };
  // Each chunk lies inside one head (the host requires dh % 8 == 0).
  int head[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int ch = lane + 32 * t;
    head[t] = ch < g.nchunks ? ch * 8 / g.dh : 0;
  }
  const int stages = (ns + kSites - 1) / kSites;
  const int64_t tile_step = PERSIST ? gridDim.x : tiles;
  if constexpr (PERSIST) load_stage(0, int64_t(blockIdx.x) * kTokens, 0);  // grid <= tiles
#pragma unroll 1
  for (int64_t tile = blockIdx.x; tile < tiles; tile += tile_step) {
    const int64_t n0 = tile * kTokens;
    // The tile's rows of v and val are contiguous: L2 fetches them while the products run,
    // so the finish's loads below hit L2.
    if (threadIdx.x == 0) {
      const int64_t rows = min(int64_t(kTokens), g.N - n0);
      prefetch_l2(v + n0 * g.d, uint32_t(rows * g.d * sizeof(bf16)));
      prefetch_l2(val + n0 * g.d, uint32_t(rows * g.d * sizeof(float)));
    }
    float acc[TPW][NT][8];
#pragma unroll
    for (int u = 0; u < TPW; ++u)
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][t][e] = 0.f;

    if constexpr (!PERSIST) load_stage(0, n0, 0);  // PERSIST: above, or before the last finish
    for (int st = 0; st < stages; ++st) {
      const int buf = st & 1;
      // The other buffer was consumed by the whole block (the barrier ending the last stage).
      if (st + 1 < stages) {
        load_stage(buf ^ 1, n0, (st + 1) * kSites);
        cp_async_wait_groups<1>();
      } else {
        cp_async_wait_groups<0>();
      }
      __syncthreads();  // this stage's copies, every thread's, have landed
      const int kc = min(kSites, ns - st * kSites);
      const float* qb = qs + buf * kSites * g.d;
      const float* db = ds + buf * kSites * g.H * kTokens + warp * TPW;
#pragma unroll 1
      for (int kk = 0; kk < kc; ++kk) {
        const float4* qrow = reinterpret_cast<const float4*>(qb + kk * g.d);
        const float* drow = db + kk * g.H * kTokens;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int ch = lane + 32 * t;
          if (!FULL && ch >= g.nchunks) continue;
          const float4 lo = qrow[ch], hi = qrow[half4 + ch];
          const float q[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          float s[TPW];
          if constexpr (TPW == 4) {
            const float4 s4 = *reinterpret_cast<const float4*>(drow + head[t] * kTokens);
            s[0] = s4.x, s[1] = s4.y, s[2] = s4.z, s[3] = s4.w;
          } else {
            const float2 s2 = *reinterpret_cast<const float2*>(drow + head[t] * kTokens);
            s[0] = s2.x, s[1] = s2.y;
          }
#pragma unroll
          for (int u = 0; u < TPW; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[u][t][e] = fmaf(s[u], q[e], acc[u][t][e]);
        }
      }
      __syncthreads();  // the stage is consumed before the next iteration refills it
    }
    if (PERSIST && tile + tile_step < tiles) load_stage(0, (tile + tile_step) * kTokens, 0);

      // The finish, token by token: dot = v . key over the row, then dv chunk by chunk.
#pragma unroll
    for (int u = 0; u < TPW; ++u) {
      const int64_t n = n0 + warp * TPW + u;
      if (n >= g.N) break;  // uniform over the warp
      Row<NT> rv;
      load_row(rv, v + n * g.d, g.nchunks);
      // val's row is loaded with v's, ahead of the dot that needs only v, so a token waits
      // for one round trip, not two (ncu of the version without: half the kernel's stall
      // samples were the finish's loads). Where that would spill (NT 5 at 4 tokens a warp,
      // 249 registers without it; at 2 tokens a warp, the 128 of two blocks an SM), after
      // the dot, with its lines and the next token's v row asked into L1 here (prefetch_l1:
      // no registers), so that those loads wait for L1, not L2 (not yet timed).
      constexpr bool kValAhead = TPW == 4 && NT <= 4;
      const float4* vrow = reinterpret_cast<const float4*>(val + n * g.d);
      if constexpr (!kValAhead) {
        const bool next = u + 1 < TPW && n + 1 < g.N;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int ch = lane + 32 * t;
          if (!FULL && ch >= g.nchunks) continue;
          prefetch_l1(vrow + 2 * ch);
          if (next) prefetch_l1(v + (n + 1) * g.d + 8 * ch);
        }
      }
      float4 vlo[NT], vhi[NT];
      auto load_val = [&] {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int ch = lane + 32 * t;
          const bool in = FULL || ch < g.nchunks;
          vlo[t] = in ? vrow[2 * ch] : make_float4(0.f, 0.f, 0.f, 0.f);
          vhi[t] = in ? vrow[2 * ch + 1] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      };
      if constexpr (kValAhead) load_val();
      float dot = 0.f;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += elem(rv.raw[t], e) * acc[u][t][e];
      const float r = inv_rms[n];
      const float coef = r * r / float(g.d) * warp_sum(dot);
      if constexpr (!kValAhead) load_val();
      uint4* out = reinterpret_cast<uint4*>(dv + n * g.d);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int ch = lane + 32 * t;
        if (!FULL && ch >= g.nchunks) continue;
        const float4 lo = vlo[t], hi = vhi[t];
        float o[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] += acc[u][t][e] - coef * elem(rv.raw[t], e);
        out[ch] = pack8(o);
      }
    }
  }  // tile
}

}  // namespace

bool source_finish_key_fits(int64_t d, int heads, int version) {
  if (version < 2 || heads < 1 || d % heads != 0 || (d / heads) % 8 != 0) return false;
  const int tpw = version == 3 ? 2 : 4;
  if (ceil_div(d, 256) > kMaxNTFinishKey) return false;
  return finish_key_smem(int(d), heads, kWarps * tpw) <= 227 * 1024;
}

bool source_finish_key(cudaStream_t s, bf16* dv, const float* val, const float* dsr,
                       const float* qg, const bf16* v, const float* inv_rms, const Geometry& g,
                       int ns, int version) {
  if (ns < 1 || !aligned16(qg) || !source_finish_key_fits(g.d, g.H, version)) return false;
  auto launch = [&](auto nt_tag, auto tpw_tag, auto persist_tag) {
    constexpr int NT = decltype(nt_tag)::value, TPW = decltype(tpw_tag)::value;
    constexpr bool PERSIST = decltype(persist_tag)::value;
    const size_t smem = finish_key_smem(g.d, g.H, block_tokens<TPW>());
    auto kernel = g.nchunks == 32 * NT ? source_finish_key_kernel<NT, TPW, true, PERSIST>
                                       : source_finish_key_kernel<NT, TPW, false, PERSIST>;
    allow_smem(kernel, smem);
    const int64_t tiles = ceil_div(g.N, int64_t(block_tokens<TPW>()));
    // PERSIST: one wave, which the tests' grid cap may shrink to one block.
    const int64_t blocks = PERSIST ? one_wave(kernel, tiles, 32 * kWarps, smem) : tiles;
    kernel<<<unsigned(blocks), 32 * kWarps, smem, s>>>(dv, val, dsr, qg, v, inv_rms, g, ns);
    CUDA_CHECK_LAUNCH();
  };
  // NT = ceil(d / 256) chunk rows a lane (source_finish_key_fits: at most kMaxNTFinishKey).
  return dispatch_int<1, kMaxNTFinishKey>(int(ceil_div(g.d, 256)), [&](auto nt) {
    using Four = std::integral_constant<int, 4>;
    if (version == 2)
      launch(nt, Four{}, std::false_type{});
    else if (version == 3)
      launch(nt, std::integral_constant<int, 2>{}, std::false_type{});
    else
      launch(nt, Four{}, std::true_type{});
  });
}

}  // namespace routing_detail
}  // namespace mhar::cuda
