// matmul.cu: C [M, N] = op(A) op(B) (beta = 1 when accumulating), row-major, through
// cuBLASLt with fp32 accumulation (CUBLAS_COMPUTE_32F, fp32 alpha/beta).
// - A and B share a dtype: BF16 (the hot path) or F32 (plain fp32, no TF32).
// - C is BF16 or F32: a weight gradient accumulates straight into its fp32 grad buffer.
//   F32 inputs need an F32 C.
// Row-major to cuBLAS's column-major: a row-major [r, c] matrix is a column-major [c, r]
// one, so we ask for C^T = op(B)^T op(A)^T, i.e. Lt's "A" is our B and its "B" our A.
// Algorithms are chosen once per (shape, transposes, dtypes, alignments) and cached; when
// Lt offers none (unusual alignments), cublasGemmEx computes the same product.
// The choice is timed: at a shape's first call, Lt's first choice and up to
// kTuneCandidates - 1 of its other heuristic results each run on the real A and B
// (fastest(), below), and the fastest is kept. Lt's first choice was up to 18% slower than
// its best at the 1B model's shapes (the weight and input gradients of the MLP
// projections and the LM head; 4.4-6.6% of the step's matmul time; BENCHMARKS.md,
// 2026-12-01, eighth session). Timed apart, the choice is 4.4% faster than the first
// choice over those products; in the step it gains 0-1.5%: the 1B step runs at the power
// limit (681 W of 700 at 1,635 MHz), so a kernel faster at a given clock is not faster
// when it spends the same power (BENCHMARKS.md, ninth session; timing the candidates in
// the step itself gained no more and was dropped).
// Candidates with an in-place split-K reduction (atomics in C) are left out, so every
// product is deterministic given its algorithm; but which algorithm wins can differ between
// processes when two are within timing noise. So the choices are kept: matmul_choices()
// writes every shape's pick as text, and matmul_use_choices() takes such a text, whose
// picks then stand untimed (the trainer keeps them in the run directory: a resumed run
// multiplies with its first process's algorithms, and so gives the same bits as a run that
// never stopped). The text names cuBLASLt's version and the device; one written elsewhere
// is refused (the heuristic's list, whose positions the picks are, may differ there).
// MHAR_MATMUL_TUNE=0 in the environment takes Lt's first choice instead, untimed.
// Kernel lab (matmul_set_heuristic_rank): a given candidate instead (0 = the first
// choice), for the timing test that compares them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace mhar::cuda {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F32: return CUDA_R_32F;
    default: fail("CUDA matmul: unsupported dtype ", dtype_name(t), " (BF16 or F32)");
  }
}

struct Key {
  int64_t m, n, k;
  bool ta, tb;
  DType ab, c;
  uint32_t align_a, align_b, align_c;  // Lt's algorithms may need aligned pointers
  int rank;                            // which heuristic result (kernel lab)
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, ta, tb, ab, c, align_a, align_b, align_c, rank) <
           std::tie(o.m, o.n, o.k, o.ta, o.tb, o.ab, o.c, o.align_a, o.align_b, o.align_c,
                    o.rank);
  }
};
struct Plan {
  bool use_lt = false;
  cublasLtMatmulAlgo_t algo{};
};

// Largest power of two (up to 256) dividing the address: views into an arena may start
// anywhere, and Lt's heuristic assumes 256-byte alignment unless told otherwise.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a) a >>= 1;
  return a;
}

std::mutex plan_mutex;
std::map<Key, Plan> plans;  // shapes repeat every step: one heuristic call per shape
int heuristic_rank = -1;    // guarded by plan_mutex; -1: the timed choice
int last_results = 0;
// The timed choice's pick (a position in the heuristic's list, below) of every shape planned
// at rank -1, and the picks given by matmul_use_choices, taken untimed; guarded by
// plan_mutex. timed_shapes: how many shapes were timed.
std::map<Key, int> chosen, given;
int timed_shapes = 0;
constexpr int kLabResults = 16;
constexpr int kTuneCandidates = 8;
constexpr int kTuneRounds = 3;
constexpr float kTuneSegmentMs = 2.f;  // a candidate's runs in a round last about this long

// MHAR_MATMUL_TUNE_LOG=1: one line on stderr per timed choice (the shape, every
// candidate's best time in microseconds, * on the one kept), to compare the choice with
// the step's own times (`mhar bench --profile` lists the products).
bool tuning_logged() {
  static const bool on = [] {
    const char* e = std::getenv("MHAR_MATMUL_TUNE_LOG");
    return e && std::string(e) == "1";
  }();
  return on;
}

bool tuning_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MHAR_MATMUL_TUNE");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

bool inplace_split_k(const cublasLtMatmulAlgo_t& algo) {
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                           sizeof scheme, &written) != CUBLAS_STATUS_SUCCESS)
    return false;
  return scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE;
}

struct LtObjects {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtObjects() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The index of the fastest of Lt's `found` results for one product: `run(algo, out)`
// enqueues it on `s` writing the C `out`. A product that overwrites C (`accumulate`
// false) is timed in C itself, which its real call then overwrites; one that adds into C
// is timed in the backend's scratch C (ctx.tune_scratch: part of the model's planned op
// scratch, kMatmulTuneScratchBytes): larger ones (the LM head's weight gradient, 0.78 GB
// at 1B) take result 0.
// The GPU is timed as training runs it: busy without a break, at the clocks its power
// limit allows. Each round runs every candidate back to back for about kTuneSegmentMs
// (events between them, one synchronisation per round), and a candidate's best round
// counts. (The first version timed each candidate alone, a few runs and a
// synchronisation; its choices for the 1B forward products measured slower than Lt's
// first choice in steady state; with this timing, measured interleaved with the
// others in the lab test, the 1B step's timed choices sum to 166.44 ms against 164.88 for
// the best per product and 174.07 for the first choice; ninth session.)
template <class Run>
int fastest(cudaStream_t s, MatmulContext& ctx, void* c, size_t c_bytes, bool accumulate,
            int found, const cublasLtMatmulHeuristicResult_t* results, Run&& run,
            std::string* log) {
  void* out = accumulate ? ctx.tune_scratch(c_bytes) : c;
  if (!out) return 0;
  std::vector<int> candidates;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS ||
        results[i].workspaceSize > ctx.workspace_bytes || (i > 0 && inplace_split_k(results[i].algo)))
      continue;
    if (run(results[i].algo, out) == CUBLAS_STATUS_SUCCESS) candidates.push_back(i);  // warm-up
  }
  const size_t n = candidates.size();
  std::vector<cudaEvent_t> marks(n + 1);
  for (cudaEvent_t& e : marks) CUDA_CHECK(cudaEventCreate(&e));
  // Runs per segment, from one timed run of each candidate.
  std::vector<int> reps(n, 1);
  std::vector<float> best_ms(n, 0.f);
  auto time_round = [&](std::vector<float>& ms) {
    CUDA_CHECK(cudaEventRecord(marks[0], s));
    for (size_t k = 0; k < n; ++k) {
      for (int r = 0; r < reps[k]; ++r) run(results[candidates[k]].algo, out);
      CUDA_CHECK(cudaEventRecord(marks[k + 1], s));
    }
    CUDA_CHECK(cudaEventSynchronize(marks[n]));
    for (size_t k = 0; k < n; ++k) {
      CUDA_CHECK(cudaEventElapsedTime(&ms[k], marks[k], marks[k + 1]));
      ms[k] /= float(reps[k]);
    }
  };
  std::vector<float> ms(n, 0.f);
  time_round(ms);
  for (size_t k = 0; k < n; ++k)
    reps[k] = std::max(1, std::min(64, int(std::ceil(kTuneSegmentMs / std::max(ms[k], 1e-3f)))));
  for (int round = 0; round < kTuneRounds; ++round) {
    time_round(ms);
    for (size_t k = 0; k < n; ++k)
      if (round == 0 || ms[k] < best_ms[k]) best_ms[k] = ms[k];
  }
  for (cudaEvent_t e : marks) cudaEventDestroy(e);
  size_t best = 0;
  for (size_t k = 1; k < n; ++k)
    if (best_ms[k] < best_ms[best]) best = k;
  if (log)
    for (size_t k = 0; k < n; ++k)
      *log += " " + std::to_string(candidates[k]) + ":" + std::to_string(best_ms[k] * 1000.f).substr(0, 7) +
              (k == best ? "*" : "");
  return n == 0 ? 0 : candidates[best];
}

}  // namespace

void matmul(cudaStream_t s, MatmulContext& ctx, Tensor c, Tensor a, Tensor b, bool trans_a,
            bool trans_b, bool accumulate) {
  MHAR_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "matmul wants 2-D tensors, got ",
             a.shape_str(), " ", b.shape_str(), " ", c.shape_str());
  MHAR_CHECK(a.dtype == b.dtype, "matmul: A is ", dtype_name(a.dtype), ", B is ",
             dtype_name(b.dtype));
  const int64_t M = trans_a ? a.dim(1) : a.dim(0);
  const int64_t K = trans_a ? a.dim(0) : a.dim(1);
  const int64_t Kb = trans_b ? b.dim(1) : b.dim(0);
  const int64_t N = trans_b ? b.dim(0) : b.dim(1);
  MHAR_CHECK(K == Kb && c.dim(0) == M && c.dim(1) == N, "matmul shapes: C ", c.shape_str(),
             " = op(A ", a.shape_str(), (trans_a ? "^T" : ""), ") op(B ", b.shape_str(),
             (trans_b ? "^T" : ""), ")");
  if (a.dtype == DType::F32 && c.dtype != DType::F32)
    fail("CUDA matmul: F32 inputs need an F32 output, got ", dtype_name(c.dtype));
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) CUDA_CHECK(cudaMemsetAsync(c.data, 0, c.bytes(), s));
    return;
  }
  const cudaDataType_t ab_type = cuda_type(a.dtype), c_type = cuda_type(c.dtype);
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;

  // Column-major view: C^T [N, M] = opL(B^T-storage) [N, K] x opR(A^T-storage) [K, M].
  const cublasOperation_t op_l = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_r = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t ld_b = b.dim(1), ld_a = a.dim(1), ld_c = N;

  LtObjects lt;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&lt.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_l,
                                              sizeof op_l));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(lt.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_r,
                                              sizeof op_r));
  // Stored (column-major) shapes: B storage is [b.dim(1), b.dim(0)], A storage [a.dim(1), a.dim(0)].
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.a, ab_type, b.dim(1), b.dim(0), ld_b));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.b, ab_type, a.dim(1), a.dim(0), ld_a));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lt.c, c_type, N, M, ld_c));

  // One product with Lt's algorithm `algo`, written to the C `out` (the timing runs
  // candidates into another C than c's: fastest()).
  auto run_lt = [&](const cublasLtMatmulAlgo_t& algo, void* out) {
    return cublasLtMatmul(ctx.lt, lt.op, &alpha, b.data, lt.a, a.data, lt.b, &beta, out, lt.c,
                          out, lt.c, &algo, ctx.workspace, ctx.workspace_bytes, s);
  };
  Plan plan;
  {
    std::lock_guard<std::mutex> lock(plan_mutex);
    const Key key{M,       N,       K, trans_a, trans_b, a.dtype, c.dtype, alignment(a.data),
                  alignment(b.data), alignment(c.data), heuristic_rank};
    auto it = plans.find(key);
    if (it != plans.end()) {
      plan = it->second;
    } else {
      cublasLtMatmulPreference_t pref = nullptr;
      CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx.workspace_bytes,
          sizeof ctx.workspace_bytes));
      // Lt's "A" is our B, its "B" our A.
      const uint32_t al_a = key.align_b, al_b = key.align_a, al_c = key.align_c;
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));
      // Result 0: Lt's first choice, from a request for one result, so that the untimed
      // choice is always a candidate; then the others of a request for more (without a
      // copy of result 0).
      cublasLtMatmulHeuristicResult_t results[kLabResults + 1]{};
      int found = 0;
      const auto given_pick = key.rank < 0 ? given.find(key) : given.end();
      const bool tune =
          key.rank < 0 && given_pick == given.end() && tuning_enabled() && ctx.tune_scratch;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.lt, lt.op, lt.a, lt.b, lt.c, lt.c,
                                                         pref, 1, results, &found);
      if (st == CUBLAS_STATUS_SUCCESS && found > 0 &&
          (key.rank > 0 || tune || (given_pick != given.end() && given_pick->second > 0))) {
        cublasLtMatmulHeuristicResult_t more[kLabResults]{};
        int n_more = 0;
        if (cublasLtMatmulAlgoGetHeuristic(ctx.lt, lt.op, lt.a, lt.b, lt.c, lt.c, pref,
                                           kLabResults, more, &n_more) == CUBLAS_STATUS_SUCCESS)
          for (int i = 0; i < n_more; ++i)
            if (std::memcmp(&more[i].algo, &results[0].algo, sizeof(cublasLtMatmulAlgo_t)) != 0)
              results[found++] = more[i];
      }
      cublasLtMatmulPreferenceDestroy(pref);
      last_results = st == CUBLAS_STATUS_SUCCESS ? found : 0;
      if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
        plan.use_lt = true;
        if (key.rank >= 0) {
          plan.algo = results[std::min(key.rank, found - 1)].algo;
        } else {
          int pick = 0;
          if (given_pick != given.end()) {
            // The list is the heuristic's for the same shape, library and device (checked
            // when the picks were given), so the position names the same algorithm. Should
            // the list be shorter all the same, Lt's first choice (never a crash for this).
            if (given_pick->second < found)
              pick = given_pick->second;
            else
              std::fprintf(stderr,
                           "matmul: a kept choice (position %d) but cuBLASLt lists %d algorithms "
                           "for C[%lld,%lld]: its first taken; bits may differ from the run's\n",
                           given_pick->second, found, static_cast<long long>(M),
                           static_cast<long long>(N));
          } else if (tune && found > 1) {
            ++timed_shapes;
            std::string log;
            pick = fastest(s, ctx, c.data, c.bytes(), accumulate, std::min(found, kTuneCandidates),
                           results, run_lt, tuning_logged() ? &log : nullptr);
            if (tuning_logged())
              std::fprintf(stderr, "matmul tune C[%lld,%lld] %s op(A)[%lld,%lld]%s op(B)%s us:%s\n",
                           static_cast<long long>(M), static_cast<long long>(N),
                           accumulate ? "+=" : "=", static_cast<long long>(M),
                           static_cast<long long>(K), trans_a ? "^T" : "", trans_b ? "^T" : "",
                           log.c_str());
          }
          plan.algo = results[pick].algo;
          chosen[key] = pick;
        }
      }
      plans[key] = plan;
    }
  }

  if (plan.use_lt) {
    CUBLAS_CHECK(run_lt(plan.algo, c.data));
  } else {
    CUBLAS_CHECK(cublasSetStream(ctx.blas, s));
    CUBLAS_CHECK(cublasGemmEx(ctx.blas, op_l, op_r, int(N), int(M), int(K), &alpha, b.data,
                              ab_type, int(ld_b), a.data, ab_type, int(ld_a), &beta, c.data,
                              c_type, int(ld_c), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

int matmul_set_heuristic_rank(int rank) {
  MHAR_CHECK(rank >= -1 && rank < kLabResults, "matmul_set_heuristic_rank: rank ", rank,
             " (-1 to ", kLabResults - 1, ")");
  std::lock_guard<std::mutex> lock(plan_mutex);
  const int before = heuristic_rank;
  heuristic_rank = rank;
  return before;
}

int matmul_heuristic_results() {
  std::lock_guard<std::mutex> lock(plan_mutex);
  return last_results;
}

namespace {
constexpr const char* kChoicesHeader = "mhar matmul choices 1";

// What the picks depend on besides the shape: cuBLASLt's version and the device. Remembered
// per device: the trainer asks for the choices after every step, and
// cudaGetDeviceProperties is slow.
std::string choices_context() {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mutex;
  static std::map<int, std::string> known;
  std::lock_guard<std::mutex> lock(mutex);
  std::string& context = known[dev];
  if (context.empty()) {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    std::ostringstream os;
    os << "cublasLt " << cublasLtGetVersion() << "\ndevice " << prop.name << " sm_"
       << prop.major << prop.minor << " " << prop.multiProcessorCount << " SMs";
    context = os.str();
  }
  return context;
}
}  // namespace

std::string matmul_choices() {
  std::lock_guard<std::mutex> lock(plan_mutex);
  // The given picks too, planned yet or not: a process that took a run's choices hands on
  // all of them (the same pick where it planned the shape).
  std::map<Key, int> all = given;
  for (const auto& [k, pick] : chosen) all[k] = pick;
  if (all.empty()) return {};
  std::ostringstream os;
  os << kChoicesHeader << "\n" << choices_context() << "\n";
  for (const auto& [k, pick] : all)
    os << k.m << " " << k.n << " " << k.k << " " << k.ta << " " << k.tb << " " << int(k.ab) << " "
       << int(k.c) << " " << k.align_a << " " << k.align_b << " " << k.align_c << " " << pick
       << "\n";
  return os.str();
}

int matmul_use_choices(const std::string& text, std::string* why_not) {
  std::istringstream in(text);
  std::string line, library, device;
  std::getline(in, line);
  if (line != kChoicesHeader) {
    *why_not = "not a list of matmul choices (its first line is not \"" +
               std::string(kChoicesHeader) + "\")";
    return -1;
  }
  std::getline(in, library);
  std::getline(in, device);
  const std::string here = choices_context();
  if (library + "\n" + device != here) {
    *why_not = "made with " + library + " on " + device + ", this process has " + here;
    for (char& ch : *why_not)
      if (ch == '\n') ch = ',';
    return -1;
  }
  std::map<Key, int> picks;
  for (int n = 4; std::getline(in, line); ++n) {
    std::istringstream ls(line);
    Key k{};
    int ab = 0, c = 0, pick = -1;
    std::string rest;
    if (!(ls >> k.m >> k.n >> k.k >> k.ta >> k.tb >> ab >> c >> k.align_a >> k.align_b >>
          k.align_c >> pick) ||
        (ls >> rest) || pick < 0 || pick >= kLabResults || k.m <= 0 || k.n <= 0 || k.k <= 0 ||
        ab < 0 || ab > int(DType::I32) || c < 0 || c > int(DType::I32)) {
      *why_not = "line " + std::to_string(n) + " is not a choice: \"" + line + "\"";
      return -1;
    }
    k.ab = DType(ab);
    k.c = DType(c);
    k.rank = -1;
    picks[k] = pick;
  }
  std::lock_guard<std::mutex> lock(plan_mutex);
  given = std::move(picks);
  return int(given.size());
}

int matmul_timed_shapes() {
  std::lock_guard<std::mutex> lock(plan_mutex);
  return timed_shapes;
}

void matmul_forget_plans() {
  std::lock_guard<std::mutex> lock(plan_mutex);
  plans.clear();
  chosen.clear();
  given.clear();
}

}  // namespace mhar::cuda
