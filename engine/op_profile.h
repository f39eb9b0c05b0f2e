// op_profile.h: where a training step's time goes, by op family (`mhar bench --profile`,
// issue 13). OpProfiler wraps the backend the model and optimizer run on; every op it
// passes on is bracketed by two timing marks (Backend::timing_mark: CUDA events on the
// backend's stream, or the host clock on the CPU, whose ops are synchronous), and
// finish_step() adds each op's time to its family with the work it had to do:
//   matmul      2 M N K FLOPs per call
//   attention   causal, FLOPs halved: forward 4 B Hq T^2 hd / 2, backward 2.5 x that
//               (five matmuls against two), as FlashAttention counts them
//   others      bytes: every tensor the op reads once and every tensor it writes once,
//               the least any kernel must move
// so that each family's achieved TFLOP/s or TB/s can be set against the roofline. Each
// family is also split by op (the backend call), and the matmul family by product (its
// shape, transposes and accumulation), to find the one call that runs below its family.
// "other / idle" is the step's wall time minus every op's time: launch gaps, host work,
// synchronisations, communication the ops do not hide. Profiled steps run slower than
// plain ones (two event records per op, and every op in issue order: as a
// ForwardingBackend the profiler runs the backward's side work, Backend::side_work_begin,
// in line rather than beside the routing), so the table is a budget, not the step time.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/forwarding_backend.h"

namespace mhar {

enum class OpFamily {
  Matmul, AttentionForward, AttentionBackward, Norms, Rope, Swiglu, Elementwise,
  Embedding, Routing, Classifier, Optimizer, Memory, kCount
};
const char* op_family_name(OpFamily f);
// Whether a family's work is counted in FLOPs (else in bytes).
bool op_family_counts_flops(OpFamily f);

struct OpFamilyTotals {
  double ms = 0;       // summed over the profiled steps
  double work = 0;     // FLOPs or bytes, summed likewise
  int64_t calls = 0;
};

class OpProfiler final : public ForwardingBackend {
 public:
  explicit OpProfiler(Backend& inner) : ForwardingBackend(inner) {}
  std::string name() const override { return in_.name(); }

  // Around each profiled step: begin_step() arms the profiler (until then ops pass
  // straight through, unmarked) and finish_step(wall_ms), once the step has
  // synchronised, adds its ops to the totals and disarms it; wall_ms is its host time.
  void begin_step();
  void finish_step(double wall_ms);
  int steps() const { return steps_; }
  const OpFamilyTotals& totals(OpFamily f) const { return totals_[size_t(f)]; }
  double wall_ms() const { return wall_ms_; }  // summed over the profiled steps

  // Per step: {"steps", "wall_ms", "families": [{"family", "ms", "share", "calls",
  // "tflops" | "tbps", "roofline_share"}], "other_ms", "other_share", "ops": [{"family",
  // "op", "ms", "calls", "tflops" | "tbps", "roofline_share"}] (every family split by the
  // backend call, slowest first), "matmul_products": [{"product", "ms", "calls",
  // "tflops", "roofline_share"}] (slowest first)}. The roofline is `peak_tflops` for
  // FLOP-counted families and `peak_tbps` for the others. A product is named by its
  // stored shapes, "C[M,N] = A[M,K] B[N,K]^T", with ^T after an operand that enters
  // transposed and += where it accumulates.
  nlohmann::json report(double peak_tflops, double peak_tbps) const;
  // The same as an aligned text table (one line per family, then other/idle and total,
  // then the ops of every family but matmul, then the matmul products).
  std::string table(double peak_tflops, double peak_tbps) const;

  void embedding_forward(Tensor out, Tensor tokens, Tensor table) override;
  void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) override;
  void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps) override;
  void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                        bool accumulate_dx) override;
  // The fused residual add + RMSNorm, timed as one op in the RMSNorm family (its row
  // then includes the standard scheme's residual adds), with its bytes: a, b, w read, x,
  // y, rstd written.
  void add_rmsnorm_forward(Tensor x, Tensor y, Tensor rstd, Tensor a, Tensor b, Tensor w,
                           double eps) override;
  void matmul(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, bool accumulate) override;
  void rope(Tensor x, double theta, bool backward) override;
  // The fused QK-norm + RoPE is timed as one op, so the profile times the fused kernels
  // an unprofiled step runs; it counts in the RoPE family (whose row then includes the
  // QK-norms), with the bytes it must move (the norm's: the rotation rides along).
  void qk_norm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps,
                            double theta, int64_t first_position) override;
  void qk_norm_rope_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                             double theta, bool accumulate_dx) override;
  void qk_norm_rope_forward_qk(const QkNormRopeOperands& q, const QkNormRopeOperands& k,
                               double eps, double theta, int64_t first_position) override;
  void qk_norm_rope_backward_qk(const QkNormRopeGradOperands& q, const QkNormRopeGradOperands& k,
                                double theta, bool accumulate_dx) override;
  void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v) override;
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                          Tensor v, Tensor out, Tensor lse) override;
  void swiglu_forward(Tensor h, Tensor gate_up) override;
  void swiglu_backward(Tensor d_gate_up, Tensor h, Tensor dh, Tensor gate_up) override;
  void add(Tensor out, Tensor a, Tensor b) override;
  void add_inplace(Tensor y, Tensor x) override;
  void cross_entropy(Tensor losses, Tensor logits, Tensor targets, double grad_scale,
                     bool compute_grad) override;
  void routing_source_logits(Tensor weights, Tensor inv_rms, Tensor v, const RoutingParams& params,
                             const RoutingLayout& layout, int source, int heads, double eps) override;
  void routing_mix(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout, int site,
                   int heads) override;
  void routing_mix_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                           const RoutingLayout& layout, int site, int heads, Tensor norm_w,
                           double eps) override;
  void routing_mix_tile(Tensor x, Tensor weights, Tensor history, const RoutingLayout& layout,
                        int site, int count, int heads) override;
  void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor rstd, Tensor weights, Tensor history,
                                const RoutingLayout& layout, int site, int count, int heads,
                                Tensor norm_w, double eps) override;
  void routing_source_backward(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                               const std::vector<Tensor>& site_dx, Tensor x, Tensor v, Tensor inv_rms,
                               const RoutingParams& params, const RoutingLayout& layout, int source,
                               int heads) override;
  void routing_source_backward_tile(Tensor dv, Tensor weights, Tensor ubar, Tensor gsum,
                                    const std::vector<Tensor>& site_dx, Tensor x, Tensor history,
                                    Tensor inv_rms, const RoutingParams& params,
                                    const RoutingLayout& layout, int source, int count,
                                    int heads) override;
  void routing_param_grads(const RoutingParams& params, Tensor gsum) override;
  // Hyper-Connections' stream ops: streaming reads and writes, counted as Elementwise.
  void hyper_mix(Tensor x, Tensor H, Tensor coef) override;
  void hyper_mix_backward(Tensor dH, Tensor dcoef, Tensor dx, Tensor H, Tensor coef,
                          bool accumulate) override;
  void hyper_update(Tensor out, Tensor in, Tensor v, Tensor Ar, Tensor B) override;
  void hyper_update_backward(Tensor din, Tensor dv, Tensor dAr, Tensor dB, Tensor dout, Tensor in,
                             Tensor v, Tensor Ar, Tensor B) override;
  // Delta mode's gated add and null source: streaming, counted as Elementwise.
  void delta_gate(Tensor x, Tensor base, Tensor alpha, Tensor r) override;
  void delta_gate_backward(Tensor dr, Tensor dalpha, Tensor dx, Tensor r, Tensor alpha,
                           Tensor scratch) override;
  void delta_null_forward(Tensor out, Tensor row) override;
  void delta_null_backward(Tensor drow, Tensor dout, Tensor scratch) override;
  // The fused delta steps, timed as one op each (as the fused QK-norm + RoPE): otherwise
  // the defaults would run the unfused sequences under the profiler.
  void delta_stream_advance(Tensor stream, Tensor slot, Tensor prev) override;
  void delta_resid_gate_backward(Tensor dresid, Tensor dr, Tensor dalpha, Tensor dx, Tensor r,
                                 Tensor alpha, Tensor scratch) override;
  void delta_source_grad(Tensor out, Tensor dresid, Tensor slot, Tensor next) override;
  void delta_site_forward(const DeltaSiteForward& a) override;
  void delta_site_backward(const DeltaSiteBackward& a) override;
  double sum_squares(Tensor t) override;
  void adamw(Tensor param, Tensor master, Tensor grad, Tensor m, Tensor v, const AdamW& hp) override;
  // The inner backend's group (its fused step), timed as one op of every segment's bytes.
  std::unique_ptr<AdamWGroup> adamw_group(std::vector<AdamWSegment> segments) override;
  void adamw_step(const AdamWGroup& group, const AdamW& hp) override;
  void zero(Tensor t) override;
  void copy(Tensor dst, Tensor src) override;

 private:
  // One op in flight: marks (or host times) before and after, and its work.
  class Span {
   public:
    // op: the profiler method's name (__func__), its row in ops_; product: an index into
    // products_ (a matmul's shape), or -1.
    Span(OpProfiler& p, const char* op, OpFamily f, double work, int product = -1);
    ~Span();
   private:
    OpProfiler& p_;
    OpFamily f_;
    double work_;
    int product_;
    int op_ = -1;
    int mark_ = -1;
    std::chrono::steady_clock::time_point t0_;
  };
  struct Pending {
    OpFamily family;
    int a, b;           // timing marks, or -1 when timed on the host
    double host_ms;     // when timed on the host
    double work;
    int product;        // products_ index, or -1
    int op;             // ops_ index
  };
  // A family's split: by op (the backend call: routing_mix, delta_gate, ...) for every
  // family, and the matmul family by product (shape, transposes, accumulation), to find
  // the call that runs below its family's rate.
  struct Part {
    OpFamily family;
    std::string label;
    OpFamilyTotals totals;
  };
  static int part_index(std::vector<Part>& parts, OpFamily f, const std::string& label);
  std::vector<Part> ops_, products_;
  bool armed_ = false;
  std::vector<Pending> pending_;
  std::array<OpFamilyTotals, size_t(OpFamily::kCount)> totals_{};
  double wall_ms_ = 0;
  int steps_ = 0;
  // The depth tile in flight (routing_mix_tile): sites (tile_first_, tile_end_) read
  // their partial sums and newer slots only, which their bytes count.
  int tile_first_ = -1, tile_end_ = -1;
  // A tile's first site's bytes (routing_mix_tile, routing_mix_tile_rmsnorm), starting the
  // tile in flight.
  double begin_tile_bytes(Tensor x, Tensor weights, const RoutingLayout& layout, int site,
                          int count, int heads);
  // A mix's bytes (routing_mix, routing_mix_rmsnorm), ending the tile at its last site.
  double mix_bytes(Tensor x, Tensor weights, const RoutingLayout& layout, int site, int heads);
  // The backward depth tile in flight (routing_source_backward_tile): its older slots,
  // back_first_ - m * block in (back_end_, back_first_), read their partial gradient and
  // the sites < back_first_ only.
  int back_first_ = -1, back_end_ = -1;
};

}  // namespace mhar
