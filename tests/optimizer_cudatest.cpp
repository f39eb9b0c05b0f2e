// optimizer_cudatest.cpp: CUDA AdamW against the CPU reference, with fp32 master weights
// written to bf16 parameters, and with an fp32 parameter as its own master; the CUDA
// group step (one launch over many segments, 8-element vectors, cuda/optimizer.cu)
// against the per-segment scalar kernel, bit for bit; sum_squares' determinism on
// unaligned slices. DISABLED_ (run with --gtest_also_run_disabled_tests on the GPU): the
// bandwidth of the old per-segment step, the group step and the gradient norm's
// sum_squares at the 100M and 1B parameter counts (bandwidth_test_util.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "tests/bandwidth_test_util.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class AdamwParity : public CudaParity {};

TEST_F(AdamwParity, MasterWeightsAndPlainFp32) {
  const int64_t n = 100003;
  Backend::AdamW hp{};
  hp.lr = 3e-3;
  hp.beta1 = 0.9;
  hp.beta2 = 0.95;
  hp.eps = 1e-8;
  hp.weight_decay = 0.1;
  hp.grad_scale = 0.5;
  for (bool with_master : {true, false}) {
    const std::string tag = with_master ? "master f32 -> param bf16" : "param f32";
    // The CPU's parameter is its master; start both sides from the same fp32 values.
    auto w0 = random_normal(rng, n, DType::F32, 0.02);
    Pair param = pair(with_master ? DType::BF16 : DType::F32, {n});
    Buffer master(*gpu, DType::F32, {n});
    cpu->upload(param.c, w0.data());
    if (with_master) {
      master.set(w0);
      param.g.poison();
    } else {
      param.g.set(w0);
    }
    Pair m = pair(DType::F32, {n}), v = pair(DType::F32, {n});
    for (long long step = 1; step <= 3; ++step) {
      hp.step = step;
      Pair grad = random_pair(DType::F32, {n}, 1e-2);
      cpu->adamw(param.c, Tensor(), grad.c, m.c, v.c, hp);
      gpu->adamw(param.g, with_master ? master.t() : Tensor(), grad.g, m.g, v.g, hp);
    }
    // Moments and weights are fp32 on both sides (the CPU rounds fp64 arithmetic to fp32
    // once per step): differences stay at fp32 rounding level.
    expect_close("adamw m " + tag, m.g, m.c, kTolF32Output);
    expect_close("adamw v " + tag, v.g, v.c, kTolF32Output);
    if (with_master) {
      expect_close("adamw master " + tag, master.get(), param.c.get(), kTolF32Output);
      expect_close("adamw param " + tag, param.g, param.c, kTolBf16Output);
    } else {
      expect_close("adamw param " + tag, param.g, param.c, kTolF32Output);
    }
  }
}

// One segment of the group test: n elements at element `at` of the parameter and
// gradient buffers and at `state` of the moment and master buffers.
struct SegSpec {
  int64_t n, at, state;
  bool decay;
};

// The segments of a shard as the optimizer cuts them, and the odd cases: sizes not a
// multiple of 8, single elements, segments of several chunks (16384 elements) with a
// remainder, a segment whose tensors all start 1 element past 16 bytes (a scalar head,
// then vectors) and one whose parameter and state are misaligned against each other (no
// element where all five pointers align: scalar throughout), and gaps between segments
// (which must stay untouched).
std::vector<SegSpec> mixed_segments(int64_t* param_elems, int64_t* state_elems) {
  const std::vector<std::pair<int64_t, bool>> sizes = {
      {1280 * 96, true}, {1280, false},     {1, false},        {7, false},  {8, false},
      {9, true},         {16384 * 3, true}, {16384 + 5, true}, {100003, true}, {1281, false},
      {3, false},        {128 * 257, true}, {16385, false},    {2, true},   {640 * 129, true}};
  std::vector<SegSpec> out;
  int64_t at = 0, state = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto [n, decay] = sizes[i];
    // Parameters at multiples of 128 elements (Model::kParamAlign), the state at
    // multiples of 4 (16 bytes of fp32): vectors from the first element. Exceptions:
    int64_t p = (at + 127) / 128 * 128, s = (state + 3) / 4 * 4;
    if (i == 4) p += 1, s += 1;  // every tensor 1 element past 16 bytes: head 7, then vectors
    if (i == 11) p += 2, s += 2;  // 2 past: head 6
    if (i == 8) s += 1;           // param aligned, state not (never together): scalar
    out.push_back({n, p, s, decay});
    at = p + n + (i % 3 == 0 ? 5 : 0);  // and gaps
    state = s + n + (i % 4 == 1 ? 3 : 0);
  }
  *param_elems = at + 64;
  *state_elems = state + 64;
  return out;
}

class AdamwGroupParity : public CudaParity {};

TEST_F(AdamwGroupParity, GroupStepIsThePerSegmentScalarKernelBitForBit) {
  int64_t np = 0, ns = 0;
  const std::vector<SegSpec> specs = mixed_segments(&np, &ns);
  for (bool with_master : {true, false}) {
    for (DType grad_dtype : {DType::F32, DType::BF16}) {
      if (!with_master && grad_dtype == DType::BF16) continue;
      const DType param_dtype = with_master ? DType::BF16 : DType::F32;
      const std::string tag = std::string(with_master ? "master f32 -> param bf16" : "param f32") +
                              ", grad " + dtype_name(grad_dtype);
      SCOPED_TRACE(tag);
      // Two copies of every buffer (a: the group, b: the scalar kernel per segment), the
      // same random contents everywhere, gaps included; v >= 0 as a second moment is.
      struct Side {
        Buffer param, master, m, v;
      };
      auto p0 = random_normal(rng, np, param_dtype, 0.02);
      auto w0 = random_normal(rng, ns, DType::F32, 0.02);
      auto m0 = random_normal(rng, ns, DType::F32, 1e-3);
      auto v0 = random_normal(rng, ns, DType::F32, 1e-5);
      for (double& x : v0) x = std::fabs(x);
      auto make_side = [&] {
        Side s{Buffer(*gpu, param_dtype, {np}), Buffer(*gpu, DType::F32, {ns}),
               Buffer(*gpu, DType::F32, {ns}), Buffer(*gpu, DType::F32, {ns})};
        s.param.set(p0);
        s.master.set(w0);
        s.m.set(m0);
        s.v.set(v0);
        return s;
      };
      Side a = make_side(), b = make_side();
      Buffer grad(*gpu, grad_dtype, {np});
      auto slice = [](const Buffer& buf, int64_t at, int64_t n) {
        const Tensor& t = buf.t();
        return Tensor(static_cast<char*>(t.data) + size_t(at) * dtype_size(t.dtype), t.dtype, {n});
      };
      auto segment = [&](const Side& s, const SegSpec& sp) {
        return Backend::AdamWSegment{slice(s.param, sp.at, sp.n),
                                     with_master ? slice(s.master, sp.state, sp.n) : Tensor(),
                                     slice(grad, sp.at, sp.n), slice(s.m, sp.state, sp.n),
                                     slice(s.v, sp.state, sp.n), sp.decay};
      };
      // Without a master the parameter's elements are the weights: the state offsets are
      // then unused for w, and m/v keep theirs.
      std::vector<Backend::AdamWSegment> segs;
      for (const SegSpec& sp : specs) segs.push_back(segment(a, sp));
      const auto group = gpu->adamw_group(segs);
      for (long long step = 1; step <= 4; ++step) {
        grad.set(random_normal(rng, np, grad_dtype, 1e-2));
        Backend::AdamW hp{};
        hp.lr = 1e-3 * double(step);  // the per-step arguments change every step
        hp.beta1 = 0.9;
        hp.beta2 = 0.95;
        hp.eps = 1e-8;
        hp.weight_decay = 0.1;
        hp.grad_scale = 1.0 / double(step + 1);
        hp.step = step;
        gpu->adamw_step(*group, hp);
        for (const SegSpec& sp : specs) {
          const Backend::AdamWSegment s = segment(b, sp);
          Backend::AdamW h = hp;
          h.weight_decay = sp.decay ? hp.weight_decay : 0.0;
          gpu->adamw(s.param, s.master, s.grad, s.m, s.v, h);
        }
      }
      for (auto [what, ga, gb] : {std::make_tuple("param", &a.param, &b.param),
                                  std::make_tuple("master", &a.master, &b.master),
                                  std::make_tuple("m", &a.m, &b.m), std::make_tuple("v", &a.v, &b.v)}) {
        expect_same_bits(what, ga->get(), gb->get());
      }
      // And the update happened: the weights moved from where they started.
      const auto moved = with_master ? a.master.get() : a.param.get();
      const auto& start = with_master ? w0 : p0;
      const SegSpec& big = specs[0];
      const int64_t at = with_master ? big.state : big.at;
      int64_t changed = 0;
      for (int64_t i = 0; i < big.n; ++i) changed += moved[size_t(at + i)] != start[size_t(at + i)];
      EXPECT_GT(changed, big.n * 9 / 10);
    }
  }
}

// A group from another backend (here the default one) still runs on the CUDA backend:
// the per-segment loop.
TEST_F(AdamwGroupParity, ForeignGroupRunsThePerSegmentLoop) {
  const int64_t n = 1000;
  Buffer pa(*gpu, DType::BF16, {n}), wa(*gpu, DType::F32, {n}), ma(*gpu, DType::F32, {n}),
      va(*gpu, DType::F32, {n}), g(*gpu, DType::F32, {n});
  Buffer pb(*gpu, DType::BF16, {n}), wb(*gpu, DType::F32, {n}), mb(*gpu, DType::F32, {n}),
      vb(*gpu, DType::F32, {n});
  const auto w0 = random_normal(rng, n, DType::F32, 0.02);
  const auto m0 = random_normal(rng, n, DType::F32, 1e-3);
  auto v0 = random_normal(rng, n, DType::F32, 1e-5);
  for (double& x : v0) x = std::fabs(x);
  for (Buffer* b : {&ma, &mb}) b->set(m0);
  for (Buffer* b : {&va, &vb}) b->set(v0);
  for (Buffer* b : {&pa, &pb}) b->poison();
  wa.set(w0);
  wb.set(w0);
  g.set(random_normal(rng, n, DType::F32, 1e-2));
  Backend::AdamWGroup foreign({{pa, wa, g, ma, va, true}});
  Backend::AdamW hp{1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0, 1};
  gpu->adamw_step(foreign, hp);
  gpu->adamw(pb, wb, g, mb, vb, hp);
  for (auto [what, x, y] : {std::make_tuple("master", &wa, &wb), std::make_tuple("param", &pa, &pb),
                            std::make_tuple("m", &ma, &mb), std::make_tuple("v", &va, &vb)}) {
    expect_same_bits(what, x->get(), y->get());
  }
  EXPECT_FALSE(std::isnan(pa.get()[0]));  // written (it was poisoned)
}

// The gradient norm's sum of squares: the same bits on every call (the per-block sums
// are added in a fixed order), on slices that start 1-3 elements past 16 bytes (scalar
// heads) and end off a multiple of 8, and within the fp64 order bound of the CPU's sum.
TEST_F(AdamwGroupParity, SumSquaresSameBitsEveryRunOnUnalignedSlices) {
  for (DType t : {DType::F32, DType::BF16}) {
    const int64_t n = 3000017;
    Pair x = random_pair(t, {n + 8});
    for (int64_t off : {0, 1, 3, 5})
      for (int64_t len : {int64_t(1), int64_t(13), int64_t(65541), n}) {
        auto slice = [&](const Buffer& b) {
          return Tensor(static_cast<char*>(b.t().data) + size_t(off) * dtype_size(b.t().dtype),
                        b.t().dtype, {len});
        };
        const double ref = cpu->sum_squares(slice(x.c));
        const double got = gpu->sum_squares(slice(x.g));
        for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(gpu->sum_squares(slice(x.g)), got);
        // Squares exact in fp64 on both sides, only the order of the fp64 sums differs
        // (~n * 2^-53 relative at worst), as in ReductionsParity.SumSquares.
        EXPECT_LT(std::fabs(got - ref) / ref, 1e-9)
            << dtype_name(t) << " offset " << off << " n " << len;
      }
  }
}

// ---- bandwidth (DISABLED_)

class OptimizerBandwidth : public BandwidthTest {};

// Each line: bytes the op must move (AdamW with an fp32 master and a bf16 parameter: read
// grad, m, v, master, write m, v, master (4 bytes each) and the parameter (2): 30 bytes an
// element; sum_squares: the fp32 gradients once, 4 bytes an element), median device time,
// TB/s, % of copy. The old step is what AdamWOptimizer::step did before the group: one
// scalar-kernel launch per segment; the new one is AdamWOptimizer::step now.
TEST_F(OptimizerBandwidth, DISABLED_AdamwAndSumSquaresAtModelSizes) {
  measure_copy_rate();
  for (const char* name : {"100m_standard", "1b_standard"}) {
    const Config cfg = load_config(std::string(MHAR_SOURCE_DIR) + "/configs/" + name + ".json");
    Model model(cfg.model, cfg.residual, *gpu, 1, 16);
    uint64_t s = rng() | 1;
    auto draw = [&s](std::vector<double>& out, double scale) {
      for (double& x : out) {
        s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
        x = scale * (double((s * 0x2545F4914F6CDD1DULL) >> 11) * 0x1.0p-52 - 1.0);  // U(-1, 1)
      }
    };
    model.init_weights([&](const Parameter&, std::vector<double>& out) { draw(out, std::sqrt(3.0)); });
    const Tensor grads = model.all_gradients();
    std::vector<double> host;
    for (int64_t at = 0; at < grads.numel(); at += int64_t(1) << 24) {
      const int64_t len = std::min<int64_t>(int64_t(1) << 24, grads.numel() - at);
      host.resize(size_t(len));
      draw(host, 1e-2);
      gpu->upload(Tensor(static_cast<float*>(grads.data) + at, DType::F32, {len}), host.data());
    }
    AdamWOptimizer opt(model, cfg.train, 0);
    ASSERT_TRUE(opt.has_master());
    int64_t elems = 0;
    for (const ShardSegment& seg : opt.segments()) elems += seg.count;
    const double bytes = 30.0 * double(elems);
    const std::string at = " " + std::to_string(opt.segments().size()) + " segments, " +
                           std::to_string(elems) + " params, " + name;
    long long step = 1;
    const double lr = 1e-4, scale = 0.5;
    const double old_ms = median_ms([&](int) {
      const auto& params = model.parameters();
      for (const ShardSegment& seg : opt.segments()) {
        const Backend::AdamW hp{lr, cfg.train.beta1, cfg.train.beta2, cfg.train.adam_eps,
                                params[size_t(seg.param)].decay ? cfg.train.weight_decay : 0.0,
                                scale, step};
        gpu->adamw(opt.param_slice(seg), opt.weights(seg), opt.grad_slice(seg), opt.exp_avg(seg),
                   opt.exp_avg_sq(seg), hp);
      }
      ++step;
    }, 1, 10);
    report("adamw per segment (scalar kernel)" + at, bytes, old_ms);
    const double new_ms = median_ms([&](int) { opt.step(lr, scale, step++); }, 1, 10);
    report("adamw group step (vector kernel)" + at, bytes, new_ms);
    std::printf("BANDWIDTH adamw group / per segment: %.3f of the time (%s)\n", new_ms / old_ms, name);
    double first = 0;
    const double ss_ms = median_ms([&](int) {
      const double got = opt.shard_sum_squares();
      if (first == 0) first = got;
      EXPECT_EQ(got, first);  // the same bits every call
    }, 1, 10);
    report("sum_squares of the gradients (fp32)" + at, 4.0 * double(grads.numel()), ss_ms);
    EXPECT_TRUE(std::isfinite(first) && first > 0);
  }
}

}  // namespace
}  // namespace mhar::test
