// classifier_cudatest.cpp: CUDA fused softmax cross-entropy (losses and the in-place
// logit gradient) against the CPU reference, small, GPT-2-sized and Qwen3-sized
// vocabularies, bf16 and fp32 logits, for every kernel-lab version of the kernel
// (cuda::classifier_set_kernel_version; cuda/classifier.cu says what each does). Every
// version reads rows in 16-byte vectors after a scalar prologue up to the first 16-byte
// boundary, with a scalar tail: V = 1001, 50257, 151937 and 12 give rows at every
// misalignment (prologue, vectors and tail all in use), V a multiple of 8 rows that start
// aligned (vectors only), V = 7 and 3 rows shorter than one vector. The cluster versions
// (2-7) run once with the cluster size their plan picks and once with 8 blocks a row
// forced, so that small rows leave blocks with no vectors, and the prologue and the tail
// fall to different blocks of the cluster. Targets include the first and the last column.
// The bounds are the op's own (one bf16 or fp32 rounding of the output,
// tests/cuda_test_util.h): the versions merge the partial (max, sum) states in another
// order, orders of magnitude below them.
#include <gtest/gtest.h>

#include <cstdlib>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class CrossEntropyParity : public CudaParity {};

// A kernel-lab setting: the version and its forced cluster size (0: the plan's).
struct Setting {
  int version, cluster;
  std::string name() const {
    return "v" + std::to_string(version) + (cluster ? " c" + std::to_string(cluster) : "");
  }
};

std::vector<Setting> all_settings() {
  std::vector<Setting> s{{1, 0}};
  for (int v = 2; v <= cuda::classifier_kernel_versions(); ++v) {
    s.push_back({v, 0});
    s.push_back({v, 8});
  }
  return s;
}

// Restores the default version when a test ends, failed or not.
struct DefaultVersionAfter {
  ~DefaultVersionAfter() { cuda::classifier_set_kernel_version(0); }
};

bool has_cluster_launch() {
  int on = 0;
  return cudaDeviceGetAttribute(&on, cudaDevAttrClusterLaunch, 0) == cudaSuccess && on != 0;
}

TEST_F(CrossEntropyParity, LossesAndLogitGradient) {
  DefaultVersionAfter restore;
  const std::vector<Setting> settings = all_settings();
  const bool clusters = has_cluster_launch();
  const std::pair<int64_t, int64_t> shapes[] = {{13, 1001}, {4, 50257}, {1, 7},     {6, 12},
                                                {5, 3},     {9, 4096},  {3, 151936}, {3, 151937}};
  // Worst relative errors per setting, one summary line each at the end.
  std::vector<double> worst_loss(settings.size(), 0), worst_grad(settings.size(), 0);
  for (auto [N, V] : shapes) {
    for (DType dt : {DType::BF16, DType::F32}) {
      for (bool grad : {false, true}) {
        const std::string tag = "N" + std::to_string(N) + " V" + std::to_string(V) +
                                (dt == DType::F32 ? " f32" : "") + (grad ? " grad" : "");
        std::uniform_int_distribution<int32_t> pick(0, int32_t(V) - 1);
        std::vector<int32_t> ids(static_cast<size_t>(N));
        for (auto& t : ids) t = pick(rng);
        ids.back() = int32_t(V) - 1;  // the last column
        if (N > 1) ids.front() = 0;   // the first
        Pair targets = pair(DType::I32, {N});
        cpu->upload_tokens(targets.c, ids.data());
        gpu->upload_tokens(targets.g, ids.data());
        // Logits spread like a trained model's (std 3) so the softmax is far from uniform.
        Pair logits = random_pair(dt, {N, V}, 3.0);
        const std::vector<double> input = logits.c.get();
        Pair losses = pair(DType::F32, {N});
        const double scale = 1.0 / double(N);
        cpu->cross_entropy(losses.c, logits.c, targets.c, scale, grad);
        const std::vector<double> ref_losses = losses.c.get(), ref_grad = logits.c.get();
        for (size_t k = 0; k < settings.size(); ++k) {
          const Setting& st = settings[k];
          const std::string what = st.name() + " " + tag;
          cuda::classifier_set_kernel_version(st.version, st.cluster);
          logits.g.set(input);
          losses.g.poison();
          gpu->cross_entropy(losses.g, logits.g, targets.g, scale, grad);
          const std::string launch = cuda::classifier_last_launch();
          // Every bf16 shape here fits every version on a device with clusters (fp32 rows of
          // 151,936 do not fit version 4's registers: version 1 runs, as the plan says).
          if (clusters && dt == DType::BF16) {
            const std::string ran = launch.substr(0, launch.find(':'));
            const std::string want = "v" + std::to_string(st.version) + (st.version == 1 ? "" : " c");
            EXPECT_EQ(ran.rfind(want, 0), 0u) << what << ": " << launch;
          }
          const Comparison cl = compare(losses.g.get(), ref_losses);
          EXPECT_EQ(cl.bad, 0) << "losses " << what << " (" << launch << ")";
          EXPECT_LT(cl.rel_err, kTolF32Output) << "losses " << what << " (" << launch << ")";
          worst_loss[k] = std::max(worst_loss[k], cl.rel_err);
          // The gradient is stored in the logits' dtype: one rounding to bf16, or fp32.
          if (grad) {
            const double tol = dt == DType::F32 ? kTolF32Output : kTolBf16Output;
            const Comparison cg = compare(logits.g.get(), ref_grad);
            EXPECT_EQ(cg.bad, 0) << "dlogits " << what << " (" << launch << ")";
            EXPECT_LT(cg.rel_err, tol) << "dlogits " << what << " (" << launch << ")";
            worst_grad[k] = std::max(worst_grad[k], cg.rel_err / tol);
          }
        }
      }
    }
  }
  for (size_t k = 0; k < settings.size(); ++k)
    std::printf("PARITY cross_entropy %-6s worst losses rel_err %.3e (tol %.1e), worst dlogits "
                "rel_err / tol %.3f\n",
                settings[k].name().c_str(), worst_loss[k], kTolF32Output, worst_grad[k]);
}

// A target outside [0, V) traps in every version (the process's CUDA context is lost:
// each case runs in a child process, re-executed: "threadsafe" death tests). The child
// exits with 3 and the error's message where the call or the synchronisation reports the
// trap, 0 where nothing does.
class CrossEntropyTrap : public CudaParity {
 protected:
  void run_with_target(int version, int32_t bad) {
    cuda::classifier_set_kernel_version(version);
    const int64_t N = 4, V = 1001;
    const std::vector<int32_t> ids{0, 5, bad, 7};
    Buffer targets(*gpu, DType::I32, {N});
    gpu->upload_tokens(targets, ids.data());
    Buffer logits = random_gpu(DType::BF16, {N, V});
    Buffer losses(*gpu, DType::F32, {N});
    try {
      gpu->cross_entropy(losses, logits, targets, 1.0, true);
      gpu->synchronize();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::_Exit(0);
  }
};

TEST_F(CrossEntropyTrap, TargetOutsideTraps) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (int version = 1; version <= cuda::classifier_kernel_versions(); ++version) {
    const int32_t bad = version % 2 ? -1 : 1001;  // below 0 and at V, in turn
    EXPECT_EXIT(run_with_target(version, bad), ::testing::ExitedWithCode(3), "CUDA error")
        << "version " << version << ", target " << bad;
  }
}

}  // namespace
}  // namespace mhar::test
