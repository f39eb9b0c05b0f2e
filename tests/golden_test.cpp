// golden_test.cpp: the engine against an independent implementation. The fixtures in
// tests/fixtures/golden/ were made by tools/reference/make_golden.py (PyTorch autograd,
// float64, on the GPU machine): weights, one batch, and the expected loss, logits and
// every parameter gradient, per residual mode. The CPU engine must match per tensor,
// relative error ||ours - ref|| / ||ref||:
//   fp32 engine: <= 1e-5 (fp32 rounding accumulated over a few hundred ops)
//   fp64 engine: <= 1e-10 (the same arithmetic in fp64, different summation orders)
#include <gtest/gtest.h>

#include "engine/safetensors.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

struct GoldenCase {
  const char* mode;
  DType dtype;
  double tolerance;
};

class Golden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(Golden, LossLogitsAndEveryGradientMatchPyTorch) {
  const GoldenCase& gc = GetParam();
  const std::string path =
      std::string(MHAR_SOURCE_DIR) + "/tests/fixtures/golden/" + gc.mode + ".safetensors";
  SafetensorsFile f = SafetensorsFile::load(path);
  nlohmann::json meta = nlohmann::json::parse(f.metadata().at("config").get<std::string>());
  const int B = meta.at("batch"), T = meta.at("seq_len");
  nlohmann::json cfg_json = {{"model", meta.at("model")}, {"residual", meta.at("residual")},
                             {"train", {{"micro_batch", B}, {"seq_len", T}, {"warmup_steps", 0}}}};
  Config cfg = config_from_json(cfg_json, path);
  ASSERT_STREQ(residual_mode_name(cfg.residual.mode), gc.mode);

  auto be = make_cpu_backend(gc.dtype);
  Model m(cfg.model, cfg.residual, *be, B, T);
  // Every model parameter must be in the fixture, and every fixture weight in the model.
  size_t weights_in_file = 0;
  for (const auto& name : f.names())
    if (name.rfind("model.", 0) == 0 || name.rfind("lm_head.", 0) == 0) ++weights_in_file;
  ASSERT_EQ(weights_in_file, m.parameters().size());
  for (auto& p : m.parameters()) {
    ASSERT_EQ(f.numel(p.name), p.value.numel()) << p.name;
    auto w = f.to_f64(p.name);
    be->upload(p.value, w.data());
  }
  const auto tokens = f.to_i32("input_ids"), targets = f.to_i32("targets");
  ASSERT_EQ(int(tokens.size()), B * T);

  const double loss = m.forward(tokens.data(), targets.data(), 0.0);
  const double ref_loss = f.to_f64("expected.loss")[0];
  EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), gc.tolerance)
      << "loss " << loss << " vs " << ref_loss;
  const double logits_err = rel_error(download(*be, m.logits()), f.to_f64("expected.logits"));
  EXPECT_LE(logits_err, gc.tolerance);

  m.zero_grads();
  m.forward(tokens.data(), targets.data(), 1.0);
  m.backward();
  double worst = 0;
  for (auto& p : m.parameters()) {
    const double err = rel_error(download(*be, p.grad), f.to_f64("expected.grad." + p.name));
    EXPECT_LE(err, gc.tolerance) << p.name;
    worst = std::max(worst, err);
  }
  std::printf("[ golden ] %s %s: loss %.9f (ref %.9f), logits error %.2e, worst gradient error %.2e\n",
              gc.mode, dtype_name(gc.dtype), loss, ref_loss, logits_err, worst);
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, Golden,
    ::testing::Values(GoldenCase{"standard", DType::F32, 1e-5}, GoldenCase{"attnres", DType::F32, 1e-5},
                      GoldenCase{"mhar", DType::F32, 1e-5}, GoldenCase{"standard", DType::F64, 1e-10},
                      GoldenCase{"attnres", DType::F64, 1e-10}, GoldenCase{"mhar", DType::F64, 1e-10}),
    [](const ::testing::TestParamInfo<GoldenCase>& i) {
      return std::string(i.param.mode) + "_" + dtype_name(i.param.dtype);
    });

}  // namespace
