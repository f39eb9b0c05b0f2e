// embedding_cudatest.cpp: CUDA embedding forward/backward against the CPU reference. Both
// are exact: the forward copies bf16 rows, and the backward adds each id's gradient rows in
// token order in fp32 on both backends (cuda/embedding.cu), so the GPU's dtable must have
// the CPU's bits, and the same bits on every run. Every backward test runs each kernel-lab
// version of the backward (embedding_backward_set_version).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class EmbeddingParity : public CudaParity {
 protected:
  // body(tag) once with each version of the backward kernel set, the default restored after
  // (also when an assertion returns early).
  void for_each_backward_version(const std::function<void(const std::string&)>& body) {
    struct Restore {
      ~Restore() { cuda::embedding_backward_set_version(0); }
    } restore;
    for (int v = 1; v <= cuda::embedding_backward_versions(); ++v) {
      cuda::embedding_backward_set_version(v);
      body(" (backward version " + std::to_string(v) + ")");
    }
  }
};

TEST_F(EmbeddingParity, ForwardAndBackwardOddSizesWithRepeatedTokens) {
  for (auto [N, V, d] : {std::tuple<int64_t, int64_t, int64_t>{37, 101, 96},
                         {300, 50, 300}, {5, 7, 1000}}) {
    const std::string tag = "N" + std::to_string(N) + " V" + std::to_string(V) + " d" +
                            std::to_string(d);
    std::uniform_int_distribution<int32_t> tok(0, int32_t(V) - 1);
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (auto& t : ids) t = tok(rng);
    ids[N - 1] = ids[0];  // a repeated token: its gradient rows must add up
    Pair tokens = pair(DType::I32, {N});
    cpu->upload_tokens(tokens.c, ids.data());
    gpu->upload_tokens(tokens.g, ids.data());

    Pair table = random_pair(DType::BF16, {V, d}, 0.5);
    Pair out = pair(DType::BF16, {N, d});
    out.g.poison();
    cpu->embedding_forward(out.c, tokens.c, table.c);
    gpu->embedding_forward(out.g, tokens.g, table.g);
    // A copy of bf16 values: exact, so any error at all is a bug.
    expect_close("embedding_forward out " + tag, out.g, out.c, 1e-12);

    Pair dout = random_pair(DType::BF16, {N, d});
    const std::vector<double> start = random_normal(rng, V * d, DType::F32, 1.0);
    Pair dtable = pair(DType::F32, {V, d});  // += output: starts non-zero
    dtable.c.set(start);
    cpu->embedding_backward(dtable.c, dout.c, tokens.c);
    for_each_backward_version([&](const std::string& version) {
      dtable.g.set(start);
      gpu->embedding_backward(dtable.g, dout.g, tokens.g);
      expect_same_bits("embedding_backward dtable " + tag + version, dtable.g.get(),
                       dtable.c.get());
    });
  }
}

// Few ids among many tokens: runs of hundreds of rows (longer than a block's unrolled
// fetch, and across blocks of columns when d > 256), the order of a run's additions visible
// in the last bits (gradient rows of mixed magnitude), ids sorted over more than one radix
// pass (V > 256), and a second call into the same dtable, as the micro-batches of a step
// accumulate. Twice on the GPU from the same start: the same bits.
TEST_F(EmbeddingParity, BackwardLongRunsHaveTheCpuBitsEveryRun) {
  for (auto [N, V, d] :
       {std::tuple<int64_t, int64_t, int64_t>{4099, 5, 520}, {6000, 70000, 64}, {1, 3, 33}}) {
    const std::string tag =
        "N" + std::to_string(N) + " V" + std::to_string(V) + " d" + std::to_string(d);
    std::vector<int32_t> ids(static_cast<size_t>(N));
    // V 70000: 7 ids 0..6 and 7 from the top of the range, so that the sort's higher
    // digits decide.
    std::uniform_int_distribution<int32_t> pick(0, V > 8 ? 13 : int32_t(V) - 1);
    for (auto& t : ids) {
      t = pick(rng);
      if (V > 8 && t >= 7) t = int32_t(V) - 1 - (t - 7);
    }
    Pair tokens = pair(DType::I32, {N});
    cpu->upload_tokens(tokens.c, ids.data());
    gpu->upload_tokens(tokens.g, ids.data());
    std::vector<double> g = random_normal(rng, N * d, DType::BF16, 1.0);
    for (size_t i = 0; i < g.size(); i += 3) g[i] = round_to(DType::BF16, g[i] * 1e3);
    Pair dout = pair(DType::BF16, {N, d});
    dout.set(g);
    const std::vector<double> start = random_normal(rng, V * d, DType::F32, 1.0);
    Pair dtable = pair(DType::F32, {V, d});
    dtable.c.set(start);
    for (int call = 0; call < 2; ++call) cpu->embedding_backward(dtable.c, dout.c, tokens.c);
    const std::vector<double> want = dtable.c.get();
    for_each_backward_version([&](const std::string& version) {
      dtable.g.set(start);
      for (int call = 0; call < 2; ++call) gpu->embedding_backward(dtable.g, dout.g, tokens.g);
      const std::vector<double> first = dtable.g.get();
      expect_same_bits("embedding_backward (two calls) " + tag + version, first, want);
      dtable.g.set(start);
      for (int call = 0; call < 2; ++call) gpu->embedding_backward(dtable.g, dout.g, tokens.g);
      expect_same_bits("embedding_backward, second run " + tag + version, dtable.g.get(), first);
    });
  }
}

// Runs whose ends fall on and around the edges of version 2's windows of 32 sorted entries,
// widths below, at and past a warp's 32 columns and a block's 256, bf16 and fp32 gradient
// rows. Runs of 1, 31, 32, 33, 63, 64, 65, 96, 128, 2, 1, 1 and 19 entries (536), shuffled.
// With `in_order` the ids grow with the run's place in that list, so the sorted runs end at
// 1, 32, 64, 97, 160, 224, 289, 385, 513, 515, 516, 517 and 536: runs that end exactly at a
// window's end, with (160, 224: the batch after a full one takes nothing) and without (32,
// 64) a batch past their own window, and one that crosses into the next window by one
// entry (97). Otherwise the ids are spread over V in another order. N below 536 keeps the
// first N entries of the shuffled list (the runs' lengths change), N 512 a multiple of 32.
TEST_F(EmbeddingParity, BackwardRunsAcrossWindowEdges) {
  const std::vector<int> lengths = {1, 31, 32, 33, 63, 64, 65, 96, 128, 2, 1, 1, 19};
  const int total = std::accumulate(lengths.begin(), lengths.end(), 0);  // 536
  for (auto [N, d, dtype, in_order] :
       {std::tuple<int64_t, int64_t, DType, bool>{total, 257, DType::BF16, true},
        {total, 33, DType::F32, true},
        {total, 257, DType::BF16, false},
        {512, 31, DType::BF16, false},
        {total, 32, DType::F32, false},
        {total - 19, 1, DType::F32, false},
        {512, 300, DType::F32, true}}) {
    const int64_t V = 1000;
    const std::string tag = "N" + std::to_string(N) + " d" + std::to_string(d) + " " +
                            dtype_name(dtype) + (in_order ? " ids in run order" : "");
    std::vector<int32_t> ids;
    for (size_t r = 0; r < lengths.size(); ++r) {
      const int32_t id = in_order ? int32_t(17 + 73 * r) : int32_t((r * 389 + 17) % V);
      ids.insert(ids.end(), size_t(lengths[r]), id);
    }
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(size_t(N));
    Pair tokens = pair(DType::I32, {N});
    cpu->upload_tokens(tokens.c, ids.data());
    gpu->upload_tokens(tokens.g, ids.data());
    Pair dout = pair(dtype, {N, d});
    std::vector<double> g = random_normal(rng, N * d, dtype, 1.0);
    for (size_t i = 0; i < g.size(); i += 5) g[i] = round_to(dtype, g[i] * 1e4);
    dout.set(g);
    const std::vector<double> start = random_normal(rng, V * d, DType::F32, 1.0);
    Pair dtable = pair(DType::F32, {V, d});
    dtable.c.set(start);
    cpu->embedding_backward(dtable.c, dout.c, tokens.c);
    for_each_backward_version([&](const std::string& version) {
      dtable.g.set(start);
      gpu->embedding_backward(dtable.g, dout.g, tokens.g);
      expect_same_bits("embedding_backward " + tag + version, dtable.g.get(), dtable.c.get());
    });
  }
}

}  // namespace
}  // namespace mhar::test
