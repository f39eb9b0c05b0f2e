// kernels.h: the CUDA backend's op entry points, one group per .cu file (internal to
// cuda/). Each takes the backend's stream and the same tensors as the matching
// mhar::Backend method (engine/backend.h), with the same semantics: ops named "+=" there
// accumulate into their output, all others overwrite every element. Shapes and dtypes
// are checked here; every function only enqueues work on `stream`.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <functional>

#include "engine/backend.h"
#include "engine/tensor.h"

namespace mhar::cuda {

// embedding.cu
void embedding_forward(cudaStream_t s, Tensor out, Tensor tokens, Tensor table);
// embedding_backward: below ScratchSlot (its sorted token ids live in backend scratch).

// norm.cu
void rmsnorm_forward(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps);
// Backend::add_rmsnorm_forward: one pass (BF16, D % 8 == 0 up to 4096, 16-byte aligned),
// else add then rmsnorm_forward; the same bits either way.
void add_rmsnorm_forward(cudaStream_t s, Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b,
                         Tensor w, double eps);
// Whether rmsnorm_forward(y, rstd, x, w) runs its vector kernel with bf16 weights (the
// shapes are checked as rmsnorm_forward checks them): then a kernel that holds x's row in
// one warp, as 16-byte chunks lane + 32 t, can write y and rstd with that kernel's bits
// (routing_mix.cu, store_row_normed: the site's mix and its consumer's norm in one pass).
bool rmsnorm_forward_row_fusable(Tensor y, Tensor rstd, Tensor x, Tensor w);
// rmsnorm_backward: below ScratchSlot (its dw partial sums live in backend scratch).

// rope.cu
void rope(cudaStream_t s, Tensor x, double theta, bool backward, int64_t first_position = 0);

// attention.cu
void attention_forward(cudaStream_t s, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v);
// workspace: device scratch of at least attention_backward_workspace_bytes(B, T, Hq, hd)
// bytes, 256-byte aligned (the BF16 tensor-core paths keep the row dots D = dout . out
// there, and the Hopper backward its bf16 score-gradient tiles); may be null for the fp32
// path.
void attention_backward(cudaStream_t s, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q,
                        Tensor k, Tensor v, Tensor out, Tensor lse, void* workspace,
                        size_t workspace_bytes);
// The workspace attention_backward needs at these shapes on this device with the current
// kernel-lab settings (0 where nothing but the fp32 path could run).
size_t attention_backward_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t hd);
void attention_cached(cudaStream_t s, Tensor out, Tensor q, Tensor k_cache, Tensor v_cache);
// Kernel lab (the attention tests and timings compare both paths; the engine never calls
// it): whether the BF16 training forward may take the Hopper wgmma kernels where the
// device has them (default true). Returns the previous setting. Process-wide.
bool attention_set_hopper(bool enabled);
// Whether attention_forward would take the Hopper kernels now (enabled and available).
bool attention_uses_hopper();
// Kernel lab: the Hopper forward's version (returns the previous one). 1: two blocks per
// SM, every warp loading and computing (attention_hopper.cu); 2 (default): one persistent
// block per SM, a TMA producer warp and two consumer warpgroups (attention_hopper_ws.cu).
int attention_set_hopper_forward(int version);
// Kernel lab: the Hopper backward's version (returns the previous one). 1: the dq kernel
// recomputes S and dP itself (7 matrix products, dq and dk/dv independent); 2: the dk/dv
// kernel writes its bf16 dS tiles to the workspace and dq reads them (5 products); 3
// (default): as 2 with the warp-specialized dk/dv kernel (attention_hopper_ws.cu).
int attention_set_hopper_backward(int version);

// matmul.cu: cuBLASLt first, cuBLAS GemmEx when Lt offers no algorithm for a shape.
struct MatmulContext {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // A scratch C of `bytes` for timing an accumulating product's candidate algorithms at
  // its shape's first call (matmul.cu; the backend's ScratchSlot::MatmulTune), or null
  // where there is none that large (that shape then takes Lt's first choice). Unset:
  // every shape takes Lt's first choice, untimed.
  std::function<void*(size_t)> tune_scratch;
};
// The most bytes of C an accumulating product is timed in (larger ones, e.g. the LM
// head's fp32 weight gradient, take Lt's first choice): ScratchSlot::MatmulTune's size.
constexpr size_t kMatmulTuneScratchBytes = size_t(64) << 20;
void matmul(cudaStream_t s, MatmulContext& ctx, Tensor c, Tensor a, Tensor b, bool trans_a,
            bool trans_b, bool accumulate);
// Kernel lab (tests/op_timing_cudatest.cpp): shapes planned from now on take result number
// `rank` of Lt's heuristic (0-15; 0 is its first choice; a shape offering fewer takes its
// last), or with -1 (the default) the timed choice; returns the previous rank.
// matmul_heuristic_results: how many results the heuristic offered for the shape planned
// last (1 at most with rank 0).
int matmul_set_heuristic_rank(int rank);
int matmul_heuristic_results();
// The timed choices as text (empty: none made or given yet; given ones included), and such
// a text taken back: its picks stand untimed for their shapes from then on. matmul_use_choices
// returns how many it took, or -1 with *why_not set (another cuBLASLt or device, or not such a
// text): then nothing changes. matmul_timed_shapes: how many shapes this process has timed.
// matmul_forget_plans (tests): every shape planned afresh, as in a new process.
std::string matmul_choices();
int matmul_use_choices(const std::string& text, std::string* why_not);
int matmul_timed_shapes();
void matmul_forget_plans();

// mlp.cu
void swiglu_forward(cudaStream_t s, Tensor h, Tensor gate_up);
// h: empty, or overwritten with swiglu_forward's h (the same bits).
void swiglu_backward(cudaStream_t s, Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up);

// classifier.cu
void cross_entropy(cudaStream_t s, Tensor losses, Tensor logits, Tensor targets,
                   double grad_scale, bool compute_grad);
// Kernel lab: the cross-entropy's version (1: a block a row, the row read twice with the
// gradient; 2: a cluster of blocks a row, the row read once into shared memory; 3 on: 2
// with pass 1's exps kept for pass 2 (bf16 rows), each later version a faster form of it;
// cross_entropy_versions() of them; 0: the default. cuda/classifier.cu says what each does
// and which is the default). Returns the version it replaces.
int cross_entropy_set_version(int version);
int cross_entropy_versions();

// The ops' temporaries (Backend::op_scratch_bytes): an op asks for `bytes` in its slot and gets
// memory at least that large. With a model's scratch bound, every slot is a fixed part of that
// buffer (cuda_backend.cu lays them out from the model's shapes; a request beyond the planned size
// is an MHAR_CHECK); unbound, each slot is a grow-only buffer of the backend (a larger request
// reallocates it, synchronising the stream). A slot's contents last until the next request of the
// same slot; RoutingTile and RoutingBackTile carry a depth tile from one op to the next
// (routing_mix.cu, routing_backward.cu), RopeTable the cos/sin table from one call to the next (the
// backend refills it when theta, head_dim or the positions change, and after every binding),
// RoutingPassTables every site's q*g from the op of a bound pass that first needs them to the
// pass's last (QgPassTables), the others are used within one op. A new slot, or a request that
// grows with another shape, needs its size in scratch_layout (cuda_backend.cu), or models will fail
// the size check.
enum class ScratchSlot {
  AttentionBackward,
  RoutingTables,
  RoutingValueGrad,
  RoutingKeyGrad,
  RoutingPairSplit,
  RoutingPairDs,
  RoutingTile,
  RoutingBackTile,
  HyperPartials,
  NormPartials,
  MatmulTune,
  RopeTable,
  RoutingPassTables,
  EmbeddingSort,
  Count
};
using ScratchFn = std::function<void*(ScratchSlot, size_t)>;
inline const char* scratch_slot_name(ScratchSlot slot) {
  switch (slot) {
    case ScratchSlot::AttentionBackward: return "attention backward row dots and score gradients";
    case ScratchSlot::RoutingTables: return "routing query-gain tables";
    case ScratchSlot::RoutingValueGrad: return "routing value gradient rows";
    case ScratchSlot::RoutingKeyGrad: return "routing key gradient rows";
    case ScratchSlot::RoutingPairSplit: return "routing pair split";
    case ScratchSlot::RoutingPairDs:
      return "routing backward's logit gradients by token";
    case ScratchSlot::RoutingTile: return "routing depth tile";
    case ScratchSlot::RoutingBackTile: return "routing backward depth tile";
    case ScratchSlot::HyperPartials: return "hyper partial sums";
    case ScratchSlot::NormPartials: return "norm partial sums";
    case ScratchSlot::MatmulTune: return "matmul tuning output";
    case ScratchSlot::RopeTable: return "RoPE cos/sin table";
    case ScratchSlot::RoutingPassTables:
      return "routing query-gain tables of a pass";
    case ScratchSlot::EmbeddingSort:
      return "embedding gradient's sorted token ids";
    case ScratchSlot::Count: break;
  }
  return "?";
}

// embedding.cu (continued): the backward, deterministic (its header says how), and the
// most EmbeddingSort bytes it asks for with N tokens.
void embedding_backward(cudaStream_t s, Tensor dtable, Tensor dout, Tensor tokens,
                        const ScratchFn& scratch);
size_t embedding_backward_scratch_bytes(int64_t N);
// Kernel lab: how the backward walks the sorted runs (embedding.cu says what each version
// does and which is the default; every one gives the CPU's bits). 0: the default. Returns the
// version it replaces.
int embedding_backward_set_version(int version);
int embedding_backward_versions();

// cuda_backend.cu: where Backend::side_work_begin's ops run. 1: in issue order on the one
// stream; 2: on a second stream, beside the main stream's ops until the join (the same
// ops, so the same bits); 3: 2, and from a pass's first side work on the routing
// backward's key gradients on that stream too, joined at routing_param_grads
// (KeyGradsBeside). 0: the default. Returns the version it replaces.
int side_stream_set_version(int version);
int side_stream_versions();

// norm.cu (continued)
void rmsnorm_backward(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                      Tensor rstd, bool accumulate_dx, const ScratchFn& scratch);
// The most NormPartials bytes rmsnorm_backward or qk_norm_rope_backward asks for with rows
// of D elements, for any number of rows (its grid never exceeds the blocks resident at
// once); 0 where they take no scratch.
size_t rmsnorm_backward_scratch_bytes(int64_t D);
// The fused QK-norm + RoPE's cos/sin table (kernel version 6): positions [0, positions)
// of one head_dim (64, 128 or 256) and theta, fp32, the values the kernels would compute
// (the same bits). rope_table_bytes: its size, 0 where no table applies. rope_table_fill
// writes it into `table` (on the stream) and returns its description; the backend keeps
// it (ScratchSlot::RopeTable) and hands it to the calls below.
struct RopeTable {
  const float* data = nullptr;
  int64_t head_dim = 0, positions = 0;
  double theta = 0;
};
size_t rope_table_bytes(int64_t head_dim, int64_t positions);
RopeTable rope_table_fill(cudaStream_t s, void* table, double theta, int64_t head_dim,
                          int64_t positions);
// QK-norm + RoPE (Backend::qk_norm_rope_forward/backward): one pass where head_dim is 64,
// 128 or 256 (BF16, aligned), else the two ops in turn. `table` (optional): a cos/sin table
// of this theta and head_dim; used where it covers the call's positions.
void qk_norm_rope_forward(cudaStream_t s, Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                          double theta, int64_t first_position, const RopeTable& table = {});
void qk_norm_rope_backward(cudaStream_t s, Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w,
                           Tensor rstd, double theta, bool accumulate_dx,
                           const ScratchFn& scratch, const RopeTable& table = {});
// Backend::qk_norm_rope_forward_qk / _backward_qk: with QkNormRope lab version 7, q and k in
// one launch of the paired-lane kernels (and one dw finish for both) where both take them
// (version 7 is the default); otherwise, and with the other versions, the two calls above.
// The same bits as the two calls, except dw's fp32 sums (each tensor's partial rows come
// from its share of the one grid).
void qk_norm_rope_forward_qk(cudaStream_t s, const QkNormRopeOperands& q,
                             const QkNormRopeOperands& k, double eps, double theta,
                             int64_t first_position, const RopeTable& table = {});
void qk_norm_rope_backward_qk(cudaStream_t s, const QkNormRopeGradOperands& q,
                              const QkNormRopeGradOperands& k, double theta, bool accumulate_dx,
                              const ScratchFn& scratch, const RopeTable& table = {});
// Kernel lab (tests/kernel_bandwidth_cudatest.cpp times every version; the engine never
// calls it): numbered versions 1 .. norm_kernel_versions(k) of the vector norm kernels
// (Forward: rmsnorm_forward and add_rmsnorm_forward; Backward: rmsnorm_backward;
// QkNormRope: both fused QK-norm + RoPE ops), each a complete alternative with the same
// bits as version 1 except Backward 5, 6 and 10 (dw summed over their own grid), Backward
// 11 and 12 (dw summed in an order that varies run to run) and QkNormRope 6 and 7 (a row's
// sums in another order) (cuda/norm.cu says what each changes). version <= 0: the default.
// Returns the previous version. Process-wide, not thread-safe.
enum class NormKernel { Forward, Backward, QkNormRope };
int norm_set_kernel_version(NormKernel kernel, int version);
int norm_kernel_versions(NormKernel kernel);
// Timing only (tests/kernel_bandwidth_cudatest.cpp's NormBackwardScaling): while on, the
// norm backwards launch their main kernel and not the finish that sums dw's partial rows,
// so dw is left unchanged and WRONG; the lab times the main kernel alone this way.
// Returns the previous setting. Process-wide, not thread-safe.
bool norm_lab_skip_dw_finish(bool skip);
// Launches of the paired-lane QK-norm + RoPE kernels over q and k together
// (qk_norm_rope_forward_qk / _backward_qk) so far, in this process: tests check the one
// launch happened.
int64_t qk_pair_launches();

// Depth routing: cuda/routing.cu and the routing_*.cu files it names. The logits and the key path
// of the backward are small GEMMs per head (cuBLAS, on the backend's stream) around the token
// kernels; their temporaries come from the backend's scratch.
// The depth tile in flight (routing_mix_tile): the fp32 partial sums of sites
// first+1 .. first+count-1 over the slots <= first, in the RoutingTile scratch, valid for
// this weights/history pair until the tile's last site is mixed or a slot <= first gets
// new logits (the next forward).
struct MixTile {
  const void* weights = nullptr;
  const void* history = nullptr;
  RoutingLayout layout;
  int heads = 0;
  int first = -1, count = 0;
  int next = -1;  // the site whose routing_mix may use the tile next
};
// The backward depth tile in flight (routing_source_backward_tile): the older slot's
// (first - layout.block: RoutingLayout::back_tile_count) fp32 share of the sites >= first
// in the RoutingBackTile scratch, valid until that slot's routing_source_backward. The
// backward calls of the slots between the two leave it in flight; any other routing
// backward call ends it.
struct BackTile {
  const void* weights = nullptr;
  const void* ubar = nullptr;
  const void* older_v = nullptr;   // history row of the older slot
  const void* first_dx = nullptr;  // site_dx[first], to recognise the same call sequence
  RoutingLayout layout;
  int heads = 0;
  int first = -1;
  int older() const { return first - layout.block; }  // RoutingLayout::back_tile_count
};
// Every site's q*g (token-independent: the logits' and the key paths' operand), computed
// once per bound pass in the RoutingPassTables scratch rather than once per slot in
// RoutingTables: the fp32 rows [S, d] and routing_logits_mma's records [S, d / 4], each
// filled by the first op of the pass that needs it; a slot's rows are those of its sites.
// A pass is a model's forward or backward (CudaBackend::bind_op_scratch starts one at
// every binding, unbound ends it), whose routing parameters do not change while it runs;
// the tables hold the parameters they were computed from (`params`), and an op with others
// recomputes them. Only at lab version 2 of RoutingKernel::QgTables (not yet the default:
// routing_logits.cu); unbound (ops called without a model) or at version 1, each op computes its
// slot's rows; the same bits.
constexpr int kQgPassMaxSites = 256;  // routing_rows.cuh's kMaxSites
struct QgPassTables {
  bool pass = false;  // a model's pass is bound
  int sites = 0, d = 0;
  const void* params[2 * kQgPassMaxSites] = {};  // the sites' q then g pointers the tables hold
  float* f32 = nullptr;                          // filled, or null
  void* records = nullptr;                       // filled, or null
};
// Where the routing backward's key gradients run (slot_key_grads, routing_key_grads.cu):
// with `stream` null, on the op's stream; else on that stream (the backend's side stream,
// side_stream version 3), after the op's value kernel (the `ready` event) and in issue order
// among themselves, so with the same bits. They read only the slot's ds r pair rows and its
// history row, and add into gsum, which nothing else touches before routing_param_grads;
// the backend joins them there (`done`; `pending` says whether any were issued since).
struct KeyGradsBeside {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  bool pending = false;
};
struct RoutingContext {
  cublasHandle_t blas = nullptr;
  ScratchFn scratch;
  MixTile tile;
  BackTile back_tile;
  QgPassTables qg;
  KeyGradsBeside key_beside;
};
void routing_source_logits(cudaStream_t s, RoutingContext& ctx, Tensor weights, Tensor inv_rms,
                           Tensor v, const RoutingParams& params, const RoutingLayout& layout,
                           int source, int heads, double eps);
void routing_mix(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights, Tensor history,
                 const RoutingLayout& layout, int site, int heads);
// Backend::routing_mix_rmsnorm: the norm fused into the finish kernels of a depth tile's
// later sites (versions 4 and 6) where rmsnorm_forward_row_fusable, else the two ops.
void routing_mix_rmsnorm(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor y, Tensor rstd,
                         Tensor weights, Tensor history, const RoutingLayout& layout, int site,
                         int heads, Tensor norm_w, double eps);
void routing_mix_tile(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor weights,
                      Tensor history, const RoutingLayout& layout, int site, int count, int heads);
// Backend::routing_mix_tile_rmsnorm: the norm fused into tile kernel version 5 where
// rmsnorm_forward_row_fusable, else the two ops.
void routing_mix_tile_rmsnorm(cudaStream_t s, RoutingContext& ctx, Tensor x, Tensor y, Tensor rstd,
                              Tensor weights, Tensor history, const RoutingLayout& layout, int site,
                              int count, int heads, Tensor norm_w, double eps);
// Backend::routing_tile_sites and routing_tile_plan: the largest tile (kTileSites where the
// shape tiles, else 1) and the plan of fewest rows moved by routing_tile_rows, the traffic
// model of a tile of `count` sites from site j0 (rows of N d bf16; routing_plan_rows: a
// plan's from site 0).
int routing_tile_sites(const RoutingLayout& layout, int64_t d, int heads);
std::vector<int> routing_tile_plan(const RoutingLayout& layout, int64_t d, int heads);
int64_t routing_tile_rows(int j0, int count);
int64_t routing_plan_rows(const std::vector<int>& plan);
// The RoutingPassTables scratch of `sites` sites of width d (QgPassTables).
size_t routing_pass_tables_bytes(int sites, int64_t d);
void routing_source_backward(cudaStream_t s, RoutingContext& ctx, Tensor dv, Tensor weights,
                             Tensor ubar, Tensor gsum, const std::vector<Tensor>& site_dx,
                             Tensor x, Tensor v, Tensor inv_rms, const RoutingParams& params,
                             const RoutingLayout& layout, int source, int heads);
// Backend::routing_source_backward_tile; history [sources, N, d], inv_rms [sources, N].
void routing_source_backward_tile(cudaStream_t s, RoutingContext& ctx, Tensor dv, Tensor weights,
                                  Tensor ubar, Tensor gsum, const std::vector<Tensor>& site_dx,
                                  Tensor x, Tensor history, Tensor inv_rms,
                                  const RoutingParams& params, const RoutingLayout& layout,
                                  int source, int count, int heads);
int routing_backward_tile_slots(const RoutingLayout& layout, int64_t d, int heads);
// The RoutingPairDs scratch a backward tile of N tokens, slots read by at most `sites` sites
// and `heads` heads may ask for (pair versions 17-18's ds r by token; 0 where it cannot run);
// routing_value_ds_bytes, what one slot's plain call may ask for (value versions 8-9).
size_t routing_pair_ds_bytes(int64_t N, int sites, int heads);
size_t routing_value_ds_bytes(int64_t N, int sites, int heads);
// Backend::delta_site_backward in one token kernel (+ the key gradients and dalpha's
// partial sums) when the shapes allow it: span layout, bf16 rows, 16-byte aligned, the
// slot read by its own site only. Returns false (nothing done) otherwise.
bool routing_delta_site_backward(cudaStream_t s, RoutingContext& ctx, const DeltaSiteBackward& a);
bool routing_delta_site_backward_fuses(const DeltaSiteBackward& a);  // the shapes allow it
// Backend::delta_site_forward in one token kernel when the shapes allow it: span layout,
// bf16 rows, 16-byte aligned, the slot read by its own site only. Returns false (nothing
// done) otherwise.
bool routing_delta_site_forward(cudaStream_t s, RoutingContext& ctx, const DeltaSiteForward& a);
bool routing_delta_site_forward_fuses(const DeltaSiteForward& a);  // the shapes allow it
void routing_param_grads(cudaStream_t s, const RoutingParams& params, Tensor gsum);
// Kernel lab (tests/op_timing_cudatest.cpp sweeps it; the engine never calls it): slots
// read by at most `sites` sites take the fused source backward (-1: the built-in rule).
// Returns the previous limit. Process-wide, not thread-safe.
int routing_set_fused_key_max_sites(int sites);
int routing_fused_key_max_sites();
// Kernel lab: numbered versions 1 .. routing_kernel_versions(k) of a routing kernel, each a
// complete alternative (cuda/routing_host.h names the file that says what each does), so that one
// device run times them all. version <= 0: the default (the measured fastest, cuda/routing_host.h).
// Returns the previous version.
// Process-wide, not thread-safe; the engine never calls it.
enum class RoutingKernel {
  MixTile,
  BackwardPair,
  DeltaSite,
  DeltaForward,
  Logits,
  MixFinish,
  SourceValue,
  KeyGrad,
  MixNorm,
  QgTables,
  SourceFinish,
  TilePlan
};
int routing_set_kernel_version(RoutingKernel kernel, int version);
int routing_kernel_versions(RoutingKernel kernel);
// kernel_versions_env.cpp: sets the routing and norm kernels' lab versions named by the
// environment's MHAR_KERNEL_VERSIONS (NAME=VERSION,...; the step timed at a candidate
// default without a rebuild); nothing when it is unset. The backend's constructor calls it.
void apply_kernel_versions_from_env();
// The order in which the backward's per-head dot products (logit gradients, ubar) are
// summed at width d at the current BackwardPair, SourceValue and KeyGrad versions: the
// chunks a lane sums before the shuffles, as a code. Two version settings with equal codes
// give the same bits; row parts (pair versions 5-6, value versions 3-4) change it where they
// split the row, value version 5 (the key path fused into the value pass) wherever it
// applies, value version 7 and pair version 16 (the radial sums from the accumulators)
// where they differ from 5 and 15, key-gradient version 2 (the kernel past 8 sites) and
// 3-4 (tensor cores, every slot) the key gradients' sums, source-finish versions 2-3 (the
// unfused slots' key path in one kernel) their keys' sums.
int routing_backward_sum_order(int64_t d, int heads);
// Tests: caps the one-wave grids (the backward's pair and stream kernels) at `blocks` (0:
// no cap), so that small N still gives each warp several tokens; returns the previous
// cap. The same bits at any grid.
int routing_set_grid_cap(int blocks);
// Whether routing_source_logits of a slot read by `sites` sites at width d takes the
// token kernel (one pass over v) at the current Logits version, rather than the GEMMs or
// the tensor cores.
bool routing_logits_by_token_kernel(int64_t d, int heads, int sites);
// Whether it takes the tensor-core kernel (cuda/routing_logits_mma.cu) for such a slot
// (with v's rows aligned as the history's are) at the current Logits version.
bool routing_logits_by_tensor_cores(int64_t d, int heads, int sites);
// routing_stats.cu (the routing probe's device reduction)
void routing_stats(cudaStream_t s, Tensor stats, Tensor weights, const RoutingLayout& layout,
                   int site, int heads);

// hyper.cu (Hyper-Connections stream ops; n = 1..kHyperMaxStreams streams, bf16 streams
// and coefficients, F32 coefficient gradients). The backward ops leave per-block partial
// sums of the coefficient gradients in `ws` (at least hyper_workspace_floats(N*d, n)
// floats, owned by the caller) before adding them up in a fixed order: no atomics.
constexpr int kHyperMaxStreams = 8;
struct HyperWorkspace {
  float* data = nullptr;
  size_t floats = 0;
};
size_t hyper_workspace_floats(int64_t elements_per_stream, int n);
void hyper_mix(cudaStream_t s, Tensor x, Tensor H, Tensor coef);
void hyper_mix_backward(cudaStream_t s, Tensor dH, Tensor dcoef, Tensor dx, Tensor H,
                        Tensor coef, bool accumulate, const HyperWorkspace& ws);
void hyper_update(cudaStream_t s, Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B);
void hyper_update_backward(cudaStream_t s, Tensor din, Tensor dv, Tensor dAr, Tensor dB,
                           Tensor dout, Tensor in, Tensor v, Tensor Ar, Tensor B,
                           const HyperWorkspace& ws);
// Dynamic (residual.hyper_dynamic): C, T, dC [N, n, n+2] and rstd [N, n] F32, H [n, N, d]
// with d % 8 == 0, W [d, n+2], s_a, s_b [1] bf16 parameters. The coefficients' backward
// needs hyper_dynamic_workspace_floats(N, d, n) floats in `ws`.
size_t hyper_dynamic_workspace_floats(int64_t N, int64_t d, int n);
void hyper_dynamic_coef(cudaStream_t s, Tensor C, Tensor T, Tensor rstd, Tensor H, Tensor W,
                        Tensor Am, Tensor Ar, Tensor B, Tensor s_a, Tensor s_b, double eps);
void hyper_mix_dynamic(cudaStream_t s, Tensor x, Tensor H, Tensor C);
void hyper_mix_dynamic_backward(cudaStream_t s, Tensor dH, Tensor dC, Tensor dx, Tensor H,
                                Tensor C);
void hyper_update_dynamic(cudaStream_t s, Tensor out, Tensor in, Tensor v, Tensor C);
void hyper_update_dynamic_backward(cudaStream_t s, Tensor din, Tensor dv, Tensor dC, Tensor dout,
                                   Tensor in, Tensor v, Tensor C);
void hyper_dynamic_coef_backward(cudaStream_t s, Tensor dH, Tensor dW, Tensor dAm, Tensor dAr,
                                 Tensor dB, Tensor ds_a, Tensor ds_b, Tensor dC, Tensor H,
                                 Tensor W, Tensor T, Tensor rstd, Tensor s_a, Tensor s_b,
                                 const HyperWorkspace& ws);

// reductions.cu. sum_squares uses scratch (kSumSquaresScratch device doubles: the
// per-block sums, then the result) and returns the host value (synchronises the stream).
constexpr int kSumSquaresScratch = 4097;
double sum_squares(cudaStream_t s, Tensor t, double* scratch);
void add(cudaStream_t s, Tensor out, Tensor a, Tensor b);
void add_inplace(cudaStream_t s, Tensor y, Tensor x);

// delta.cu (residual.mode delta): scratch is F32 workspace of at least 1 (gate) or d
// (null) floats; its contents are undefined before and after.
void delta_gate(cudaStream_t s, Tensor x, Tensor base, Tensor alpha, Tensor r);
void delta_gate_backward(cudaStream_t s, Tensor dr, Tensor dalpha, Tensor dx, Tensor r,
                         Tensor alpha, Tensor scratch);
void delta_null_forward(cudaStream_t s, Tensor out, Tensor row);
void delta_null_backward(cudaStream_t s, Tensor drow, Tensor dout, Tensor scratch);
// The fused steps (backend.h): the same bits as their default op sequences. prev / next
// may be empty (Tensor()).
void delta_stream_advance(cudaStream_t s, Tensor stream, Tensor slot, Tensor prev);
void delta_resid_gate_backward(cudaStream_t s, Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx,
                               Tensor r, Tensor alpha, Tensor scratch);
void delta_source_grad(cudaStream_t s, Tensor out, Tensor dresid, Tensor slot, Tensor next);
// out[0] += the sum of partial[0..count) in a fixed order (one block): the second half of
// the gate's dalpha reductions (delta_gate_backward's, and routing_backward.cu's fused site
// backward's).
void delta_add_partials(cudaStream_t s, Tensor out, const float* partial, int count);

// optimizer.cu
void adamw(cudaStream_t s, Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v,
           const Backend::AdamW& hp);
// Backend::adamw_group for the backend `owner`: its device tables come from `allocate`
// and go back through `release` when the group is destroyed.
std::unique_ptr<Backend::AdamWGroup> adamw_group(std::vector<Backend::AdamWSegment> segments,
                                                 const void* owner,
                                                 const std::function<void*(size_t)>& allocate,
                                                 std::function<void(void*)> release);
// One step of a group made by adamw_group for `owner` (one launch per kind of segment);
// false, with nothing done, for any other group (the caller runs Backend's default).
bool adamw_step(cudaStream_t s, const Backend::AdamWGroup& group, const void* owner,
                const Backend::AdamW& hp);

}  // namespace mhar::cuda
