// attention_hopper_ws.cu: the warp-specialized Hopper (sm_90a) kernels of causal
// grouped-query attention, BF16, head_dim 64 or 128, the defaults on compute capability
// 9.0: the forward (forward version 2; version 1 is attention_hopper.cu's forward_kernel)
// and the backward's dK/dV kernel (backward version 3, section "dK and dV" below; version
// 2's is attention_hopper.cu's dkdv_kernel, and both feed attention_hopper.cu's dQ
// kernel). Kernel-lab switches: attention_set_hopper_forward / _backward in kernels.h.
// Layouts and the lse convention are attention.cu's.
//
// The forward, FlashAttention-3's schedule (cuda/NOTES.md, "A producer warp and two
// consumer warpgroups", has the measurements):
// - one block per SM, persistent: it takes work items (128 query rows of one (b, h)) in a
//   fixed order, longest rows first, every gridDim.x-th.
// - warpgroup 0 is the producer: one thread issues TMA copies (128-byte swizzle, the layout
//   of attention_wgmma.cuh) of each item's Q tile and of its key tiles (128 keys of K, then
//   of V) into a ring of two stages, each guarded by a "full" mbarrier (the copy's bytes
//   arrived) and an "empty" one (all eight consumer warps are done reading it). The
//   producer gives its registers to the consumers (setmaxnreg).
// - warpgroups 1 and 2 are consumers, 64 query rows each. Per key tile j: S_j = Q K_j^T
//   (wgmma m64n128, both operands from shared memory), issued together with the previous
//   tile's O += P_{j-1} V_{j-1} (P from registers); the softmax of S_j runs while that
//   product does (FA3's intra-warpgroup overlap), then O is rescaled. The two consumers
//   take turns issuing their products (named barriers 1 and 2), so one's softmax overlaps
//   the other's products (FA3's ping-pong).
// - an item's Q stage is released after its last S product, so the producer loads the next
//   item's Q and first tiles while the consumers finish and store this item's rows.
// Numerics are forward version 1's: fp32 scores and statistics, p = 2^(s c - m) as one
// FFMA and fast_exp2, P rounded to bf16 for P V, the row sum l from the unrounded p.
#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>

#include <algorithm>

#include "cuda/attention_paths.h"
#include "cuda/attention_wgmma.cuh"
#include "cuda/mbarrier.cuh"

namespace mhar::cuda::hopper {
namespace {

using namespace attn_wgmma;

constexpr int kConsumers = 2;                    // warpgroups of 64 query rows
constexpr int kWsThreads = 128 * (kConsumers + 1);
constexpr int kItemRows = 64 * kConsumers;       // query rows per work item
constexpr int kTileKeys = 128;                   // keys per tile
constexpr int kConsumerWarps = 4 * kConsumers;   // arrivals that empty a stage
constexpr int kBoxCols = 64;                     // a TMA box is one 128-byte column block

template <int HD> constexpr int tile_elems() { return kTileKeys * HD; }  // == kItemRows * HD
static_assert(kItemRows == kTileKeys, "Q and key tiles share the box shape");
template <int HD> constexpr int staging_elems() { return kConsumerWarps * 16 * (HD + 8); }

// Shared memory: Q, two stages of K, two of V (each tile_elems), the output staging, then
// the mbarriers; 1 KB for aligning the base to the swizzle's 1024 bytes.
struct Barriers {
  uint64_t q_full, q_empty, k_full[2], k_empty[2], v_full[2], v_empty[2];
};
template <int HD> constexpr size_t ws_smem() {
  return size_t(5 * tile_elems<HD>() + staging_elems<HD>()) * sizeof(bf16) + sizeof(Barriers) +
         1024;
}

#ifndef MHAR_NO_WGMMA
// One box of the 4-D map (feature, head, position, batch) into shared memory, completing
// on `bar`. Positions past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load(bf16* dst, const CUtensorMap* map, uint64_t* bar,
                                         int col, int head, int pos, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(head), "r"(pos), "r"(batch),
      "r"(smem_addr(bar))
      : "memory");
}
// A tile of ROWS positions from pos (the map's box height): HD / 64 boxes, one per column
// block; the caller has told `bar` to expect its bytes.
template <int HD, int ROWS>
__device__ __forceinline__ void tma_tile(bf16* dst, const CUtensorMap* map, uint64_t* bar,
                                         int head, int pos, int batch) {
#pragma unroll
  for (int cb = 0; cb < HD / kBoxCols; ++cb)
    tma_load(dst + cb * ROWS * kBoxCols, map, bar, cb * kBoxCols, head, pos, batch);
}
template <int HD, int ROWS> constexpr uint32_t tile_tx_bytes() {
  return uint32_t(ROWS * HD * sizeof(bf16));
}
// The consumers' turns at the tensor cores: named barrier 1 + w is warpgroup w's.
__device__ __forceinline__ void turn_wait(int w) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + w) : "memory");
}
__device__ __forceinline__ void turn_pass(int w) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (w ^ 1)) : "memory");
}
#endif

// Work item i of a persistent kernel whose items are (block of rows, head, batch), each
// block's heads and batches in turn: for the forward the query block counted from the
// last (the longest rows first), for dK/dV the key block (the blocks that see the most
// query tiles first).
struct Item {
  int block, h, b;
};
__device__ __forceinline__ Item item_of(int i, int heads, int B) {
  const int per_block = heads * B;
  const int rem = i % per_block;
  return Item{i / per_block, rem % heads, rem / heads};
}

template <int HD>
__global__ void __launch_bounds__(kWsThreads, 1)
    forward_ws_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                      const __grid_constant__ CUtensorMap q_map,
                      const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KS = HD / 16, NT = kTileKeys / 8, PV_STEPS = kTileKeys / 16;
  constexpr int TE = tile_elems<HD>();
  extern __shared__ unsigned char smem_raw[];
  bf16* Qs = aligned_smem(smem_raw);
  bf16* Ks = Qs + TE;      // [2][TE]
  bf16* Vs = Ks + 2 * TE;  // [2][TE]
  bf16* staging = Vs + 2 * TE;
  static_assert((5 * TE + staging_elems<HD>()) * sizeof(bf16) % 8 == 0,
                "mbarriers are 8-byte aligned");
  Barriers& bar = *reinterpret_cast<Barriers*>(staging + staging_elems<HD>());

  const int n_qblocks = int(ceil_div(a.T, kItemRows));
  const int n_items = n_qblocks * int(a.Hq) * int(a.B);
  const int group = int(a.Hq / a.Hkv);
  if (threadIdx.x == 0) {
    mbar_init(&bar.q_full, 1);
    mbar_init(&bar.q_empty, kConsumerWarps);
    for (int s = 0; s < 2; ++s) {
      mbar_init(&bar.k_full[s], 1);
      mbar_init(&bar.v_full[s], 1);
      mbar_init(&bar.k_empty[s], kConsumerWarps);
      mbar_init(&bar.v_empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    // Producer. Its 128 threads keep 24 registers; one issues every copy.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x != 0) return;
    int tile = 0, it = 0;  // key tiles and items this block has loaded so far
    for (int i = blockIdx.x; i < n_items; i += gridDim.x, ++it) {
      const Item w = item_of(i, int(a.Hq), int(a.B));
      const int qb = n_qblocks - 1 - w.block;
      const int n_tiles = int(ceil_div(std::min<int64_t>(a.T, int64_t(qb + 1) * kItemRows),
                                       kTileKeys));
      if (it > 0) mbar_wait(&bar.q_empty, (it - 1) & 1);
      mbar_expect_tx(&bar.q_full, tile_tx_bytes<HD, kItemRows>());
      tma_tile<HD, kItemRows>(Qs, &q_map, &bar.q_full, w.h, qb * kItemRows, w.b);
      for (int j = 0; j < n_tiles; ++j, ++tile) {
        const int st = tile & 1, use = tile >> 1;
        if (use > 0) mbar_wait(&bar.k_empty[st], (use - 1) & 1);
        mbar_expect_tx(&bar.k_full[st], tile_tx_bytes<HD, kTileKeys>());
        tma_tile<HD, kTileKeys>(Ks + st * TE, &k_map, &bar.k_full[st], w.h / group,
                                j * kTileKeys, w.b);
        if (use > 0) mbar_wait(&bar.v_empty[st], (use - 1) & 1);
        mbar_expect_tx(&bar.v_full[st], tile_tx_bytes<HD, kTileKeys>());
        tma_tile<HD, kTileKeys>(Vs + st * TE, &v_map, &bar.v_full[st], w.h / group,
                                j * kTileKeys, w.b);
      }
    }
    return;
  }

  // Consumers: warpgroup cw (0 or 1) owns query rows 64 cw .. 64 cw + 63 of each item.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const float c = a.scale * kLog2e;
  const int64_t qs = a.Hq * HD;
  const uint64_t q_desc = kmajor_base(Qs, 64 * cw);
  const uint64_t k_desc = kmajor_base(Ks, 0);
  const uint64_t v_desc = nmajor_base<kTileKeys>(Vs);
  bf16* my_staging = staging + ((threadIdx.x - 128) >> 5) * 16 * (HD + 8);
  auto release = [&](uint64_t* b) {
    if (lane == 0) mbar_arrive(b);
  };
  if (cw == 1) turn_pass(cw);  // consumer 0 issues first

  // S = Q K^T for the key tile in stage st (one commit group).
  auto issue_scores = [&](float (&acc)[kTileKeys / 2], int st) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      wgmma_ss<kTileKeys, 0, 0>(acc, kmajor_step<kItemRows>(q_desc, ks),
                                kmajor_step<kTileKeys>(k_desc + stage_offset(st, TE), ks), ks > 0);
    wgmma_commit();
  };

  int tile = 0, it = 0;
  for (int i = blockIdx.x; i < n_items; i += gridDim.x, ++it) {
    const Item w = item_of(i, int(a.Hq), int(a.B));
    const int64_t q0 = int64_t(n_qblocks - 1 - w.block) * kItemRows;
    const int n_tiles = int(ceil_div(std::min<int64_t>(a.T, q0 + kItemRows), kTileKeys));
    const int64_t t_lo = q0 + 64 * cw + 16 * warp + g;  // this thread's rows: t_lo, t_lo + 8
    float o[HD / 2], s[kTileKeys / 2];
    uint32_t p[PV_STEPS][4];
#pragma unroll
    for (int e = 0; e < HD / 2; ++e) o[e] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

    // The softmax of tile j's scores, in place: keys after the row masked on the diagonal
    // tile (the last: item and key tiles are both 128 long), the running maxima updated,
    // s = 2^(s c - m) as one FFMA; returns the old statistics' rescale factors and adds
    // the row sums (per thread; reduced at the end) after rescaling l.
    auto softmax = [&](int j, float& al_lo, float& al_hi) {
      const float2 al = update_row_max<kTileKeys>(s, j == n_tiles - 1,
                                                  int(t_lo - int64_t(j) * kTileKeys), c2, c,
                                                  m_lo, m_hi);
      al_lo = al.x;
      al_hi = al.y;
      float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[4 * nt] = fast_exp2(fmaf(s[4 * nt], c, -m_lo));
        s[4 * nt + 1] = fast_exp2(fmaf(s[4 * nt + 1], c, -m_lo));
        s[4 * nt + 2] = fast_exp2(fmaf(s[4 * nt + 2], c, -m_hi));
        s[4 * nt + 3] = fast_exp2(fmaf(s[4 * nt + 3], c, -m_hi));
        sum_lo += s[4 * nt] + s[4 * nt + 1];
        sum_hi += s[4 * nt + 2] + s[4 * nt + 3];
      }
      l_lo = l_lo * al_lo + sum_lo;
      l_hi = l_hi * al_hi + sum_hi;
    };
    // P rounded to bf16 as P V's A operand: n8 tile nt holds keys 8 nt ..: the low or high
    // half of k-step nt / 2.
    auto pack_p = [&] {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        p[nt / 2][2 * (nt & 1)] = pack(s[4 * nt], s[4 * nt + 1]);
        p[nt / 2][2 * (nt & 1) + 1] = pack(s[4 * nt + 2], s[4 * nt + 3]);
      }
    };

    mbar_wait(&bar.q_full, it & 1);
    // Tile 0: its scores alone (O is still zero).
    {
      const int st = tile & 1;
      mbar_wait(&bar.k_full[st], (tile >> 1) & 1);
      turn_wait(cw);
      wgmma_fence();
      issue_scores(s, st);
      turn_pass(cw);
      wgmma_wait<0>();
      pin(s);
      release(&bar.k_empty[st]);
      if (n_tiles == 1) release(&bar.q_empty);
      float al_lo, al_hi;
      softmax(0, al_lo, al_hi);
      pack_p();
      ++tile;
    }
    // Tile j's scores and tile j - 1's P V in flight together; tile j's softmax runs
    // while P V does.
    for (int j = 1; j < n_tiles; ++j, ++tile) {
      const int st = tile & 1, pst = st ^ 1;  // this tile's stage and the previous one's
      mbar_wait(&bar.k_full[st], (tile >> 1) & 1);
      mbar_wait(&bar.v_full[pst], ((tile - 1) >> 1) & 1);
      turn_wait(cw);
      wgmma_fence();
      issue_scores(s, st);
      wgmma_rs_k<HD>(o, p, v_desc + stage_offset(pst, TE));
      wgmma_commit();
      turn_pass(cw);
      wgmma_wait<1>();
      pin(s);
      release(&bar.k_empty[st]);
      if (j == n_tiles - 1) release(&bar.q_empty);
      float al_lo, al_hi;
      softmax(j, al_lo, al_hi);
      wgmma_wait<0>();
      pin(o);
      release(&bar.v_empty[pst]);
      rescale_rows<HD>(o, al_lo, al_hi);
      pack_p();
    }
    // The last tile's P V.
    {
      const int lst = (tile - 1) & 1;
      mbar_wait(&bar.v_full[lst], ((tile - 1) >> 1) & 1);
      turn_wait(cw);
      wgmma_fence();
      wgmma_rs_k<HD>(o, p, v_desc + stage_offset(lst, TE));
      wgmma_commit();
      turn_pass(cw);
      wgmma_wait<0>();
      pin(o);
      release(&bar.v_empty[lst]);
    }

    finish_row_sums(l_lo, l_hi, m_lo, m_hi, lse, (int64_t(w.b) * a.Hq + w.h) * a.T, t_lo, a.T,
                    lane);
    store_rows_staged<HD>(my_staging, o, 1.f / l_lo, 1.f / l_hi,
                          out + (int64_t(w.b) * a.T * a.Hq + w.h) * HD, qs,
                          ConsecutiveRows{q0 + 64 * cw + 16 * warp}, a.T, lane);
  }
  // Consumer 1's last pass has no turn of consumer 0's to wait for: take it, so that both
  // named barriers end complete.
  if (cw == 0) turn_wait(cw);
#endif
}

// ---------------------------------------------------------------- dK and dV
// The backward's dk/dv kernel (backward version 3; attention_hopper.cu's dkdv_kernel is
// version 2's, with the same products and numerics): a work item is 128 keys of one
// (b, KV head), 64 per consumer warpgroup, whose K and V rows stay in shared memory; it
// walks every query tile of 64 that can see them, for each query head of the group:
//   S^T = K Q^T, dP^T = V dO^T (m64n64, both from shared memory), P^T = 2^(S^T c - lse),
//   dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q (P^T and dS^T from shared memory, dO
//   and Q read N-major), and dS^T stored as a bf16 score-gradient tile for dq_tiles_kernel.
// The producer warp stages Q and dO by TMA and the tile's lse and D rows by its 32 lanes,
// three stages deep (a stage is read by two iterations: its S^T and dP^T products, then
// its dV and dK ones). Per tile j, S^T_j and dP^T_j are issued with tile j - 1's dV and dK
// products; P^T_j and dS^T_j are computed in place while those run. P^T and dS^T reach
// their products through shared memory (each warpgroup's two 64 x 64 bf16 tiles, K-major),
// not registers: with both accumulator pairs in flight, register operands would not fit
// the 240 registers a consumer thread has (ptxas serialized the products and spilled).
// dK and dV are written straight from the accumulators (4-byte stores; once per item).
constexpr int kBwdRows = 64;  // query rows per tile
constexpr int kQStages = 3;
template <int HD> constexpr int q_tile_elems() { return kBwdRows * HD; }
struct BwdBarriers {
  uint64_t kv_full, kv_empty, q_full[kQStages], q_empty[kQStages];
};
constexpr int kOperandElems = 64 * kBwdRows;  // a warpgroup's P^T or dS^T tile
template <int HD> constexpr size_t dkdv_ws_smem() {
  return size_t(2 * tile_elems<HD>() + 2 * kQStages * q_tile_elems<HD>() +
                2 * kConsumers * kOperandElems) * sizeof(bf16) +
         2 * kQStages * kBwdRows * sizeof(float) + sizeof(BwdBarriers) + 1024;
}
// Stage index and phase parity of a ring of kQStages.
struct Ring {
  int st = 0;
  uint32_t ph = 0;
  __device__ void next() {
    if (++st == kQStages) {
      st = 0;
      ph ^= 1;
    }
  }
};

template <int HD>
__global__ void __launch_bounds__(kWsThreads, 1)
    dkdv_ws_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, bf16* __restrict__ score_grads,
                   const float* __restrict__ lse, const float* __restrict__ Dsum,
                   const __grid_constant__ CUtensorMap q_map,
                   const __grid_constant__ CUtensorMap do_map,
                   const __grid_constant__ CUtensorMap k_map,
                   const __grid_constant__ CUtensorMap v_map, AttentionArgs a) {
#ifdef MHAR_NO_WGMMA
  __trap();
#else
  constexpr int KS = HD / 16, NT = kBwdRows / 8, QSTEPS = kBwdRows / 16;
  constexpr int TE = tile_elems<HD>(), QE = q_tile_elems<HD>();
  extern __shared__ unsigned char smem_raw[];
  bf16* Ks = aligned_smem(smem_raw);     // [TE]: the item's keys
  bf16* Vs = Ks + TE;                    // [TE]
  bf16* Qs = Vs + TE;                    // [kQStages][QE]
  bf16* dOs = Qs + kQStages * QE;        // [kQStages][QE]
  bf16* operands = dOs + kQStages * QE;  // [kConsumers][P^T, dS^T][kOperandElems]
  float* lse_s = reinterpret_cast<float*>(operands + 2 * kConsumers * kOperandElems);
  float* D_s = lse_s + kQStages * kBwdRows;  // both [kQStages][kBwdRows], lse in exp2 units
  static_assert(((2 * TE + 2 * kQStages * QE + 2 * kConsumers * kOperandElems) * sizeof(bf16) +
                 2 * kQStages * kBwdRows * sizeof(float)) % 8 == 0,
                "mbarriers are 8-byte aligned");
  BwdBarriers& bar = *reinterpret_cast<BwdBarriers*>(D_s + kQStages * kBwdRows);

  const int n_kblocks = int(ceil_div(a.T, kTileKeys));
  const int n_items = n_kblocks * int(a.Hkv) * int(a.B);
  const int64_t group = a.Hq / a.Hkv;
  if (threadIdx.x == 0) {
    mbar_init(&bar.kv_full, 1);
    mbar_init(&bar.kv_empty, kConsumerWarps);
    for (int s = 0; s < kQStages; ++s) {
      mbar_init(&bar.q_full[s], 33);  // lane 0's expect_tx, then the 32 lanes' statistics
      mbar_init(&bar.q_empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (warp != 0) return;
    // Producer warp: lane 0 issues the copies, every lane stages two rows' statistics.
    Ring ring;
    int n_staged = 0, it = 0;
    for (int i = blockIdx.x; i < n_items; i += gridDim.x, ++it) {
      const Item w = item_of(i, int(a.Hkv), int(a.B));
      const int hkv = w.h, b = w.b;
      const int64_t u0 = int64_t(w.block) * kTileKeys;
      if (it > 0) mbar_wait(&bar.kv_empty, (it - 1) & 1);
      if (lane == 0) {
        mbar_expect_tx(&bar.kv_full, 2 * tile_tx_bytes<HD, kTileKeys>());
        tma_tile<HD, kTileKeys>(Ks, &k_map, &bar.kv_full, hkv, int(u0), b);
        tma_tile<HD, kTileKeys>(Vs, &v_map, &bar.kv_full, hkv, int(u0), b);
      }
      const QueryTileWalk<kBwdRows> walk(hkv, group, u0, a.T);
      const int n_q = int(group) * walk.tiles;
      for (int j = 0; j < n_q; ++j, ++n_staged, ring.next()) {
        if (n_staged >= kQStages) mbar_wait(&bar.q_empty[ring.st], ring.ph ^ 1);
        const int hq = int(walk.head(j)), t0 = int(walk.t0(j));
        if (lane == 0) {
          mbar_expect_tx(&bar.q_full[ring.st], 2 * tile_tx_bytes<HD, kBwdRows>());
          tma_tile<HD, kBwdRows>(Qs + ring.st * QE, &q_map, &bar.q_full[ring.st], hq, t0, b);
          tma_tile<HD, kBwdRows>(dOs + ring.st * QE, &do_map, &bar.q_full[ring.st], hq, t0,
                                 b);
        }
        const int64_t row = (int64_t(b) * a.Hq + hq) * a.T;
#pragma unroll
        for (int r = lane; r < kBwdRows; r += 32) {
          const int64_t t = t0 + r;
          const bool ok = t < a.T;
          lse_s[ring.st * kBwdRows + r] = ok ? lse[row + t] * kLog2e : INFINITY;
          D_s[ring.st * kBwdRows + r] = ok ? Dsum[row + t] : 0.f;
        }
        mbar_arrive(&bar.q_full[ring.st]);
      }
    }
    return;
  }

  // Consumers: warpgroup cw (0 or 1) owns keys 64 cw .. 64 cw + 63 of each item.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1;
  const int g = lane >> 2, c2 = 2 * (lane & 3);
  const float c = a.scale * kLog2e;
  const int64_t kvs = a.Hkv * HD;
  const uint64_t k_desc = kmajor_base(Ks, 64 * cw), v_desc = kmajor_base(Vs, 64 * cw),
                 q_desc = kmajor_base(Qs, 0), do_desc = kmajor_base(dOs, 0),
                 qn_desc = nmajor_base<kBwdRows>(Qs), don_desc = nmajor_base<kBwdRows>(dOs);
  bf16* Ps = operands + 2 * cw * kOperandElems;  // this warpgroup's P^T, then dS^T
  bf16* dSs = Ps + kOperandElems;
  const uint64_t p_desc = kmajor_base(Ps, 0), ds_desc = kmajor_base(dSs, 0);
  auto release = [&](uint64_t* b) {
    if (lane == 0) mbar_arrive(b);
  };
  if (cw == 1) turn_pass(cw);  // consumer 0 issues first

  Ring ring;
  int it = 0;
  for (int i = blockIdx.x; i < n_items; i += gridDim.x, ++it) {
    const Item w = item_of(i, int(a.Hkv), int(a.B));
    const int hkv = w.h, b = w.b;
    const int64_t u0 = int64_t(w.block) * kTileKeys, wg_u0 = u0 + 64 * cw;
    const int64_t u_lo = wg_u0 + 16 * warp + g, u_hi = u_lo + 8;  // this thread's two keys
    const QueryTileWalk<kBwdRows> walk(hkv, group, u0, a.T);
    const int n_q = int(group) * walk.tiles;
    float dk_acc[HD / 2], dv_acc[HD / 2], s[kBwdRows / 2], dp[kBwdRows / 2];
#pragma unroll
    for (int e = 0; e < HD / 2; ++e) dk_acc[e] = dv_acc[e] = 0.f;

    auto issue_scores = [&](int st) {
      const uint64_t so = stage_offset(st, QE);
      wgmma_ss_k<KS, kTileKeys, kBwdRows>(s, k_desc, q_desc + so);
      wgmma_ss_k<KS, kTileKeys, kBwdRows>(dp, v_desc, do_desc + so);
      wgmma_commit();
    };
    auto issue_grads = [&](int st) {
      const uint64_t so = stage_offset(st, QE);
#pragma unroll
      for (int ks = 0; ks < QSTEPS; ++ks)
        wgmma_ss_kn<HD>(dv_acc, kmajor_step<64>(p_desc, ks), nmajor_step(don_desc + so, ks));
#pragma unroll
      for (int ks = 0; ks < QSTEPS; ++ks)
        wgmma_ss_kn<HD>(dk_acc, kmajor_step<64>(ds_desc, ks), nmajor_step(qn_desc + so, ks));
      wgmma_commit();
    };
    // P^T and dS^T of query tile j in place of S^T and dP^T (rows: keys, columns:
    // queries); a query before a key sees nothing.
    auto probabilities = [&](int j, int st) {
      const int64_t t0 = walk.t0(j);
      const bool masked = t0 < wg_u0 + 63;
      const float* lse_t = lse_s + st * kBwdRows;
      const float* D_t = D_s + st * kBwdRows;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_t + nt * 8 + c2);
        const float2 D2 = *reinterpret_cast<const float2*>(D_t + nt * 8 + c2);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + c2 + (e & 1);
          float pe = fast_exp2(fmaf(s[4 * nt + e], c, -((e & 1) ? lse2.y : lse2.x)));
          if (masked && t0 + col < (e < 2 ? u_lo : u_hi)) pe = 0.f;
          s[4 * nt + e] = pe;
          dp[4 * nt + e] = pe * (dp[4 * nt + e] - ((e & 1) ? D2.y : D2.x));
        }
      }
    };
    // P^T and dS^T of query tile j rounded to bf16 into this warpgroup's operand tiles
    // (swizzled K-major: row r's 16-byte chunk nt at position nt ^ (r % 8), and r % 8 = g),
    // published to the tensor cores by the next turn_wait, a barrier of all its threads;
    // and dS^T as the score-gradient tile dq reads. Tiles wholly before this warpgroup's
    // keys, and warpgroups wholly past T, store no score gradients (no dq reads them).
    auto write_operands = [&](int j) {
      uint32_t da[QSTEPS][4];
      const int r_lo = 16 * warp + g;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int at = r_lo * 64 + ((nt ^ g) * 8) + c2;
        *reinterpret_cast<uint32_t*>(Ps + at) = pack(s[4 * nt], s[4 * nt + 1]);
        *reinterpret_cast<uint32_t*>(Ps + at + 8 * 64) = pack(s[4 * nt + 2], s[4 * nt + 3]);
        da[nt / 2][2 * (nt & 1)] = pack(dp[4 * nt], dp[4 * nt + 1]);
        da[nt / 2][2 * (nt & 1) + 1] = pack(dp[4 * nt + 2], dp[4 * nt + 3]);
        *reinterpret_cast<uint32_t*>(dSs + at) = da[nt / 2][2 * (nt & 1)];
        *reinterpret_cast<uint32_t*>(dSs + at + 8 * 64) = da[nt / 2][2 * (nt & 1) + 1];
      }
      fence_proxy_async();
      const int64_t t0 = walk.t0(j);
      if (t0 >= wg_u0 && wg_u0 < a.T)
        store_score_grad_rows(score_grad_tile(score_grads, int64_t(b) * a.Hq + walk.head(j),
                                              a.T, int(t0 / kGradTile),
                                              int(wg_u0 / kGradTile)),
                              warp, lane, da);
    };

    mbar_wait(&bar.kv_full, it & 1);
    // Query tile 0: its scores alone.
    {
      mbar_wait(&bar.q_full[ring.st], ring.ph);
      turn_wait(cw);
      wgmma_fence();
      issue_scores(ring.st);
      turn_pass(cw);
      wgmma_wait<0>();
      pin(s);
      pin(dp);
      if (n_q == 1) release(&bar.kv_empty);
      probabilities(0, ring.st);
      write_operands(0);
    }
    for (int j = 1; j < n_q; ++j) {
      const int pst = ring.st;  // tile j - 1's stage
      ring.next();
      mbar_wait(&bar.q_full[ring.st], ring.ph);
      turn_wait(cw);
      wgmma_fence();
      issue_scores(ring.st);
      issue_grads(pst);
      turn_pass(cw);
      wgmma_wait<1>();
      pin(s);
      pin(dp);
      if (j == n_q - 1) release(&bar.kv_empty);
      probabilities(j, ring.st);
      wgmma_wait<0>();
      pin(dv_acc);
      pin(dk_acc);
      release(&bar.q_empty[pst]);
      write_operands(j);
    }
    // The last tile's dV and dK products.
    {
      turn_wait(cw);
      wgmma_fence();
      issue_grads(ring.st);
      turn_pass(cw);
      wgmma_wait<0>();
      pin(dv_acc);
      pin(dk_acc);
      release(&bar.q_empty[ring.st]);
      ring.next();
    }
    const int64_t kvoff = (int64_t(b) * a.T * a.Hkv + hkv) * HD;
    store_rows_direct<HD>(dk_acc, a.scale, dk + kvoff, kvs, u_lo, a.T, lane);
    store_rows_direct<HD>(dv_acc, 1.f, dv + kvoff, kvs, u_lo, a.T, lane);
  }
  if (cw == 0) turn_wait(cw);
#endif
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                cudaEnableDefault, &found));
    MHAR_CHECK(found == cudaDriverEntryPointSuccess && f,
               "attention: the CUDA driver has no cuTensorMapEncodeTiled (CUDA 12.0 or later)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The map of a [B, T, H, HD] bf16 tensor as (feature, head, position, batch), boxes of
// 64 features x 1 head x box_rows positions, swizzled 128 bytes.
template <int HD>
CUtensorMap tensor_map(const bf16* base, int64_t B, int64_t T, int64_t H, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[4] = {cuuint64_t(HD), cuuint64_t(H), cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(HD) * sizeof(bf16), cuuint64_t(H * HD) * sizeof(bf16),
                                 cuuint64_t(T * H * HD) * sizeof(bf16)};
  const cuuint32_t box[4] = {kBoxCols, 1, cuuint32_t(box_rows), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<bf16*>(base), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MHAR_CHECK(r == CUDA_SUCCESS, "attention: cuTensorMapEncodeTiled failed (error ", int(r),
             ") for a [", B, ", ", T, ", ", H, ", ", HD, "] tensor");
  return map;
}

// A persistent kernel's grid: one block per SM, at most one per work item. The first call
// for a kernel also raises its shared-memory limit to `smem`.
template <auto Kernel>
unsigned persistent_blocks(size_t smem, int64_t items) {
  static const int sms = [smem] {
    CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(smem)));
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return unsigned(std::min<int64_t>(items, sms));
}

}  // namespace

template <int HD>
void forward_ws(cudaStream_t s, bf16* out, float* lse, const bf16* q, const bf16* k,
                const bf16* v, const AttentionArgs& a) {
  MHAR_CHECK(available(), "hopper::forward_ws called without a compute capability 9.0 device");
  const CUtensorMap qm = tensor_map<HD>(q, a.B, a.T, a.Hq, kItemRows);
  const CUtensorMap km = tensor_map<HD>(k, a.B, a.T, a.Hkv, kTileKeys);
  const CUtensorMap vm = tensor_map<HD>(v, a.B, a.T, a.Hkv, kTileKeys);
  const unsigned blocks = persistent_blocks<forward_ws_kernel<HD>>(
      ws_smem<HD>(), ceil_div(a.T, kItemRows) * a.Hq * a.B);
  forward_ws_kernel<HD><<<blocks, kWsThreads, ws_smem<HD>(), s>>>(out, lse, qm, km, vm, a);
  CUDA_CHECK_LAUNCH();
}

template <int HD>
void dkdv_ws(cudaStream_t s, bf16* dk, bf16* dv, bf16* score_grads, const bf16* dout,
             const bf16* q, const bf16* k, const bf16* v, const float* lse, const float* Dsum,
             const AttentionArgs& a) {
  MHAR_CHECK(available(), "hopper::dkdv_ws called without a compute capability 9.0 device");
  const CUtensorMap qm = tensor_map<HD>(q, a.B, a.T, a.Hq, kBwdRows);
  const CUtensorMap dom = tensor_map<HD>(dout, a.B, a.T, a.Hq, kBwdRows);
  const CUtensorMap km = tensor_map<HD>(k, a.B, a.T, a.Hkv, kTileKeys);
  const CUtensorMap vm = tensor_map<HD>(v, a.B, a.T, a.Hkv, kTileKeys);
  const unsigned blocks = persistent_blocks<dkdv_ws_kernel<HD>>(
      dkdv_ws_smem<HD>(), ceil_div(a.T, kTileKeys) * a.Hkv * a.B);
  dkdv_ws_kernel<HD><<<blocks, kWsThreads, dkdv_ws_smem<HD>(), s>>>(dk, dv, score_grads, lse,
                                                                     Dsum, qm, dom, km, vm, a);
  CUDA_CHECK_LAUNCH();
}

template void dkdv_ws<64>(cudaStream_t, bf16*, bf16*, bf16*, const bf16*, const bf16*,
                          const bf16*, const bf16*, const float*, const float*,
                          const AttentionArgs&);
template void dkdv_ws<128>(cudaStream_t, bf16*, bf16*, bf16*, const bf16*, const bf16*,
                           const bf16*, const bf16*, const float*, const float*,
                           const AttentionArgs&);
template void forward_ws<64>(cudaStream_t, bf16*, float*, const bf16*, const bf16*,
                             const bf16*, const AttentionArgs&);
template void forward_ws<128>(cudaStream_t, bf16*, float*, const bf16*, const bf16*,
                              const bf16*, const AttentionArgs&);

}  // namespace mhar::cuda::hopper
