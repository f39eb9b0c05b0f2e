// residual.h: the residual scheme, the one seam between the layer loop (model.cpp) and
// what a residual mode does to the depth history (DESIGN.md sections 2 and 4).
//
// The layer loop is the same for every mode: the embedding writes history slot 0; for
// each site j the scheme builds the site input x_j, sublayer j reads it and its last
// matmul writes history slot j+1, and the scheme is told (sublayer_done); the backward
// runs the same events in reverse, the sublayers reading source_grad() and writing
// site_grad(). Everything that differs between modes lives behind this interface, one
// implementation per scheme (residual_standard.cpp; residual_routed.cpp for attnres and
// mhar, full or block routing; residual_hyper.cpp for Hyper-Connections; residual_delta.cpp for the converted delta mode): its parameters (declared with their init kind, so that
// every initialiser reads the kind instead of matching names), its buffers in the
// activation plan (including the site inputs, whose lifetime is the scheme's business),
// its site forward and backward and the gradients of the sources.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/allocator.h"
#include "engine/backend.h"
#include "engine/config.h"

namespace mhar {

struct Parameter;

// What a parameter starts as (DESIGN.md section 1), stated where it is declared.
enum class Init {
  Normal,  // normal(0, Parameter::init_std): matrices
  One,     // norm weights, routing gains
  Zero,    // routing queries: every site starts as the uniform mean of its sources
  // Hyper-Connections' static coefficients start as the pre-norm residual stream:
  OneHot,    // element Parameter::init_arg is 1, the others 0 (A_m = one-hot(k mod n))
  Identity,  // [m, m] row-major identity, m = Parameter::init_arg (A_r = I_n)
  HyperScale,  // 0.01: dynamic Hyper-Connections' learned scales s_a, s_b
};

// The events of one step as the activation plan counts them (DESIGN.md section 4):
// site j at 2j, sublayer j at 2j+1, the head at 4L+1; the backward runs event e at
// back(e). A buffer saved by event e for its backward lives [e, back(e)].
struct Timeline {
  int L = 0;
  int events() const { return 4 * L + 2; }
  int last() const { return 2 * events() - 1; }
  int site(int j) const { return 2 * j; }
  int sublayer(int j) const { return 2 * j + 1; }
  int head() const { return 4 * L + 1; }
  int back(int e) const { return 2 * events() - 1 - e; }
};

// The RMSNorm that the consumer of site input x_j applies first (sublayer j's input norm,
// or the head's final norm for j = 2L): y = x_j * rstd * w, rstd saved (Backend's
// rmsnorm_forward).
struct SiteNorm {
  Tensor y, rstd, w;
  double eps = 0;
};

// What a scheme reads of its model. `act` resolves an activation plan id (the plan is
// rebuilt when decoding changes the chunk length, so ids are resolved at each use).
struct SchemeContext {
  Backend& be;
  const ModelConfig& cfg;
  const ResidualConfig& res;
  std::function<Tensor(int)> act;
  const std::vector<Parameter>& params;
};

// The routing ops' view of per-site query and gain parameters (indices into
// SchemeContext::params, one each per site): values and gradients, in site order. Shared
// by the schemes that route (routed, delta).
RoutingParams bind_routing_params(const SchemeContext& c, const std::vector<int>& query,
                                  const std::vector<int>& gain);  // residual_routed.cpp

class ResidualScheme {
 public:
  virtual ~ResidualScheme() = default;

  // ---- parameters. The scheme's own are small vectors without weight decay, added in
  // one gradient bucket named bucket() (nullptr: the scheme has none and no bucket
  // exists). init_arg: Init::OneHot's hot element, Init::Identity's side; else 0.
  using AddParameter =
      std::function<int(const std::string& name, int64_t numel, Init init, int64_t init_arg)>;
  virtual const char* bucket() const { return nullptr; }
  virtual void add_parameters(const AddParameter&) {}
  virtual void bind_parameters() {}  // once the parameters' tensors exist

  // ---- activation memory. Adds the scheme's buffers to P, in the step's timeline t,
  // for N token rows, and one site input [N, d] per site into site_x. `history` is the
  // model's [S, N, d] buffer.
  virtual void plan(MemoryPlan& P, const Timeline& t, int64_t N, int history,
                    std::vector<int>& site_x) = 0;

  // ---- what its backend ops' temporaries depend on (Backend::op_scratch_bytes): the
  // scheme sets its part of `shapes` (routing layout, heads and depth tiles; hyper
  // streams); the model has set the rest. The default: no ops beyond the model's.
  virtual void op_scratch_shapes(OpScratchShapes& shapes) const { (void)shapes; }

  // ---- forward. site_forward(j) writes x_j once history slots 0..j are written;
  // sublayer_done(j) runs right after sublayer j has written history slot j+1.
  virtual void site_forward(int j) = 0;
  virtual void sublayer_done(int) {}
  // The model's call for site j: site_forward(j), and, where the scheme can produce it in
  // the same pass, the consumer's normed input `norm` of x_j (true: norm.y and norm.rstd
  // are written, bit for bit what rmsnorm_forward of x_j would write). false: only x_j
  // is written and the model normalises it. The standard scheme fuses its residual add
  // with the norm (Backend::add_rmsnorm_forward), the routed schemes their mix
  // (Backend::routing_mix_rmsnorm; routing_mix_tile_rmsnorm at a depth tile's first site);
  // the default fuses nothing.
  virtual bool site_forward_normed(int j, const SiteNorm& norm) {
    (void)norm;
    site_forward(j);
    return false;
  }

  // ---- backward. begin_backward() first; the consumer of x_j (sublayer j, or the head
  // for j = 2L) writes dx_j into site_grad(j), then site_backward(j) runs; sublayer j's
  // backward reads source_grad(j+1), the embedding's source_grad(0), each complete when
  // read. finish_backward() runs after site 0 and says whether the gradients of bucket()
  // are now complete.
  // site_grad_accumulates(j): the consumer adds dx_j into site_grad(j) ("+=",
  // rmsnorm_backward's accumulate_dx) instead of overwriting it. The standard scheme
  // hands out its running sum there, so that no separate add is needed; site_grad(j) is
  // then the buffer of source_grad(j+1), so sublayer j adds into it only after its last
  // read of source_grad(j+1) (model.cpp: the input norm's backward is its last op).
  virtual void begin_backward() = 0;
  virtual Tensor site_grad(int j) = 0;
  virtual bool site_grad_accumulates(int j) const {
    (void)j;
    return false;
  }
  virtual void site_backward(int j) = 0;
  virtual Tensor source_grad(int i) = 0;
  // source_grad_held_through_site(): source_grad(j+1) is a buffer of its own, planned to
  // live until site_backward(j) has run, which neither writes it nor lets anything reuse
  // its memory; so sublayer j's weight gradients that read it may run beside that site's
  // backward (model.cpp, side work). Not the standard scheme: its site_grad(j) is that
  // buffer, added into by the input norm's backward.
  virtual bool source_grad_held_through_site() const { return false; }
  virtual bool finish_backward() = 0;

  // ---- routing views (routed schemes; the others fail naming the mode). After a
  // forward: site j mixes site_sources(j) sources; routing_weights(j) downloads its
  // softmax weights as [N, H, site_sources(j)]; routing_stats(j, stats) is
  // Backend::routing_stats of the site.
  virtual int site_sources(int j) const;
  virtual std::vector<double> routing_weights(int j) const;
  virtual void routing_stats(int j, Tensor stats);
};

std::unique_ptr<ResidualScheme> make_residual_scheme(const SchemeContext& ctx);

}  // namespace mhar
