// embedding_cudatest.cpp: CUDA embedding forward/backward against the CPU reference.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class EmbeddingParity : public CudaParity {};

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
    Pair dtable = random_pair(DType::F32, {V, d});  // += output: starts non-zero
    cpu->embedding_backward(dtable.c, dout.c, tokens.c);
    gpu->embedding_backward(dtable.g, dout.g, tokens.g);
    expect_close("embedding_backward dtable " + tag, dtable.g, dtable.c, kTolF32Output);
  }
}

}  // namespace
}  // namespace mhar::test
