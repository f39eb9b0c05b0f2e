// routing_logits_mma.cu: one slot's routing logits and inv_rms on tensor cores (logits
// versions 5-9 in routing_logits.cu's lab numbering; the default, 9, at head_dim 128 and at 160
// where the wide blocks apply). Per head the logits are a product with a token-independent
// operand, raw [tokens x sites] = V [tokens x dh] QG^T (qg = q * g), each row then scaled
// by its token's inv_rms. The path for other shapes runs it as two cuBLAS GEMMs (q*g's
// bf16 hi and lo parts) between an inv_rms kernel and a scaling pass: v read three times
// and the logits twice more (cuda/NOTES.md, lead 7).
// - Two launches a slot (one where a bound pass's table holds every site's records:
//   QgPassTables, routing_logits.cu): logits_mma_table_kernel writes q*g as bf16 hi + lo, records
//   of 4 channels [hi01 hi23 lo01 lo23] (16 bytes, [site][d / 4]); logits_mma_kernel stages
//   its group's rows of that table in shared memory (cp.async, while its warps load their
//   first rows) and reads v once a group.
// - Site groups: a block takes 64 tokens (128 in versions 8-9 where a slot takes several
//   groups: kWarpsWide) and up to 8 NT sites. The accumulators keep every head's logits
//   of the group (heads x NT x 4 floats a lane), so NT is bounded by the registers: 4 at
//   4 heads, 2 at 8. A slot with more sites takes several groups, each reading v again
//   (from L2 where the groups run together) and each computing the same inv_rms, which
//   the first group stores. Versions 5-6 take the widest groups the registers allow,
//   version 7 groups of 8 sites (smaller tables in shared memory, more blocks, v read
//   more often): the same bits, since a logit's sum does not depend on the group it
//   falls in.
// - A warp takes 16 tokens and every head: mma.m16n8k16 with the tokens as M (rows g and
//   g + 8 of the fragment), the sites as N (8 a tile), the head's channels as K. v is A,
//   straight from global memory: in k-step s of a head, lane t's four k values are
//   channels 16 s + 4 t .. + 3 (one 8-byte load a row; k = 2t, 2t + 1 take the first two,
//   k = 2t + 8, 2t + 9 the last two), the table's records follow the same map, so B is
//   one 16-byte shared load for hi and lo together. The row's sum of squares, taken
//   from the same A registers and added over the 4 lanes of a row, gives inv_rms once
//   every head has been read.
// - Head dims 128 and 160 (the 100M, 350M and 1B widths), 4 or 8 heads. At 160 it wins
//   only in blocks of 128 tokens on slots of several site groups (the default, version 9,
//   takes it there; routing_logits.cu, the Logits versions' comment).
// - Numerics: v exact in bf16, q*g (exact in fp32) as hi + lo to ~2^-16 relative, fp32
//   accumulation: as the GEMM path, another order of sums (the CPU parity bound).
// - Shared layout: the table's site rows padded to a stride of 4 mod 8 records, so the two
//   rows an 8-lane phase reads fall in different bank groups.
// Measured: routing_logits.cu, the Logits versions' comment.
#include <algorithm>
#include <type_traits>

#include "cuda/attention_mma.cuh"
#include "cuda/routing_logits_mma.h"

namespace mhar::cuda {
namespace {

using attn_mma::cp_async16;
using attn_mma::cp_async_commit;
using attn_mma::cp_async_wait;
using attn_mma::mma;

// A block's warps (16 tokens each): 4, or 8 (versions 8-9) where a slot takes several site
// groups and 8 keep more warps resident. Shared memory bounds the blocks an SM: the table
// is 8 NT sites x STRIDE records, 81 KB at 8 heads of 160 with NT 2 (2 blocks an SM, 8
// warps at 4 a block), 65-66 KB at 100M and 350M (3 blocks). 8 warps a block share one
// table: twice the warps an SM where the table bounds them (at 1B; 350M's 158 registers
// would leave one such block an SM), and half the table's staging (from L2) per token.
constexpr int kWarps = 4, kWarpsWide = 8;

__global__ void logits_mma_table_kernel(uint4* __restrict__ table, const LogitsMmaSites p, int ns,
                                        int d) {
  const int records = d / 4;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < int64_t(ns) * records;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(e / records), c = 4 * int(e % records);
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      x[j] = __bfloat162float(p.q[k][c + j]) * __bfloat162float(p.g[k][c + j]);  // exact
    uint4 r;
    split_bf16x2(x[0], x[1], r.x, r.z);
    split_bf16x2(x[2], x[3], r.y, r.w);
    table[e] = r;
  }
}

// The table's shared row stride in records: d / 4 rounded up to 4 mod 8.
__host__ __device__ constexpr int table_stride(int d) {
  return d / 4 + ((4 - (d / 4) % 8) + 8) % 8;
}

__device__ __forceinline__ float sum_squares(const uint2& u) {
  const float a = __uint_as_float(u.x << 16), b = __uint_as_float(u.x & 0xffff0000u);
  const float c = __uint_as_float(u.y << 16), e = __uint_as_float(u.y & 0xffff0000u);
  return a * a + b * b + c * c + e * e;
}

struct Args {
  float* w;
  float* inv_rms;
  const bf16* v;
  const uint4* table;
  int64_t N;
  int ns;
  int groups;  // site groups a token block
  float eps;
};

// Block b: site group y = b % groups, token block x = b / groups: tokens 16 W x .. + 16 W - 1,
// sites 8 NT y .. + 8 NT - 1 (those below ns). The groups of a token block are neighbours in the
// launch order, so they run together and read the same rows of v from L2; with the groups
// on grid.y, a slot's v (33-42 MB at 350M-1B) passed through L2 once a group.
template <int H, int DH, int NT, int W>
__global__ void __launch_bounds__(32 * W) logits_mma_kernel(const Args a) {
  constexpr int D = H * DH, RECORDS = D / 4, STRIDE = table_stride(D), KSTEPS = DH / 16;
  extern __shared__ __align__(16) uint4 qs[];  // [8 NT sites][STRIDE records]
  const int group = int(blockIdx.x % unsigned(a.groups));
  const int64_t token_block = blockIdx.x / unsigned(a.groups);
  const int k0 = 8 * NT * group, ns = min(a.ns - k0, 8 * NT);  // this group's
  const uint4* table = a.table + int64_t(k0) * RECORDS;
  for (int i = threadIdx.x; i < 8 * NT * RECORDS; i += 32 * W) {
    const int k = i / RECORDS, c = i % RECORDS;
    cp_async16(qs + k * STRIDE + c, k < ns ? table + i : table, k < ns);
  }
  cp_async_commit();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t n0 = (token_block * W + (threadIdx.x >> 5)) * 16;
  const int64_t na = n0 + g, nb = n0 + g + 8;  // this lane's two tokens (rows g, g + 8)
  const bool oka = na < a.N, okb = nb < a.N;
  const uint2* va = reinterpret_cast<const uint2*>(a.v + (oka ? na : 0) * D);
  const uint2* vb = reinterpret_cast<const uint2*>(a.v + (okb ? nb : 0) * D);
  // Head h, k-step s: channels h DH + 16 s + 4 t .. + 3, 8 bytes: uint2 h DH / 4 + 4 s + t.
  auto load_head = [&](int h, uint2(&rows)[KSTEPS][2]) {
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const int at = h * (DH / 4) + 4 * s + t;
      rows[s][0] = oka ? va[at] : make_uint2(0, 0);
      rows[s][1] = okb ? vb[at] : make_uint2(0, 0);
    }
  };
  uint2 cur[KSTEPS][2];
  load_head(0, cur);
  cp_async_wait<0>();
  __syncthreads();

  float acc[H][NT][4];
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[h][nt][e] = 0.f;
  float ssa = 0.f, ssb = 0.f;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    uint2 next[KSTEPS][2];
    if (h + 1 < H) load_head(h + 1, next);  // in flight during this head's products
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      ssa += sum_squares(cur[s][0]);
      ssb += sum_squares(cur[s][1]);
      // a0a1: row g, k 2t..2t+1; a2a3: row g + 8; a4a5, a6a7: k 2t+8..2t+9.
      const uint32_t frag[4] = {cur[s][0].x, cur[s][1].x, cur[s][0].y, cur[s][1].y};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 b = qs[(8 * nt + g) * STRIDE + h * (DH / 4) + 4 * s + t];
        mma(acc[h][nt], frag, b.x, b.y);  // q*g's hi part
        mma(acc[h][nt], frag, b.z, b.w);  // and its lo part
      }
    }
    if (h + 1 < H) {
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s) cur[s][0] = next[s][0], cur[s][1] = next[s][1];
    }
  }
  // A row's sum of squares: its 4 lanes (t) hold disjoint channels.
  ssa += __shfl_xor_sync(0xffffffffu, ssa, 1);
  ssa += __shfl_xor_sync(0xffffffffu, ssa, 2);
  ssb += __shfl_xor_sync(0xffffffffu, ssb, 1);
  ssb += __shfl_xor_sync(0xffffffffu, ssb, 2);
  const float ra = rsqrtf(ssa / float(D) + a.eps), rb = rsqrtf(ssb / float(D) + a.eps);
  if (t == 0 && group == 0) {
    if (oka) a.inv_rms[na] = ra;
    if (okb) a.inv_rms[nb] = rb;
  }
  // c0, c1: token g, sites 8 nt + 2t, + 1; c2, c3: token g + 8.
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 8 * nt + 2 * t + (e & 1);
        const bool second = e >= 2;
        if (k >= ns || !(second ? okb : oka)) continue;
        a.w[(int64_t(k0 + k) * H + h) * a.N + (second ? nb : na)] =
            (second ? rb : ra) * acc[h][nt][e];
      }
}

// The most 8-site tiles a group may take: the accumulators, heads x NT x 4 floats a lane,
// stay at 64.
int max_site_tiles(int heads) { return heads == 4 ? 4 : 2; }

int head_dim_of(int d, int heads) { return heads > 0 ? d / heads : 0; }

// The shared q*g table of a block: 8 NT site rows.
template <int H, int DH, int NT>
constexpr size_t table_smem_bytes() {
  return size_t(8) * NT * table_stride(H * DH) * sizeof(uint4);
}

// The kernel, allowed its dynamic shared memory (past 48 KB) once.
template <int H, int DH, int NT, int W>
auto prepared_kernel() {
  auto kernel = logits_mma_kernel<H, DH, NT, W>;
  static const bool allowed = [&] {
    constexpr size_t smem = table_smem_bytes<H, DH, NT>();
    if (smem > 48 * 1024)
      CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return true;
  }();
  (void)allowed;
  return kernel;
}

// Whether blocks of kWarpsWide warps keep more warps resident an SM than blocks of kWarps:
// where the table bounds the blocks an SM (8 heads of 160) and the registers leave room.
template <int H, int DH, int NT>
bool wide_blocks_hold_more_warps() {
  static const bool more = [] {
    constexpr size_t smem = table_smem_bytes<H, DH, NT>();
    const int narrow =
        resident_blocks_per_sm(prepared_kernel<H, DH, NT, kWarps>(), 32 * kWarps, smem);
    const int wide =
        resident_blocks_per_sm(prepared_kernel<H, DH, NT, kWarpsWide>(), 32 * kWarpsWide, smem);
    return wide * kWarpsWide > narrow * kWarps;
  }();
  return more;
}

template <int H, int DH, int NT, int W>
void launch(cudaStream_t s, const Args& a) {
  auto kernel = prepared_kernel<H, DH, NT, W>();
  const int64_t blocks = ceil_div(a.N, int64_t(16 * W)) * a.groups;
  MHAR_CHECK(blocks < (int64_t(1) << 31), "logits_mma: ", blocks, " blocks");
  kernel<<<unsigned(blocks), 32 * W, table_smem_bytes<H, DH, NT>(), s>>>(a);
  CUDA_CHECK_LAUNCH();
}

// Calls f(integral_constant<int, NT>) for NT in 1 .. max (max 2 or 4).
template <int MAX, class F>
void dispatch_tiles(int nt, F&& f) {
  if (nt == 1)
    f(std::integral_constant<int, 1>{});
  else if (nt == 2 || MAX == 2)
    f(std::integral_constant<int, 2>{});
  else if constexpr (MAX == 4) {
    if (nt == 3)
      f(std::integral_constant<int, 3>{});
    else
      f(std::integral_constant<int, 4>{});
  }
}

// A slot's split into site groups: the fewest groups at the widest tiles allowed, then the
// tiles spread evenly over them (5 tiles at 4 heads: two groups of 3 tiles' room, not
// 4 + 1), so that the one NT of the launch is no wider than it needs to be.
struct SiteGroups {
  int groups, nt;
};
SiteGroups site_groups(int heads, int ns, int group_sites) {
  const int tiles = int(ceil_div(ns, 8));
  const int most =
      group_sites > 0 ? std::min(group_sites / 8, max_site_tiles(heads)) : max_site_tiles(heads);
  const int groups = int(ceil_div(tiles, most));
  return {groups, int(ceil_div(tiles, groups))};
}

// Calls f(integral_constant H, integral_constant DH, integral_constant NT) for the slot's
// shape (logits_mma_applies true).
template <class F>
void dispatch_shape(int d, int heads, int nt, F&& f) {
  auto run = [&](auto h, auto dh) {
    constexpr int H = decltype(h)::value;
    dispatch_tiles<H == 4 ? 4 : 2>(nt, [&](auto t) { f(h, dh, t); });
  };
  const int dh = head_dim_of(d, heads);
  if (heads == 4) {
    if (dh == 128)
      run(std::integral_constant<int, 4>{}, std::integral_constant<int, 128>{});
    else
      run(std::integral_constant<int, 4>{}, std::integral_constant<int, 160>{});
  } else {
    if (dh == 128)
      run(std::integral_constant<int, 8>{}, std::integral_constant<int, 128>{});
    else
      run(std::integral_constant<int, 8>{}, std::integral_constant<int, 160>{});
  }
}

}  // namespace

bool logits_mma_applies(int64_t N, int d, int heads, int ns, const void* v) {
  if (N <= 0 || ns <= 0 || ns > kLogitsMmaMaxSites || (heads != 4 && heads != 8)) return false;
  const int dh = head_dim_of(d, heads);
  if (d != heads * dh || (dh != 128 && dh != 160)) return false;
  return (reinterpret_cast<uintptr_t>(v) & 7u) == 0;
}

bool logits_mma_takes_wide_blocks(int d, int heads, int ns) {
  if (!logits_mma_applies(1, d, heads, ns, nullptr)) return false;
  const SiteGroups sg = site_groups(heads, ns, 0);
  if (sg.groups == 1) return false;
  bool more = false;
  dispatch_shape(d, heads, sg.nt, [&](auto h, auto dh, auto t) {
    more =
        wide_blocks_hold_more_warps<decltype(h)::value, decltype(dh)::value, decltype(t)::value>();
  });
  return more;
}

size_t logits_mma_table_bytes(int d, int ns) { return size_t(ns) * size_t(d / 4) * sizeof(uint4); }

void logits_mma_fill_table(cudaStream_t s, void* table, const LogitsMmaSites& sites, int ns,
                           int d) {
  logits_mma_table_kernel<<<unsigned(ceil_div(int64_t(ns) * (d / 4), 256)), 256, 0, s>>>(
      static_cast<uint4*>(table), sites, ns, d);
  CUDA_CHECK_LAUNCH();
}

bool logits_mma(cudaStream_t s, float* w, float* inv_rms, const bf16* v,
                const LogitsMmaSites& sites, void* table, bool table_filled, int64_t N, int d,
                int heads, int ns, int group_sites, bool wide_blocks, float eps) {
  if (!logits_mma_applies(N, d, heads, ns, v)) return false;
  MHAR_CHECK(group_sites >= 0 && group_sites % 8 == 0, "logits_mma: group_sites ", group_sites,
             " (0 or a multiple of 8)");
  auto* records = static_cast<uint4*>(table);
  if (!table_filled) logits_mma_fill_table(s, table, sites, ns, d);

  const SiteGroups sg = site_groups(heads, ns, group_sites);
  const Args a{w, inv_rms, v, records, N, ns, sg.groups, eps};
  dispatch_shape(d, heads, sg.nt, [&](auto h, auto dh, auto t) {
    constexpr int H = decltype(h)::value, DH = decltype(dh)::value, NT = decltype(t)::value;
    if (wide_blocks && sg.groups > 1 && wide_blocks_hold_more_warps<H, DH, NT>())
      launch<H, DH, NT, kWarpsWide>(s, a);
    else
      launch<H, DH, NT, kWarps>(s, a);
  });
  return true;
}

}  // namespace mhar::cuda
