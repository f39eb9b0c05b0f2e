// routing_logits_mma.h: logits versions 5-9 (routing_logits_mma.cu), one slot's routing
// logits and inv_rms on tensor cores. Internal to cuda/ (routing_logits.cu calls it).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace mhar::cuda {

constexpr int kLogitsMmaMaxSites = 256;  // the most sites a slot may have (as routing's kMaxSites)

// The per-site parameters of a slot's sites source .. source + ns - 1 (q and g, [d] bf16).
struct LogitsMmaSites {
  const bf16* q[kLogitsMmaMaxSites];
  const bf16* g[kLogitsMmaMaxSites];
};

// Whether the kernel takes a slot: 4 or 8 heads of head_dim 128 or 160, ns <= 256, v's rows
// 8-byte aligned.
bool logits_mma_applies(int64_t N, int d, int heads, int ns, const void* v);
// Whether logits_mma with wide_blocks takes a slot of ns sites in blocks of 128 tokens: it
// takes several site groups and such blocks keep more warps resident an SM (the occupancy
// calculator; at 8 heads of 160 past 16 sites, not at head_dim 128). False where
// logits_mma_applies is false.
bool logits_mma_takes_wide_blocks(int d, int heads, int ns);
// The q*g table's bytes for ns sites of width d (ns x d / 4 records of 16 bytes).
size_t logits_mma_table_bytes(int d, int ns);
// As routing_source_logits defines them: inv_rms[n] = 1 / sqrt(mean_c v[n, c]^2 + eps) and
// w[(k H + h) N + n] = inv_rms[n] sum_{c in head h} q_k[c] g_k[c] v[n, c] for k < ns.
// `table` is scratch of logits_mma_table_bytes, which the call fills with the sites'
// records unless table_filled (logits_mma_fill_table filled it, for these sites, before).
// group_sites: the most sites a block takes (a multiple of 8), 0 for the most its
// registers allow (versions 5-6, 8-9; 8 is version 7); the same bits either way. wide_blocks (versions 8-9): blocks of 128 tokens rather than
// 64 where the slot takes several site groups and such blocks keep more warps resident an
// SM; the same bits again. Returns false (nothing launched) where logits_mma_applies is
// false.
bool logits_mma(cudaStream_t s, float* w, float* inv_rms, const bf16* v,
                const LogitsMmaSites& sites, void* table, bool table_filled, int64_t N, int d,
                int heads, int ns, int group_sites, bool wide_blocks, float eps);
// The records of q*g for sites 0 .. ns - 1 of `sites` into `table` (logits_mma_table_bytes(d,
// ns)): a site's records start logits_mma_table_bytes(d, k) into the table, so rows from
// site k on are a table for a slot whose first site is k.
void logits_mma_fill_table(cudaStream_t s, void* table, const LogitsMmaSites& sites, int ns, int d);

}  // namespace mhar::cuda
