// model_pair_util.h: one model on two backends (the CUDA backend against the CPU
// reference) with identical weights, and the norms the whole-model comparisons use.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/model.h"
#include "tests/model_test_util.h"

namespace mhar::test {

inline double norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// ||got - ref|| / ||ref||; infinite when `got` holds a non-finite value (an element the
// backend never wrote, or an overflow).
inline double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// DESIGN.md init on `src`, then norm weights and routing gains 1 +- 0.1 and routing
// queries ~query_std (zero queries would make every site a uniform mean and leave the
// routing's key path unexercised); src's stored values (bf16 on the GPU) are then copied
// to `dst`, so both start from identical weights.
inline void same_weights(Model& src, Model& dst, uint64_t seed, double query_std) {
  src.init_weights(seed);
  std::mt19937_64 rng(seed ^ 0x5eedULL);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (auto& p : src.parameters()) {
    if (p.init == Init::Normal) continue;
    std::vector<double> v(static_cast<size_t>(p.value.numel()));
    for (double& x : v) x = p.init == Init::Zero ? query_std * nd(rng) : 1.0 + 0.1 * nd(rng);
    src.backend().upload(p.value, v.data());
  }
  ASSERT_EQ(dst.parameters().size(), src.parameters().size());
  for (size_t i = 0; i < src.parameters().size(); ++i) {
    ASSERT_EQ(dst.parameters()[i].name, src.parameters()[i].name);
    const auto host = download(src.backend(), src.parameters()[i].value);
    dst.backend().upload(dst.parameters()[i].value, host.data());
  }
}

}  // namespace mhar::test
