// matmul_cudatest.cpp: CUDA matmul (cuBLASLt, fp32 accumulation) against the CPU
// reference: every transpose combination, odd sizes, bf16 and fp32 outputs, overwrite and
// accumulate (a weight gradient summed into fp32), and fp32 inputs. Every check is the
// first call of its shape, so it also checks the result after the timed choice of
// algorithm (matmul.cu), which runs candidates into C itself (overwrite) or into a
// scratch C (accumulate).
#include <gtest/gtest.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class MatmulParity : public CudaParity {
 protected:
  void check(int64_t M, int64_t N, int64_t K, bool ta, bool tb, DType in, DType out, bool acc) {
    const std::string tag = "M" + std::to_string(M) + " N" + std::to_string(N) + " K" +
                            std::to_string(K) + (ta ? " At" : "") + (tb ? " Bt" : "") + " " +
                            dtype_name(in) + "->" + dtype_name(out) + (acc ? " +=" : "");
    Pair a = ta ? random_pair(in, {K, M}) : random_pair(in, {M, K});
    Pair b = tb ? random_pair(in, {N, K}) : random_pair(in, {K, N});
    Pair c = acc ? random_pair(out, {M, N}) : pair(out, {M, N});
    if (!acc) c.g.poison();
    cpu->matmul(c.c, a.c, b.c, ta, tb, acc);
    gpu->matmul(c.g, a.g, b.g, ta, tb, acc);
    // fp32 output: products of bf16 values are exact in fp32; only the summation order
    // differs from OpenBLAS (~sqrt(K) * 2^-24), far inside kTolF32Output.
    expect_close("matmul " + tag, c.g, c.c, out == DType::BF16 ? kTolBf16Output : kTolF32Output);
  }
};

TEST_F(MatmulParity, AllTransposesOddSizes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check(37, 53, 71, ta, tb, DType::BF16, DType::BF16, false);
      check(37, 53, 71, ta, tb, DType::BF16, DType::F32, true);
      check(128, 96, 256, ta, tb, DType::BF16, DType::BF16, false);
    }
}

TEST_F(MatmulParity, LinearLayerShapes) {
  // y = x W^T, dx = dy W, dW += dy^T x for x [N=300, in=256], W [out=384, in].
  check(300, 384, 256, false, true, DType::BF16, DType::BF16, false);
  check(300, 256, 384, false, false, DType::BF16, DType::BF16, false);
  check(384, 256, 300, true, false, DType::BF16, DType::F32, true);
  check(384, 256, 300, true, false, DType::BF16, DType::F32, false);
  check(300, 384, 256, false, true, DType::BF16, DType::BF16, true);
}

// The timed choice at a shape with several candidates: the first call (which timed them)
// gives the bits of the second (which reuses the choice) from the same inputs, for an
// overwritten bf16 C and an fp32 C accumulated into, and both match the CPU.
TEST_F(MatmulParity, TimedChoiceLeavesTheFirstCallExact) {
  for (bool acc : {false, true}) {
    const DType out = acc ? DType::F32 : DType::BF16;
    const int64_t M = 1536 + (acc ? 64 : 0), N = 1024, K = 640;  // shapes no other test plans
    Pair a = random_pair(DType::BF16, {M, K}), b = random_pair(DType::BF16, {N, K});
    Pair c = acc ? random_pair(out, {M, N}) : pair(out, {M, N});
    std::vector<double> start(size_t(M * N), std::nan(""));
    if (acc) gpu->download(start.data(), c.g);
    auto run_gpu = [&] {
      gpu->upload(c.g, start.data());  // NaN where the call overwrites
      gpu->matmul(c.g, a.g, b.g, false, true, acc);
      std::vector<double> v(start.size());
      gpu->download(v.data(), c.g);
      return v;
    };
    const std::vector<double> first = run_gpu();
    EXPECT_GT(cuda::matmul_heuristic_results(), 1) << "the shape should offer a choice to time";
    const std::vector<double> second = run_gpu();
    expect_same_bits(std::string("first and second call") + (acc ? " +=" : ""), first, second);
    cpu->matmul(c.c, a.c, b.c, false, true, acc);
    expect_close(std::string("timed matmul") + (acc ? " +=" : ""), c.g, c.c,
                 acc ? kTolF32Output : kTolBf16Output);
  }
}

// The timed choices as text (what the trainer keeps in a run directory) come back whole
// after every plan is forgotten, and then stand untimed; a text of another device or
// library, or not such a text, is refused with a reason and changes nothing.
TEST_F(MatmulParity, TimedChoicesComeBackAndStandUntimed) {
  const int64_t M = 1664, N = 1024, K = 576;  // a shape no other test plans
  Pair a = random_pair(DType::BF16, {M, K}), b = random_pair(DType::BF16, {N, K});
  Pair c = pair(DType::BF16, {M, N});
  gpu->matmul(c.g, a.g, b.g, false, true, false);
  const std::string text = gpu->timed_choices();
  ASSERT_NE(text.find("\n1664 1024 576 0 1 "), std::string::npos) << text;
  const std::vector<double> before = c.g.get();

  cuda::matmul_forget_plans();
  std::string why;
  const int lines = int(std::count(text.begin(), text.end(), '\n')) - 3;  // header, library, device
  EXPECT_EQ(gpu->use_timed_choices(text, &why), lines) << why;
  const int timed = cuda::matmul_timed_shapes();
  c.g.poison();
  gpu->matmul(c.g, a.g, b.g, false, true, false);
  EXPECT_EQ(cuda::matmul_timed_shapes(), timed) << "a given choice was timed again";
  expect_same_bits("the kept choice's product", c.g.get(), before);
  EXPECT_EQ(gpu->timed_choices(), text);

  std::string other = text;
  other.replace(other.find("device "), 7, "device another ");
  EXPECT_EQ(gpu->use_timed_choices(other, &why), -1);
  EXPECT_NE(why.find("device another"), std::string::npos) << why;
  EXPECT_EQ(gpu->use_timed_choices(text + "1 2 x\n", &why), -1);
  EXPECT_NE(why.find("is not a choice"), std::string::npos) << why;
  EXPECT_EQ(gpu->use_timed_choices("{}", &why), -1);
  EXPECT_NE(why.find("first line"), std::string::npos) << why;
  cuda::matmul_forget_plans();
}

TEST_F(MatmulParity, Fp32Inputs) {
  check(33, 65, 17, false, true, DType::F32, DType::F32, false);
  check(33, 65, 17, true, false, DType::F32, DType::F32, true);
}

}  // namespace
}  // namespace mhar::test
