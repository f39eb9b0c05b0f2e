// kernel_tuning_test.cpp: the kernel tuning passes (train_step.h, tune_kernels; backend.h,
// kernel_tuning_passes) on the CPU backend, through a wrapper that asks for passes the
// way the CUDA backend does (its matmul algorithms are timed in them; the GPU side is
// tests/matmul_cudatest.cpp):
// - tune_kernels runs exactly the passes the backend asks for, each one forward and one
//   backward, announced in order and ended once; a backend that asks for none runs none;
// - the passes leave no trace: a training step after them computes the loss and the
//   parameters of a step without them, bit for bit, in every residual mode.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "engine/communicator.h"
#include "engine/forwarding_backend.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/train_step.h"
#include "tests/model_test_util.h"

namespace mhar::test {
namespace {

// Asks for `passes` tuning passes and records what the caller does with them.
class TuningRecorder final : public ForwardingBackend {
 public:
  TuningRecorder(Backend& inner, int passes) : ForwardingBackend(inner), passes_(passes) {}
  int kernel_tuning_passes() const override { return passes_; }
  void begin_kernel_tuning_pass(int pass) override {
    EXPECT_FALSE(ended);
    begun.push_back(pass);
  }
  void end_kernel_tuning() override {
    EXPECT_FALSE(ended);
    ended = true;
  }
  void embedding_forward(Tensor o, Tensor t, Tensor w) override {
    ++forwards;
    ForwardingBackend::embedding_forward(o, t, w);
  }
  void embedding_backward(Tensor d, Tensor o, Tensor t) override {
    ++backwards;
    ForwardingBackend::embedding_backward(d, o, t);
  }

  std::vector<int> begun;
  bool ended = false;
  int forwards = 0, backwards = 0;

 private:
  int passes_;
};

struct StepOutcome {
  double loss;
  std::vector<std::vector<double>> params;
};

StepOutcome one_step(Model& model, const Config& cfg) {
  AdamWOptimizer opt(model, cfg.train, 0);
  auto comm = make_single_communicator();
  TrainStep step(model, opt, *comm, cfg.train, 1);
  std::vector<int32_t> tok, tgt;
  random_tokens(model.batch() * model.seq_len(), cfg.model.vocab_size, 11, tok, tgt);
  const auto batch = [&](int32_t* x, int32_t* y) {
    std::copy(tok.begin(), tok.end(), x);
    std::copy(tgt.begin(), tgt.end(), y);
  };
  StepOutcome out{step.run(0, batch).loss, {}};
  for (const auto& p : model.parameters()) out.params.push_back(download(model.backend(), p.value));
  return out;
}

TEST(KernelTuning, RunsTheBackendsPassesEachAForwardAndABackward) {
  const Config cfg = tiny_config(ResidualMode::Standard);
  auto cpu = make_cpu_backend(DType::F64);
  for (int passes : {0, 1, 5}) {
    SCOPED_TRACE(passes);
    TuningRecorder be(*cpu, passes);
    Model model(cfg.model, cfg.residual, be, 2, 5);
    model.init_weights(3);
    EXPECT_EQ(tune_kernels(model), passes);
    std::vector<int> expected(static_cast<size_t>(passes));
    for (int p = 0; p < passes; ++p) expected[size_t(p)] = p;
    EXPECT_EQ(be.begun, expected);
    EXPECT_EQ(be.ended, passes > 0);
    EXPECT_EQ(be.forwards, passes);
    EXPECT_EQ(be.backwards, passes);
  }
}

TEST(KernelTuning, TheStepAfterThePassesIsTheStepWithoutThem) {
  for (ResidualMode mode : {ResidualMode::Standard, ResidualMode::Mhar, ResidualMode::Delta}) {
    SCOPED_TRACE(residual_mode_name(mode));
    const Config cfg = tiny_config(mode, mode == ResidualMode::Standard ? 0 : 2);
    auto cpu = make_cpu_backend(DType::F64);
    TuningRecorder tuned_be(*cpu, 3);
    Model plain(cfg.model, cfg.residual, *cpu, 2, 5), tuned(cfg.model, cfg.residual, tuned_be, 2, 5);
    randomize_weights(plain, 7);  // gates and queries away from their zero init
    randomize_weights(tuned, 7);
    ASSERT_EQ(tune_kernels(tuned), 3);
    const StepOutcome a = one_step(plain, cfg), b = one_step(tuned, cfg);
    EXPECT_EQ(a.loss, b.loss);
    ASSERT_EQ(a.params.size(), b.params.size());
    for (size_t i = 0; i < a.params.size(); ++i)
      EXPECT_EQ(a.params[i], b.params[i]) << plain.parameters()[i].name;
  }
}

}  // namespace
}  // namespace mhar::test
