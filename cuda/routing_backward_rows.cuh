// routing_backward_rows.cuh: what the routing backward's two files share
// (routing_backward.cu: the value kernels and the op; routing_backward_tile.cu: the
// backward depth tile's pair kernels): a site's value path and key path for one slot and
// token, row parts, the stream kernels' rings of rows in shared memory, the one-wave and
// stream launches, and the tile launch's arguments. Conventions: cuda/routing.cu.
#pragma once

#include <algorithm>

#include "cuda/routing_host.h"

namespace mhar::cuda::routing_detail {

// ubar of site `source` for token n (span layout), from its input gradient dx (this
// lane's chunks, already loaded) and its input x: head h's sum of dx . x; the head's
// leader lane stores it in ubar's row `source`.
// G: the lanes a head, 32 / g.H (a caller that knows it at compile time passes it so, and
// head_sum's loop unrolls).
template <int NT>
__device__ __forceinline__ float span_ubar_row(float* ubar, const Row<NT>& dx, const Row<NT>& rx,
                                               const Geometry& g, int source, int64_t n, int G) {
  const int lane = threadIdx.x & 31, h = lane / G;
  const float ub = head_sum(lane_dot(dx, rx), G);
  if (lane % G == 0) ubar[(int64_t(source) * g.H + h) * g.N + n] = ub;
  return ub;
}
template <int NT>
__device__ __forceinline__ float span_ubar_row(float* ubar, const Row<NT>& dx, const Row<NT>& rx,
                                               const Geometry& g, int source, int64_t n) {
  return span_ubar_row(ubar, dx, rx, g, source, n, 32 / g.H);
}
template <int NT>
__device__ __forceinline__ float span_ubar(float* ubar, const Row<NT>& dx, const bf16* x,
                                           const Geometry& g, int source, int64_t n) {
  Row<NT> rx;
  load_span(rx, x + n * g.d);
  return span_ubar_row(ubar, dx, rx, g, source, n);
}

// This lane's chunks of a site's qg row.
template <int NT>
__device__ __forceinline__ void load_qg_row(float (&q)[NT][8], const float4* qrow) {
#pragma unroll
  for (int t = 0; t < NT; ++t) load_qg8(q[t], qrow, t);
}

// The key path of one site for one slot: acc += (r ds) qg_k, and with kRadial the slot's
// radial term ds (qg_k . v)[head] on the head's leader lane. qg_k: this lane's chunks, from
// qrow, or from q where they were loaded before (pair version 15).
// Without kRadial (pair version 16, value version 7) the radial sum comes from the
// accumulator instead, once a token (acc_dot, below). A slot's radial sum over its sites,
// sum_k sum_h ds_kh (qg_k . v)_h, is v . K with K = sum_k ds_k qg_k (by head), and the
// accumulator holds r K plus the value path sum_k a_k dx_k, whose dot with v is sum_k
// sum_h a_kh u_kh, u_kh = (dx_k . v)_h, which value_site and pair_site already form for
// ds. So radial = (v . acc - sum_k sum_h a_kh u_kh) / r: one dot a token where kRadial
// takes one a site (16 FMAs, a head sum and the leader's FMA a slot and site at d 512).
// The sums run in another order (and the subtraction cancels the value path's share: fp32
// rounding of order |v| |acc| / r, far below dv's bf16 rounding), so those versions are
// held to the CPU reference's bounds, not to the defaults' bits
// (routing_backward_sum_order); `radial` is left untouched.
template <bool kRadial, int NT, class RV, class Chunk>
__device__ __forceinline__ void key_site_chunks(float (&acc)[NT][8], float& radial, const RV& rv,
                                                Chunk&& chunk, float r, float ds, int G,
                                                bool leader) {
  [[maybe_unused]] float vq = 0.f;
  const float rds = r * ds;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float q[8];
    chunk(t, q);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (kRadial) vq += q[e] * at(rv, t, e);
      acc[t][e] += rds * q[e];
    }
  }
  if constexpr (kRadial) {
    vq = head_sum(vq, G);
    if (leader) radial += ds * vq;
  }
}
template <bool kRadial = true, int NT, class RV>
__device__ __forceinline__ void key_site(float (&acc)[NT][8], float& radial, const RV& rv,
                                         const float4* qrow, float r, float ds, int G,
                                         bool leader) {
  key_site_chunks<kRadial>(
      acc, radial, rv, [&](int t, float(&q)[8]) { load_qg8(q, qrow, t); }, r, ds, G, leader);
}
template <bool kRadial = true, int NT, class RV>
__device__ __forceinline__ void key_site(float (&acc)[NT][8], float& radial, const RV& rv,
                                         const float (&q)[NT][8], float r, float ds, int G,
                                         bool leader) {
  key_site_chunks<kRadial>(
      acc, radial, rv,
      [&](int t, float(&c)[8]) {
#pragma unroll
        for (int e = 0; e < 8; ++e) c[e] = q[t][e];
      },
      r, ds, G, leader);
}

// This lane's share of v . acc (either row form).
template <int NT, class RV>
__device__ __forceinline__ float acc_dot(const float (&acc)[NT][8], const RV& rv) {
  float p = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) p += acc[t][e] * at(rv, t, e);
  return p;
}

// The fused key path's last term: acc -= r^3/d radial v (radial: the whole row's sum of
// key_site's radial terms).
template <int NT, class RV>
__device__ __forceinline__ void subtract_radial(float (&acc)[NT][8], const RV& rv, float r,
                                                float radial, int64_t d) {
  const float scale = r * r * r / float(d) * radial;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[t][e] -= scale * at(rv, t, e);
}

// One site k of a slot's value path, token n (span layout): acc += a_k dx_k, and the
// slot's logit gradient ds_k = a_k (u_k - ubar_k), u_k = head h's sum of dx_k . v. Every
// value kernel (plain, ring, pair) runs its sites through this, so they share the bits.
// u_out (the radial sum from the accumulator, value version 7): u_k itself.
template <int NT>
__device__ __forceinline__ float value_site(float (&acc)[NT][8], const Row<NT>& rdx,
                                            const Row<NT>& rv, float a, float ub, int G,
                                            float* u_out = nullptr) {
  float p = 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float dxe = elem(rdx.raw[t], e);
      p += dxe * elem(rv.raw[t], e);
      acc[t][e] += a * dxe;
    }
  const float u = head_sum(p, G);
  if (u_out) *u_out = u;
  return a * (u - ub);
}

// Row parts: a token's row split over 2^parts_log2 consecutive warps, part p owning the
// features [p d / P, (p + 1) d / P) and with them the H / P whole heads from p H / P (span
// layout within the part: NT = d / (256 P) chunks a lane, G = 32 P / H lanes a head).
// Fewer chunks a lane leave the registers for a deeper ring of site rows (the value and
// pair kernels' rings): more bytes in flight where a whole row's registers would spill.
// parts_log2 = 0 is the whole row, as the span layout has it.
struct RowPart {
  int64_t n;    // the token
  int64_t off;  // the part's first feature
  int h, G;     // this lane's head, lanes a head
};
__device__ __forceinline__ RowPart row_part(int64_t warp, int parts_log2, int nt, int H) {
  const int p = int(warp & ((int64_t(1) << parts_log2) - 1)), Hp = H >> parts_log2;
  const int G = 32 / Hp;
  return {warp >> parts_log2, int64_t(p) * 256 * nt, p * Hp + int(threadIdx.x & 31) / G, G};
}

// ubar of site `source` for token rp.n, head rp.h (span_ubar_row on a row part).
template <int NT>
__device__ __forceinline__ float part_ubar(float* ubar, const Row<NT>& dx, const bf16* x,
                                           const Geometry& g, const RowPart& rp, int source) {
  Row<NT> rx;
  load_span(rx, x + rp.n * g.d + rp.off);
  const float ub = head_sum(lane_dot(dx, rx), rp.G);
  if ((threadIdx.x & 31) % rp.G == 0) ubar[(int64_t(source) * g.H + rp.h) * g.N + rp.n] = ub;
  return ub;
}

// The sum of one float per row part over a token's parts (consecutive warps of one block:
// 2^parts_log2 divides kWarpsPerBlock), in part order, for every lane. xch alternates
// between its two halves by the warp's token count (`round`), so one barrier per token
// suffices: a part cannot rewrite a half before its partners passed the barrier after
// reading it.
__device__ __forceinline__ float parts_sum(float v, float (*xch)[kWarpsPerBlock], int parts_log2,
                                           int round) {
  if (parts_log2 == 0) return v;
  const int warp = threadIdx.x >> 5, parts = 1 << parts_log2, first = warp & ~(parts - 1);
  float* half = xch[round & 1];
  if ((threadIdx.x & 31) == 0) half[warp] = v;
  // Named barrier 1 + (the token's slot in the block) over the token's 32 * parts threads.
  asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / parts), "r"(32 * parts) : "memory");
  float s = 0.f;
  for (int p = 0; p < parts; ++p) s += half[first + p];
  return s;
}

// dv = acc - r^3/d radial v of a token's part (radial: the whole row's sum).
template <int NT, class RV>
__device__ __forceinline__ void store_fused_dv(bf16* dv, float (&acc)[NT][8], const RV& rv, float r,
                                               float radial, int d) {
  subtract_radial(acc, rv, r, radial, d);
  store_span(dv, acc);
}

// ---------------------------------------------------------------- the tile's pair kernels
// Their shapes and versions (routing_backward_tile.cu's comment on the pair versions says
// what each number does), which the value kernels' launches and the sum-order query use too.
constexpr int kBackTileMaxNT = 5;  // d <= 1280: 234 registers, no spills (NT 6: 239; 7, 8 spill)
constexpr int pair_blocks_per_sm(int NT, int version) { return version >= 2 && NT <= 4 ? 3 : 2; }
constexpr bool pair_on_tensor_cores(int version) { return version == 12 || version == 13; }
// The lanes a head G = 32 / H as a compile-time constant (pair version 11 on, value
// version 7): H 4 or 8, the paper shapes (with_lanes_a_head).
constexpr bool lanes_a_head_constant(int heads) { return heads == 4 || heads == 8; }
// Whether a fused pair tile of whole rows (fused parts 0) runs version 16's stream kernel
// (versions 17 and 18 too: 17's fused form is 16's, 18's stores its ds r elsewhere), whose
// radial sums come at the end in their own order (routing_backward_sum_order).
constexpr bool pair_sums_radial_at_end(int version, int fused_parts_log2, int heads) {
  return version >= 16 && fused_parts_log2 == 0 && lanes_a_head_constant(heads);
}
constexpr int kPairRing = 4;
constexpr int kPairRingMaxNT = 2;

// ---------------------------------------------------------------- rows staged in shared memory
// The stream kernels' machinery (pair versions 7-16, value version 6): see
// routing_backward_tile.cu, "pair kernel, streamed".
template <int NT>
struct StreamSlot {  // one item of a stream kernel's ring: a row, three scalars
  uint4 row[NT * 32];
  float scalar[3][32];
};
constexpr int stream_slots(int NT) { return NT <= 4 ? 7 : 9; }
template <int NT>
constexpr size_t stream_smem() {
  return size_t(kWarpsPerBlock) * stream_slots(NT) * sizeof(StreamSlot<NT>);
}
// The shared-memory carveout, in percent of sm_90's 228 KiB, of the smallest capacity it
// offers that holds `blocks` blocks of `smem` bytes (plus the 1 KiB a block the system
// reserves): the rest stays L1. At d 1024 and 1280 that is all 228 KiB; at d 512, 132.
inline int stream_carveout(size_t smem, int blocks) {
  const size_t need = size_t(blocks) * (smem + 1024);
  for (int kib : {0, 8, 16, 32, 64, 100, 132, 164, 196})
    if (size_t(kib) * 1024 >= need) return (100 * kib + 227) / 228;
  return 100;
}
// Version 8's position of chunk c of a row: c XOR (c / 8 mod NT) where NT is a power of two,
// so that the 8 lanes of a 16-byte shared load (chunks NT l + t) hit 8 distinct bank
// groups; odd NT (3, 5, 7) are conflict-free unswizzled; NT 6 has 2-way conflicts.
template <int NT>
__device__ __forceinline__ int stream_pos(int c) {
  return (NT & (NT - 1)) == 0 ? c ^ ((c >> 3) & (NT - 1)) : c;
}

// cp.async for the stream kernels. attention_mma.cuh has 16-byte .cg, commit and wait
// twins without "memory" clobbers (the attention kernels order them by __syncthreads);
// here each one must also keep the compiler from moving a slot's shared-memory reads
// across its refill or its wait, and version 7 has no barrier. One set for both is left
// for a session that can time the attention kernels with the clobbers.
__device__ __forceinline__ void cp_async_ca(void* dst, const void* src, int bytes16or4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (bytes16or4 == 16)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_cg16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_group() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait_groups() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A warp's ring of R slots in shared memory, filled one cp.async group an item by the
// kernel's `issue(slot)` (which copies the next item of its stream into the slot, or nothing
// past the stream's end), R - 1 items ahead of the consumer.
template <int NT, int R, bool SYNC>
struct SlotRing {
  StreamSlot<NT>* slots;
  int fill = 0, next = 0;
  template <class Issue>
  __device__ __forceinline__ void refill(Issue& issue) {
    issue(slots[fill]);
    cp_async_group();  // one group an item, empty past the end: the waits count items
    if (++fill == R) fill = 0;
  }
  // The next item's slot, once the copies into it have landed (SYNC: every lane's, hence
  // the warp barrier, which also orders every lane's reads of the slot taken before it
  // ahead of its refill here; else each lane waits for its own copies only). The slot
  // taken before it, whose values were all read out then, is refilled.
  template <class Issue>
  __device__ __forceinline__ const StreamSlot<NT>& take(Issue& issue) {
    cp_async_wait_groups<R - 2>();
    if constexpr (SYNC) __syncwarp();
    refill(issue);
    const StreamSlot<NT>& slot = slots[next];
    if (++next == R) next = 0;
    return slot;
  }
  __device__ __forceinline__ const StreamSlot<NT>& taken() const {
    return slots[next == 0 ? R - 1 : next - 1];
  }
};

// Version 8's copy of NT * 32 chunks (a bf16 row, or half an fp32 row) into a slot: lane l
// copies chunks l + 32 u, whole sectors, at their stream_pos.
template <int NT>
__device__ __forceinline__ void copy_chunks_async(StreamSlot<NT>& slot, const uint4* src) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < NT; ++u)
    cp_async_cg16(&slot.row[stream_pos<NT>(lane + 32 * u)], src + lane + 32 * u);
}
// This lane's span (chunks NT lane + t) of a row that copy_chunks_async staged.
template <int NT>
__device__ __forceinline__ void slot_span(const StreamSlot<NT>& slot, Row<NT>& r) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < NT; ++t) r.raw[t] = slot.row[stream_pos<NT>(lane * NT + t)];
}

// ---------------------------------------------------------------- host side
// `blocks` of `threads` threads capped at the blocks of `kernel` that are resident at once: a
// grid of one wave (a last, partial wave would leave most SMs idle at its end; the kernels
// that loop over their tokens). routing_set_grid_cap (tests) caps it further.
template <class K>
int one_wave(K kernel, int64_t blocks, int threads, size_t smem = 0) {
  blocks = std::min<int64_t>(blocks,
                             int64_t(sm_count()) * resident_blocks_per_sm(kernel, threads, smem));
  return int(g_grid_cap > 0 ? std::min<int64_t>(blocks, g_grid_cap) : blocks);
}
// The same for the token kernels' blocks of kWarpsPerBlock warps, a warp a token.
template <class K>
int one_wave_blocks(K kernel, int64_t warps, size_t smem = 0) {
  return one_wave(kernel, token_blocks(warps), 32 * kWarpsPerBlock, smem);
}

// A stream kernel (source_value_pair_stream_kernel, source_value_stream_kernel) on a grid
// of one wave of the blocks that fit beside `smem` bytes each, `blocks_per_sm` of them
// with the carveout they need.
template <class K, class... Args>
void launch_stream(cudaStream_t s, K kernel, size_t smem, int blocks_per_sm, int64_t warps,
                   Args... args) {
  allow_smem(kernel, smem);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  stream_carveout(smem, blocks_per_sm)));
  const int blocks = one_wave_blocks(kernel, warps, smem);
  kernel<<<blocks, 32 * kWarpsPerBlock, smem, s>>>(args...);
  CUDA_CHECK_LAUNCH();
}

// A whole-row span kernel in one of three instantiations: with the lanes a head G = 32 / H
// as a compile-time constant where `constant` (pair version 11) and H is 4
// or 8 (G 8 or 4: the paper shapes), else `runtime`, whose G is 32 / g.H at run time.
template <class K>
K with_lanes_a_head(bool constant, int heads, K runtime, K g8, K g4) {
  if (!constant || !lanes_a_head_constant(heads)) return runtime;
  return heads == 4 ? g8 : g4;
}

// log2 of the row parts (RowPart) of at most `chunks` chunks a lane that split the span
// geometry g's row and heads evenly; -1 where none do (1B's d 1280: 5 chunks a lane).
inline int row_parts_log2(const Geometry& g, int chunks) {
  const int nt = g.d / 256;
  int parts_log2 = 0;
  while ((nt >> parts_log2) > chunks) ++parts_log2;
  const int parts = 1 << parts_log2;
  return nt % parts == 0 && g.H % parts == 0 ? parts_log2 : -1;
}

// The row parts' chunks a lane that each lab version asks for (0: whole rows): value
// versions 3, 5 and 7 at most 2, 4 at most 1; pair versions 5 at most 2, 6 at most 1.
inline int value_part_chunks(int version) {
  return version == 3 || version == 5 || version == 7 ? 2 : version == 4 ? 1 : 0;
}
inline int pair_part_chunks(int version) { return version == 5 ? 2 : version == 6 ? 1 : 0; }
// row_parts_log2 for `chunks` (0: the whole row, log2 0).
inline int parts_log2_for(const Geometry& g, int chunks) {
  return chunks ? row_parts_log2(g, chunks) : 0;
}

// Calls f(std::integral_constant<int, NT>) for a row part's chunks a lane (1 or 2).
template <class F>
void dispatch_part_span(int nt, F&& f) {
  MHAR_CHECK(nt == 1 || nt == 2, "CUDA routing: row parts of ", nt, " chunks a lane");
  if (nt == 1)
    f(std::integral_constant<int, 1>{});
  else
    f(std::integral_constant<int, 2>{});
}

// The older slot of a backward depth tile that starts at `source` (the pair kernel).
struct TileSlot {
  const bf16* v = nullptr;
  const float* inv_rms = nullptr;
};

// What source_backward hands the backward tile's launch (backward_tile,
// routing_backward_tile.cu): the first slot `source` of a tile whose older slot rides along.
struct BackTileLaunch {
  Tensor weights, ubar, inv_rms;
  const SiteRows& rows;
  const bf16* x;
  const bf16* v;
  const TileSlot* older;
  const float* qg;
  bf16* dv;  // the first slot's dv where the tile is fused, else its fp32 value row `val`
  float* val;
  Geometry g;
  int heads, source, ns, fused_parts_log2;  // fused_parts_log2 >= 0: the fused form
};
// The tile's pass: the pair kernel of the pair version in force, the older slot's share
// left in the RoutingBackTile scratch.
void backward_tile(cudaStream_t s, RoutingContext& ctx, const BackTileLaunch& t);
// Logit gradients stored by token (pair versions 17-18, value versions 8-9), ds r of `slots`
// slots (1 or 2) for `sites` sites from the call's first, [site][token][slot][head] in
// ds_by_token, moved into the weights' pairs [pair][head][token] that the key gradients read:
// w0 the first slot's pairs at that site, w1 the older slot's (slots 2). heads 4 or 8
// (lanes_a_head_constant).
void ds_by_token_to_pairs(cudaStream_t s, float* w0, float* w1, const float* ds_by_token, int64_t N,
                          int sites, int heads, int slots);

}  // namespace mhar::cuda::routing_detail
