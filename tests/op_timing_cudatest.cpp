// op_timing_cudatest.cpp: wall-clock timings of the CUDA ops at model-sized shapes (not a
// parity test; DISABLED_ so plain test runs skip it; tools/gpu_check.sh runs it with
// --gtest_also_run_disabled_tests). Each op: 2 warm-up calls, then the mean of `reps`
// calls between two stream synchronisations, with the FLOP or byte count it implies.
// Inputs are random (never zeros: zeros can run faster than real data).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <random>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

// The full-routing shapes of the paper configs (configs/{100m,350m,1b}_mhar.json): model
// width, routing sites (2 L + 1) and heads.
struct FullRoutingShape {
  const char* name;
  int64_t d;
  int S, H;
};
constexpr FullRoutingShape kFullRoutingShapes[] = {
    {"100M", 512, 25, 4}, {"350M", 1024, 49, 8}, {"1B", 1280, 73, 8}};
// Those and 1B block routing (configs/1b_block_mhar.json: blocks of 9 sublayers), as
// RoutingLayout::blocks(S, block) takes them.
struct RoutingShape {
  const char* name;
  int64_t d;
  int S, H, block;
};
constexpr RoutingShape kRoutingShapes[] = {{"100M", 512, 25, 4, 1},
                                           {"350M", 1024, 49, 8, 1},
                                           {"1B", 1280, 73, 8, 1},
                                           {"1B block9", 1280, 73, 8, 9}};

// The block configs (configs/{100m,350m,1b}_block_mhar.json): blocks of 3, 6 and 9
// sublayers, every site mixed on its own (block layouts never tile).
constexpr RoutingShape kBlockRoutingShapes[] = {
    {"100M block3", 512, 25, 4, 3}, {"350M block6", 1024, 49, 8, 6}, {"1B block9", 1280, 73, 8, 9}};

class OpTiming : public CudaParity {
 protected:
  double time_ms(const std::function<void()>& op, int reps = 10) {
    op();
    op();
    gpu->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) op();
    gpu->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(t1 - t0).count() / reps;
  }
  // Random queries and gains of S sites [d] (bf16) and their fp32 gradients, kept alive
  // in `keep` (a Buffer keeps its device memory when the vector moves it).
  RoutingParams random_routing_params(int S, int64_t d, std::vector<Buffer>& keep) {
    RoutingParams rp;
    for (int k = 0; k < S; ++k) {
      keep.push_back(random_gpu(DType::BF16, {d}, 0.05));
      rp.query.push_back(keep.back());
      keep.push_back(random_gpu(DType::BF16, {d}, 1.0));
      rp.gain.push_back(keep.back());
      keep.emplace_back(*gpu, DType::F32, std::initializer_list<int64_t>{d});
      rp.dquery.push_back(keep.back());
      keep.emplace_back(*gpu, DType::F32, std::initializer_list<int64_t>{d});
      rp.dgain.push_back(keep.back());
    }
    return rp;
  }
  // A linear layer's product as the model runs it: y [rows, out] = x [rows, in] W^T (W
  // [out, in]), y doubling as the output gradient, dx and the fp32 weight gradient dw.
  struct Operands {
    Buffer x, w, y, dx, dw;
  };
  Operands operands(int64_t rows, int64_t in, int64_t out) {
    return Operands{random_gpu(DType::BF16, {rows, in}), random_gpu(DType::BF16, {out, in}, 0.02),
                   random_gpu(DType::BF16, {rows, out}), Buffer(*gpu, DType::BF16, {rows, in}),
                   Buffer(*gpu, DType::F32, {out, in})};
  }
  // A whole step's routing state at one shape, as the routing backward timings start from:
  // a random [S, N, d] history (filled on the host: slow at these sizes), the site
  // gradients a device copy of it, real logits, inv_rms and normalised weights from the
  // ops (the site inputs xs from the mixes), and `mixed`, a copy of those weights (the
  // backward overwrites them with ds r).
  struct RoutingStep {
    Buffer hist, site_dx, xs, inv_rms, weights, ubar, gsum, dv, mixed;
    std::vector<Buffer> keep;
    RoutingParams rp;
    std::vector<Tensor> dx_rows;
  };
  RoutingStep routing_step(const RoutingLayout& lay, int64_t N, int64_t d, int H) {
    const int S = lay.sites;
    RoutingStep st{random_gpu(DType::BF16, {S, N, d}),
                   Buffer(*gpu, DType::BF16, {S, N, d}),
                   Buffer(*gpu, DType::BF16, {S, N, d}),
                   Buffer(*gpu, DType::F32, {S, N}),
                   Buffer(*gpu, DType::F32, {lay.pairs(), H, N}),
                   Buffer(*gpu, DType::F32, {S, H, N}),
                   Buffer(*gpu, DType::F32, {64, S, d}),
                   Buffer(*gpu, DType::BF16, {N, d}),
                   Buffer(*gpu, DType::F32, {lay.pairs(), H, N}),
                   {}, {}, {}};
    gpu->copy(st.site_dx, st.hist);
    st.dx_rows = routing_rows(st.site_dx.t());
    st.rp = random_routing_params(S, d, st.keep);
    for (int i = 0; i < S; ++i)
      gpu->routing_source_logits(st.weights, st.inv_rms.t()[i], st.hist.t()[i], st.rp, lay, i,
                                 H, 1e-6);
    for (int i = 0; i < S; ++i) gpu->routing_mix(st.xs.t()[i], st.weights, st.hist, lay, i, H);
    gpu->copy(st.mixed, st.weights);
    return st;
  }
  // One routing shape's mixes as the mix labs time them: random history and logits (the
  // work does not depend on their values; the mixes normalise the logits in place, which
  // keeps them finite for the next repetition), the sites' outputs xs and their consumers'
  // norms (ys, rstds, one weight row), a row's bytes and one fp32 per head and token, and
  // the shape's name for the report lines.
  struct MixStep {
    RoutingLayout lay;
    int64_t d, P;
    int S, H;
    Buffer hist, weights, xs, ys, rstds, norm_w;
    double row, stat;
    std::string tag;
  };
  MixStep mix_step(const char* name, int64_t d, int S, int H, int block, int64_t N) {
    const RoutingLayout lay = RoutingLayout::blocks(S, block);
    return MixStep{lay,
                   d,
                   lay.pairs(),
                   S,
                   H,
                   random_gpu(DType::BF16, {lay.sources, N, d}),
                   random_gpu(DType::F32, {lay.pairs(), H, N}, 3.0),
                   Buffer(*gpu, DType::BF16, {S, N, d}),
                   Buffer(*gpu, DType::BF16, {S, N, d}),
                   Buffer(*gpu, DType::F32, {S, N}),
                   random_gpu(DType::BF16, {d}),
                   2.0 * N * d,
                   4.0 * H * N,
                   std::string(name) + " d" + std::to_string(d) + " S" + std::to_string(S) + " H" +
                       std::to_string(H)};
  }
  MixStep mix_step(const FullRoutingShape& sh, int64_t N) {
    return mix_step(sh.name, sh.d, sh.S, sh.H, 1, N);
  }
  void routing_backward_sweeps(bool limits, bool versions, bool pairs = false);
  static void report(const std::string& what, double ms, double flop, double bytes) {
    std::printf("TIMING %-58s %9.3f ms", what.c_str(), ms);
    if (flop > 0) std::printf("  %7.1f TFLOP/s", flop / ms * 1e-9);
    if (bytes > 0) std::printf("  %7.1f GB/s", bytes / ms * 1e-6);
    std::printf("\n");
  }
};

// The depth-tiled mixes as the layer loop runs them (a tile kernel at each tile's first
// site, the finish kernels between).
// The consumers' norms of the mixes (routing_mix_rmsnorm): outputs ys [S, N, d] and
// rstds [S, N], one weight row.
struct MixNorms {
  Buffer &ys, &rstds, &w;
  double eps;
};

// With `norms`, as the routed scheme calls them: a tile's first site by
// routing_mix_tile_rmsnorm, the others by routing_mix_rmsnorm.
// `plan`: the tiles' counts in site order (Backend::routing_tile_plan; a count of 1 is a
// plain mix, which tiles_only leaves out with the finishes).
void tiled_mixes(Backend& gpu, Buffer& xs, Buffer& weights, Buffer& hist, const RoutingLayout& lay,
                 const std::vector<int>& plan, int H, bool tiles_only,
                 const MixNorms* norms = nullptr) {
  int start = 0;
  for (int count : plan) {
    for (int i = start; i < start + count; ++i)
      if (i == start && count > 1 && norms) {
        gpu.routing_mix_tile_rmsnorm(xs.t()[i], norms->ys.t()[i], norms->rstds.t()[i], weights,
                                     hist, lay, i, count, H, norms->w, norms->eps);
      } else if (i == start && count > 1) {
        gpu.routing_mix_tile(xs.t()[i], weights, hist, lay, i, count, H);
      } else if (tiles_only) {
        continue;
      } else if (norms) {
        gpu.routing_mix_rmsnorm(xs.t()[i], norms->ys.t()[i], norms->rstds.t()[i], weights, hist,
                                lay, i, H, norms->w, norms->eps);
      } else {
        gpu.routing_mix(xs.t()[i], weights, hist, lay, i, H);
      }
    start += count;
  }
}

std::string plan_str(const std::vector<int>& plan) {
  std::string out;
  for (int count : plan) out += (out.empty() ? "" : ",") + std::to_string(count);
  return out;
}

// The rows of N d bf16 a step's tiled mixes must move without their consumers' norms
// (cuda::routing_plan_rows counts those too): per tile of kk sites from j0, the tile
// kernel's j0 + 1 slots, x and kk - 1 fp32 partial rows, then each later site's partial,
// newer slots and x (backend.h; cuda/routing_mix.cu); a plain site (kk = 1) its slots and x.
double mix_rows(const std::vector<int>& plan) {
  double rows = 0;
  int j0 = 0;
  for (const int kk : plan) {
    rows += (j0 + 1) + 1 + 2.0 * (kk - 1);
    for (int m = 1; m < kk; ++m) rows += 2 + m + 1;
    j0 += kk;
  }
  return rows;
}

TEST_F(OpTiming, DISABLED_ModelShapes) {
  const int64_t N = 16384, d = 2048, ff = 6144;  // 8 x 2048 tokens of a ~1B-wide model
  {
    Buffer x = random_gpu(DType::BF16, {N, d}), w = random_gpu(DType::BF16, {ff, d}, 0.02);
    Buffer y(*gpu, DType::BF16, {N, ff});
    Buffer dw(*gpu, DType::F32, {ff, d});
    const double flop = 2.0 * N * d * ff;
    report("matmul y = x W^T  [16384x2048]x[6144x2048]^T bf16",
           time_ms([&] { gpu->matmul(y, x, w, false, true, false); }), flop, 0);
    report("matmul dW += dy^T x  fp32 accumulate",
           time_ms([&] { gpu->matmul(dw, y, x, true, false, true); }), flop, 0);
  }
  {
    Buffer x = random_gpu(DType::BF16, {N, d}), w = random_gpu(DType::BF16, {d});
    Buffer y(*gpu, DType::BF16, {N, d}), rstd(*gpu, DType::F32, {N});
    report("rmsnorm_forward [16384, 2048]",
           time_ms([&] { gpu->rmsnorm_forward(y, rstd, x, w, 1e-6); }), 0, 2.0 * N * d * 2);
    Buffer dx(*gpu, DType::BF16, {N, d}), dw(*gpu, DType::F32, {d});
    report("rmsnorm_backward [16384, 2048]",
           time_ms([&] { gpu->rmsnorm_backward(dx, dw, y, x, w, rstd, false); }), 0,
           2.0 * N * d * 3);
  }
  for (auto [B, T, Hq, Hkv, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{
                                       8, 2048, 16, 8, 128},
                                   {8, 2048, 16, 16, 64}}) {
    const AttentionTensors a = attention_tensors(B, T, Hq, Hkv, hd);
    const std::string tag = "B" + std::to_string(B) + " T" + std::to_string(T) + " Hq" +
                            std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " hd" +
                            std::to_string(hd);
    const double fwd_flop = 4.0 * B * Hq * hd * double(T) * T / 2;  // causal: half the pairs
    report("attention_forward " + tag,
           time_ms([&] { gpu->attention_forward(a.out, a.lse, a.q, a.k, a.v); }, 3), fwd_flop, 0);
    report("attention_backward " + tag, time_ms([&] {
             gpu->attention_backward(a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse);
           }, 3),
           2.5 * fwd_flop, 0);
  }
  // Depth routing of a whole step at the 350M and 1B shapes (N = 16384 tokens), full
  // routing and the 1B block config (8 blocks of 9): every source's logits and every
  // site's mix (forward), every source's backward and the query/gain gradients
  // (backward). Bytes counted are those each op must move, whatever its kernels do
  // (rows of N x d bf16 and the fp32 per-pair statistics [P, H, N], P the (source, site)
  // pairs, S(S+1)/2 for full routing): logits read each source once and write every
  // pair's logit; the mix reads its sources' rows and logits and writes x and the
  // weights; the backward reads every pair's site gradient row and weight, v, x, writes
  // dv and the pair's logit gradient. Temporaries of an implementation (the backward's
  // fp32 value and key rows) are not counted: the rate is against what the op must do.
  for (const RoutingShape& sh : kRoutingShapes) {
    const RoutingLayout lay = RoutingLayout::blocks(sh.S, sh.block);
    const int64_t d = sh.d, P = lay.pairs();
    const int S = sh.S, H = sh.H;
    Buffer hist = random_gpu(DType::BF16, {S, N, d});
    Buffer site_dx = random_gpu(DType::BF16, {S, N, d});
    const std::vector<Tensor> dx_rows = routing_rows(site_dx.t());
    Buffer xs(*gpu, DType::BF16, {S, N, d}), inv_rms(*gpu, DType::F32, {S, N});
    Buffer weights(*gpu, DType::F32, {P, H, N}), ubar(*gpu, DType::F32, {S, H, N});
    Buffer gsum(*gpu, DType::F32, {64, S, d}), dv(*gpu, DType::BF16, {N, d});
    std::vector<Buffer> params;
    const RoutingParams rp = random_routing_params(S, d, params);
    const double row = 2.0 * N * d, stats = 4.0 * double(P) * H * N;
    const std::string tag = std::string(sh.name) + " N16384 d" + std::to_string(d) + " S" +
                            std::to_string(S) + " H" + std::to_string(H);
    auto logits = [&] {
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(weights, inv_rms.t()[i], hist.t()[i], rp, lay, i, H, 1e-6);
    };
    auto mixes = [&] {
      for (int i = 0; i < S; ++i) gpu->routing_mix(xs.t()[i], weights, hist, lay, i, H);
    };
    report("routing_source_logits, all sources " + tag, time_ms(logits, 2), 0, row * S + stats);
    // The mix normalises the logits in place, so every timed repetition needs fresh
    // logits: time both and subtract the logits alone.
    report("routing_mix, all sites " + tag, time_ms([&] { logits(); mixes(); }, 2) -
               time_ms(logits, 2), 0, row * (double(P) + S) + 2 * stats);
    // The backend's depth tiles (routing_mix_tile) as the layer loop runs them (bytes:
    // mix_rows).
    if (const std::vector<int> plan = gpu->routing_tile_plan(lay, d, H);
        *std::max_element(plan.begin(), plan.end()) > 1) {
      report("routing_mix, all sites, depth tiles " + plan_str(plan) + " " + tag,
             time_ms(
                 [&] {
                   logits();
                   tiled_mixes(*gpu, xs, weights, hist, lay, plan, H, false);
                 },
                 2) -
                 time_ms(logits, 2),
             0, row * mix_rows(plan) + 2 * stats);
    }
    logits();
    mixes();
    auto backward = [&] {
      gpu->zero(gsum);
      for (int i = S - 1; i >= 0; --i)
        gpu->routing_source_backward(dv, weights, ubar, gsum, dx_rows, xs.t()[i], hist.t()[i],
                                     inv_rms.t()[i], rp, lay, i, H);
      gpu->routing_param_grads(rp, gsum);
    };
    report("routing backward (source_backward + param_grads), whole step " + tag,
           time_ms(backward, 2), 0, row * (double(P) + 3.0 * S) + 2 * stats);
    report("routing_mix last site " + tag,
           time_ms([&] { gpu->routing_mix(xs.t()[S - 1], weights, hist, lay, S - 1, H); }), 0,
           row * (lay.site_sources(S - 1) + 1));
    report("routing_source_backward source 0 " + tag,
           time_ms([&] {
             gpu->routing_source_backward(dv, weights, ubar, gsum, dx_rows, xs.t()[0],
                                          hist.t()[0], inv_rms.t()[0], rp, lay, 0, H);
           }),
           0, row * (lay.last_site(0) + 1 + 4.0));
  }
  {
    const int64_t rows = 2048, V = 151936;
    Buffer logits = random_gpu(DType::BF16, {rows, V}, 3.0);
    Buffer targets(*gpu, DType::I32, {rows});
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919) % V);
    gpu->upload_tokens(targets, ids.data());
    Buffer losses(*gpu, DType::F32, {rows});
    report("cross_entropy losses only [2048, 151936]",
           time_ms([&] { gpu->cross_entropy(losses, logits, targets, 1.0, false); }), 0,
           2.0 * rows * V);
    // With the gradient the logits are overwritten: each call sees the previous gradient,
    // which is still a valid (small-valued) row of logits.
    report("cross_entropy with gradient [2048, 151936]",
           time_ms([&] { gpu->cross_entropy(losses, logits, targets, 1.0, true); }), 0,
           3 * 2.0 * rows * V);
  }
  {
    const int64_t n = N * ff;
    Buffer gu = random_gpu(DType::BF16, {N, 2 * ff});
    Buffer h(*gpu, DType::BF16, {N, ff});
    report("swiglu_forward [16384 x 6144]", time_ms([&] { gpu->swiglu_forward(h, gu); }), 0,
           3 * 2.0 * n);
  }
}

// Is cuBLASLt's first heuristic choice the fastest for the 1B step's products, and does
// the matmul's timed choice (matmul.cu) find the best? Each product as the model runs it
// (forward, input gradient, weight gradient into fp32), timed with the heuristic's
// results 0..7 (cuda::matmul_set_heuristic_rank; 0 is Lt's first choice) and with the
// timed choice (rank -1, the engine's default), and the step's matmul time at each (36
// layers; 3 LM-head chunks of 5,504 tokens). Not a parity test: the ranks compute the
// same products with other tilings (other rounding of the fp32 sums).
// The embedding backward (cuda/embedding.cu: token ids sorted, each id's rows added in
// token order) at the configs' micro-batch of 16,384 tokens and Qwen3's 151,936 ids, the
// 100M and 1B widths, on ids drawn by Zipf's law (P(rank r) ~ 1/r, as words in text: the
// most frequent id ~8% of the tokens, a run of ~1,300 rows, the longest serial sum any
// column does). Bytes: the gradient rows read and each distinct id's fp32 row read and
// written; the sort's passes are not counted. A step at 100M runs ~35 ms a micro-batch.
TEST_F(OpTiming, DISABLED_EmbeddingBackward) {
  const int64_t N = 16384, V = 151936;
  std::vector<double> cdf(static_cast<size_t>(V));
  double total = 0;
  for (int64_t r = 0; r < V; ++r) cdf[size_t(r)] = (total += 1.0 / double(r + 1));
  std::uniform_real_distribution<double> u(0.0, total);
  std::vector<int32_t> ids(static_cast<size_t>(N));
  for (auto& t : ids) t = int32_t(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
  std::vector<int32_t> distinct = ids;
  std::sort(distinct.begin(), distinct.end());
  const int64_t U = std::unique(distinct.begin(), distinct.end()) - distinct.begin();
  Buffer tokens(*gpu, DType::I32, {N});
  gpu->upload_tokens(tokens, ids.data());
  for (int64_t d : {int64_t(512), int64_t(1280)}) {
    Buffer dout = random_gpu(DType::BF16, {N, d});
    Buffer dtable(*gpu, DType::F32, {V, d});
    // Newest version first: ncu with a count of 8 over 'iota|Radix|embedding_backward'
    // (tools/gpu_check.sh, NCU_FILTER this test) profiles its sort and runs kernels.
    for (int v = cuda::embedding_backward_versions(); v >= 1; --v) {
      cuda::embedding_backward_set_version(v);
      report("embedding_backward v" + std::to_string(v) + " N16384 V151936 d" + std::to_string(d) +
                 " (" + std::to_string(U) + " distinct ids)",
             time_ms([&] { gpu->embedding_backward(dtable, dout, tokens); }, 20), 0,
             2.0 * N * d + 8.0 * U * d);
    }
    cuda::embedding_backward_set_version(0);
  }
}

TEST_F(OpTiming, DISABLED_MatmulHeuristicRanks1B) {
  const int64_t N = 16384, d = 1280;
  struct Product {
    const char* name;
    int64_t rows, in, out;
    int per_step;
  };
  double first_total = 0, best_total = 0, timed_total = 0;
  for (const Product& pr : {Product{"q_proj", N, d, 2048, 36}, Product{"k_proj", N, d, 1024, 72},
                            Product{"o_proj", N, 2048, d, 36},
                            Product{"gate_up_proj", N, d, 10240, 36},
                            Product{"down_proj", N, 5120, d, 36},
                            Product{"lm_head chunk", 5504, d, 151936, 3}}) {
    Operands bufs = operands(pr.rows, pr.in, pr.out);
    Buffer &x = bufs.x, &w = bufs.w, &y = bufs.y, &dx = bufs.dx, &dw = bufs.dw;
    const double flop = 2.0 * pr.rows * pr.in * pr.out;
    const std::function<void()> ops[3] = {[&] { gpu->matmul_forward(y, x, w); },
                                          [&] { gpu->matmul_input_grad(dx, y, w, false); },
                                          [&] { gpu->matmul_weight_grad(dw, y, x); }};
    const char* kinds[3] = {"forward", "input grad", "weight grad"};
    for (int o = 0; o < 3; ++o) {
      // Every choice planned first (ranks 0-7, then -1: the timed choice), then timed
      // interleaved, each its best of kRounds rounds: the GPU's drift under sustained
      // load touches every choice alike (timed one after the other, the last measured,
      // the timed choice, read ~5% slow: eighth session).
      std::vector<int> ranks;
      int results = 0;
      for (int rank = 0; rank < 8; ++rank) {
        cuda::matmul_set_heuristic_rank(rank);
        ops[o]();  // plans the shape at this rank
        if (rank == 1) results = cuda::matmul_heuristic_results();
        if (rank > 0 && rank >= results) break;
        ranks.push_back(rank);
      }
      ranks.push_back(-1);
      cuda::matmul_set_heuristic_rank(-1);
      ops[o]();  // plans the shape by timing its candidates
      constexpr int kRounds = 5;
      std::vector<double> ms(ranks.size(), 0.0);
      for (int round = 0; round < kRounds; ++round)
        for (size_t k = 0; k < ranks.size(); ++k) {
          cuda::matmul_set_heuristic_rank(ranks[k]);
          const double t = time_ms(ops[o], 4);
          if (round == 0 || t < ms[k]) ms[k] = t;
        }
      cuda::matmul_set_heuristic_rank(-1);
      const double first = ms[0], timed = ms.back();
      double best = first;
      int best_rank = 0;
      for (size_t k = 1; k + 1 < ranks.size(); ++k)
        if (ms[k] < best) best = ms[k], best_rank = ranks[k];
      const std::string tag = std::string(kinds[o]) + " " + pr.name + " [" +
                              std::to_string(pr.rows) + " x " + std::to_string(pr.in) +
                              "] -> " + std::to_string(pr.out);
      report(tag + ", first choice", first, flop, 0);
      report(tag + ", best of " + std::to_string(std::min(results, 8)) + " (rank " +
                 std::to_string(best_rank) + ")", best, flop, 0);
      report(tag + ", timed choice", timed, flop, 0);
      first_total += first * pr.per_step;
      best_total += best * pr.per_step;
      timed_total += timed * pr.per_step;
    }
  }
  std::printf("TIMING 1B step's matmuls: first choice %.2f ms, best per product %.2f ms (%.2f%% "
              "less), timed choice %.2f ms (%.2f%% less)\n",
              first_total, best_total, 100.0 * (first_total - best_total) / first_total,
              timed_total, 100.0 * (first_total - timed_total) / first_total);
}

// One pass of the 1B model's depth-tiled mixes (full routing, S 73, d 1280, H 8) per
// version of the tile kernel and nothing else, for a kernel profiler: `ncu -k
// regex:mix_tile ... --gtest_filter=OpTiming.DISABLED_RoutingTiles1B
// --gtest_also_run_disabled_tests` (version 1 is mix_tile_kernel, versions 2 to 4
// mix_tile_ring_kernel). Random logits stand in for the real ones (the kernels' work
// does not depend on their values).
// Issue 13 item 3, before building it: what fusing the projections that read the same
// input would buy. One 1B layer (configs/1b_standard.json: N 16384 tokens, d 1280, q 2048,
// k and v 1024 each, d_ff 5120), each product as the model runs it (matmul_forward,
// matmul_input_grad accumulating after the first, matmul_weight_grad into fp32), against
// the one GEMM over the stacked weights ([q; k; v] and [gate; up]) that would replace it.
// The stacked products compute the same sums, so this measures only cuBLAS's shapes.
TEST_F(OpTiming, DISABLED_ProjectionFusion1B) {
  const int64_t N = 16384, d = 1280;
  struct Group {
    const char* name;
    std::vector<int64_t> outs;
  };
  for (const Group& grp : {Group{"q/k/v", {2048, 1024, 1024}}, Group{"gate/up", {5120, 5120}}}) {
    int64_t total = 0;
    for (int64_t o : grp.outs) total += o;
    Buffer x = random_gpu(DType::BF16, {N, d});
    Buffer w = random_gpu(DType::BF16, {total, d}, 0.02);
    Buffer y = random_gpu(DType::BF16, {N, total});  // also the output gradient
    Buffer dx(*gpu, DType::BF16, {N, d});
    Buffer dw(*gpu, DType::F32, {total, d});
    // Separate tensors, as the model holds them today.
    std::vector<Buffer> ws, ys, dws;
    for (int64_t o : grp.outs) {
      ws.push_back(random_gpu(DType::BF16, {o, d}, 0.02));
      ys.push_back(random_gpu(DType::BF16, {N, o}));
      dws.emplace_back(*gpu, DType::F32, std::initializer_list<int64_t>{o, d});
    }
    const double flop = 2.0 * N * d * total;
    const std::string tag = std::string(grp.name) + " [" + std::to_string(N) + " x " +
                            std::to_string(d) + "] -> " + std::to_string(total);
    report("forward, separate " + tag, time_ms([&] {
             for (size_t i = 0; i < ws.size(); ++i) gpu->matmul_forward(ys[i], x, ws[i]);
           }), flop, 0);
    report("forward, stacked " + tag, time_ms([&] { gpu->matmul_forward(y, x, w); }), flop, 0);
    report("input grad, separate " + tag, time_ms([&] {
             for (size_t i = 0; i < ws.size(); ++i) gpu->matmul_input_grad(dx, ys[i], ws[i], i > 0);
           }), flop, 0);
    report("input grad, stacked " + tag,
           time_ms([&] { gpu->matmul_input_grad(dx, y, w, false); }), flop, 0);
    report("weight grad, separate " + tag, time_ms([&] {
             for (size_t i = 0; i < ws.size(); ++i) gpu->matmul_weight_grad(dws[i], ys[i], x);
           }), flop, 0);
    report("weight grad, stacked " + tag, time_ms([&] { gpu->matmul_weight_grad(dw, y, x); }),
           flop, 0);
  }
  // The step's other products, so that the lines sum to the step's matmul time: the output
  // and down projections (36 layers each) and chunks of the tied LM head over the
  // 151,936-word vocabulary: 1,664 tokens (10 chunks a step at 1B, the automatic chunk
  // under the 512 MiB budget this was first measured with), 2x (3,328: the automatic
  // chunk under a 1 GiB budget) and 4x: each chunk's weight gradient re-reads and re-writes the
  // fp32 [V, d] gradient.
  struct Product {
    const char* name;
    int64_t rows, in, out;
  };
  for (const Product& pr : {Product{"o_proj", N, 2048, d}, Product{"down_proj", N, 5120, d},
                            Product{"lm_head chunk", 1664, d, 151936},
                            Product{"lm_head chunk x2", 3328, d, 151936},
                            Product{"lm_head chunk x4", 6656, d, 151936}}) {
    Operands bufs = operands(pr.rows, pr.in, pr.out);
    Buffer &x = bufs.x, &w = bufs.w, &y = bufs.y, &dx = bufs.dx, &dw = bufs.dw;
    const double flop = 2.0 * pr.rows * pr.in * pr.out;
    const std::string tag = std::string(pr.name) + " [" + std::to_string(pr.rows) + " x " +
                            std::to_string(pr.in) + "] -> " + std::to_string(pr.out);
    report("forward " + tag, time_ms([&] { gpu->matmul_forward(y, x, w); }), flop, 0);
    report("input grad " + tag, time_ms([&] { gpu->matmul_input_grad(dx, y, w, false); }), flop,
           0);
    report("weight grad " + tag, time_ms([&] { gpu->matmul_weight_grad(dw, y, x); }), flop, 0);
  }
}

TEST_F(OpTiming, DISABLED_RoutingTiles1B) {
  const int64_t N = 16384, d = 1280;
  const int S = 73, H = 8;
  const RoutingLayout lay = RoutingLayout::full(S);
  const std::vector<int> k = gpu->routing_tile_plan(lay, d, H);
  Buffer hist = random_gpu(DType::BF16, {S, N, d});
  Buffer weights = random_gpu(DType::F32, {lay.pairs(), H, N}, 3.0);
  Buffer xs(*gpu, DType::BF16, {S, N, d});
  const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::MixTile);
  for (int version = 1; version <= versions; ++version) {
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixTile, version);
    gpu->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    tiled_mixes(*gpu, xs, weights, hist, lay, k, H, false);
    gpu->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    report("routing_mix, all sites, tiles " + plan_str(k) + ", tile kernel v" +
               std::to_string(version) + " (one cold pass)",
           std::chrono::duration<double, std::milli>(t1 - t0).count(), 0, 0);
  }
  cuda::routing_set_kernel_version(cuda::RoutingKernel::MixTile, 0);
}

// Each version of the mix tile kernel at the three full-routing model shapes (N = 16384):
// the tile kernels alone (the calls at sites 0, k, 2k, ...) and the whole step's tiled
// mixes, in ms and by the bytes each must move (traffic model of cuda/routing_mix.cu):
//   tile kernel at j0 (k' = min(k, S - j0) sites): rows j0 + 1 slots read, x written,
//     k' - 1 fp32 partial rows (2 rows each) written; the logits of its (j0 + 1) k' pairs
//     read, site j0's j0 + 1 weights and 2 (k' - 1) fp32 statistics written, per head;
//   the whole step: those plus each later site's partial (2 rows), newer slots and x, and
//     every pair's logit read and weight written once (as in ModelShapes).
// The untiled mixes of the same step are timed beside them for reference, and each
// version of the finish kernel (the tiles' later sites) at the default tile kernel, and the
// mixes with their consumers' norms with and without the norm in the finish (mix_step's
// random logits).
TEST_F(OpTiming, DISABLED_RoutingTileVersions) {
  const int64_t N = 16384;
  for (const FullRoutingShape& sh : kFullRoutingShapes) {
    MixStep m = mix_step(sh, N);
    const RoutingLayout& lay = m.lay;
    const int64_t d = m.d, P = m.P;
    const int S = m.S, H = m.H;
    Buffer &hist = m.hist, &weights = m.weights, &xs = m.xs;
    const double row = m.row, stat = m.stat;
    const std::vector<int> k = gpu->routing_tile_plan(lay, d, H);  // the tiles' counts
    ASSERT_GT(*std::max_element(k.begin(), k.end()), 1)
        << sh.name << ": the model shape no longer tiles";
    double tile_bytes = 0;
    int j0 = 0;
    for (const int kk : k) {
      if (kk > 1)
        tile_bytes += row * ((j0 + 1) + 1 + 2.0 * (kk - 1)) +
                      stat * (double(j0 + 1) * kk + (j0 + 1) + 2.0 * (kk - 1));
      j0 += kk;
    }
    const double step_bytes = row * mix_rows(k) + 2 * stat * double(P);
    const std::string tag = m.tag + ", tiles " + plan_str(k);
    report("routing_mix, all sites, untiled, " + tag,
           time_ms([&] {
             for (int i = 0; i < S; ++i) gpu->routing_mix(xs.t()[i], weights, hist, lay, i, H);
           }, 3),
           0, row * (double(P) + S) + 2 * stat * double(P));
    const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::MixTile);
    for (int version = 1; version <= versions; ++version) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::MixTile, version);
      const std::string v = "v" + std::to_string(version) + ", ";
      report("routing_mix_tile, tile kernels only, " + v + tag,
             time_ms([&] { tiled_mixes(*gpu, xs, weights, hist, lay, k, H, true); }, 3), 0,
             tile_bytes);
      report("routing_mix, all sites, tiled, " + v + tag,
             time_ms([&] { tiled_mixes(*gpu, xs, weights, hist, lay, k, H, false); }, 3), 0,
             step_bytes);
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixTile, 0);
    // The finish kernel's versions (the tiles' later sites), at the default tile kernel:
    // the whole tiled step, and the finishes alone as its difference from the tiles alone.
    const double tiles_alone =
        time_ms([&] { tiled_mixes(*gpu, xs, weights, hist, lay, k, H, true); }, 3);
    const int finishes = cuda::routing_kernel_versions(cuda::RoutingKernel::MixFinish);
    for (int version = 1; version <= finishes; ++version) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::MixFinish, version);
      const double step =
          time_ms([&] { tiled_mixes(*gpu, xs, weights, hist, lay, k, H, false); }, 3);
      const std::string v = "finish v" + std::to_string(version) + ", ";
      report("routing_mix, all sites, tiled, " + v + tag, step, 0, step_bytes);
      report("routing_mix, finishes alone (step - tiles), " + v + tag, step - tiles_alone, 0,
             step_bytes - tile_bytes);
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixFinish, 0);
    // The mixes with their consumers' norms, as the routed scheme calls them
    // (routing_mix_rmsnorm; routing_mix_tile_rmsnorm at a tile's first site): MixNorm
    // version 1 (the norm's own launch), 2 (inside the finishes and tile kernels), 3 (the
    // finishes only) and 4 (2 and the plain mixes), in turn, twice. Bytes: the step's plus
    // each norm's output written (version 1 also reads x back).
    const MixNorms norms{m.ys, m.rstds, m.norm_w, 1e-6};
    auto normed_step = [&] { tiled_mixes(*gpu, xs, weights, hist, lay, k, H, false, &norms); };
    for (int round = 0; round < 2; ++round)
      for (int version : {1, 2, 3, 4}) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, version);
        report(
            "routing_mix + norms, all sites, tiled, norm v" + std::to_string(version) + ", " + tag,
            time_ms(normed_step, 3), 0, step_bytes + S * (row + 4.0 * N));
      }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, 0);
  }
}

// The depth-tile plans (Backend::routing_tile_plan: tiles that grow with the depth, the
// fewest rows by cuda::routing_tile_rows) against the plan of one fixed tile with the
// fewest rows (the rule before the fifty-seventh session), each a whole step's mixes with
// their consumers' norms as the routed scheme calls them, at the three full-routing model
// shapes: the fixed tiles with the norm fused in the finishes only (MixNorm 3), the plans
// of tiles up to 8 (TilePlan 2) and up to 7 (TilePlan 3) so, and the latter with the norm
// in the tile kernel too (MixNorm 2), and in the plain mixes too (MixNorm 4); in turn, three
// rounds, so that drift shows. Bytes:
// the traffic model's rows (with the norm fused in the tile kernel) and every pair's logit
// read and weight written.
TEST_F(OpTiming, DISABLED_RoutingTilePlans) {
  const int64_t N = 16384;
  for (const FullRoutingShape& sh : kFullRoutingShapes) {
    MixStep m = mix_step(sh, N);
    const RoutingLayout& lay = m.lay;
    const int64_t d = m.d;
    const int H = m.H;
    // The plans of TilePlan versions 1 (fixed tiles), 2 (tiles up to 8) and 3 (up to 7),
    // whichever is the default.
    const int plan_default = cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, 1);
    const std::vector<int> fixed = gpu->routing_tile_plan(lay, d, H);
    cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, 2);
    const std::vector<int> plan8 = gpu->routing_tile_plan(lay, d, H);
    cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, 3);
    const std::vector<int> plan7 = gpu->routing_tile_plan(lay, d, H);
    cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, plan_default);
    const MixNorms norms{m.ys, m.rstds, m.norm_w, 1e-6};
    for (int round = 0; round < 3; ++round)
      for (const auto& [p, norm_version] :
           {std::pair{&fixed, 3}, std::pair{&plan8, 3}, std::pair{&plan7, 3}, std::pair{&plan7, 2},
            std::pair{&plan7, 4}}) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, norm_version);
        report(
            "routing_mix + norms v" + std::to_string(norm_version) + ", tiles " + plan_str(*p) +
                " (" + std::to_string(cuda::routing_plan_rows(*p)) + " rows), " + m.tag,
            time_ms([&] { tiled_mixes(*gpu, m.xs, m.weights, m.hist, lay, *p, H, false, &norms); },
                    3),
            0, m.row * double(cuda::routing_plan_rows(*p)) + 2 * m.stat * double(m.P));
      }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, 0);
  }
}

// The plain mixes with their consumers' norms at the block configs' shapes, a whole step's
// routing_mix_rmsnorm as the routed scheme calls them: MixNorm 2 (at these sites the norm by
// its own launch) and 4 (inside the plain mix kernel), in turn, three rounds. Bytes: each
// site's source rows and logits read, x, y, rstd and the weights written (version 2 also
// reads x back, which is what it costs). Random logits, as mix_step's.
TEST_F(OpTiming, DISABLED_RoutingPlainMixNorms) {
  const int64_t N = 16384;
  for (const RoutingShape& sh : kBlockRoutingShapes) {
    MixStep m = mix_step(sh.name, sh.d, sh.S, sh.H, sh.block, N);
    double bytes = 0;
    for (int j = 0; j < m.S; ++j)
      bytes += m.row * (m.lay.site_sources(j) + 2) + 4.0 * N + 2 * m.stat * m.lay.site_sources(j);
    auto step = [&] {
      for (int j = 0; j < m.S; ++j)
        gpu->routing_mix_rmsnorm(m.xs.t()[j], m.ys.t()[j], m.rstds.t()[j], m.weights, m.hist, m.lay,
                                 j, m.H, m.norm_w, 1e-6);
    };
    for (int round = 0; round < 3; ++round)
      for (int version : {2, 4}) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, version);
        report("routing_mix + norms, every site plain, norm v" + std::to_string(version) + ", " +
                   m.tag,
               time_ms(step, 3), 0, bytes);
      }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, 0);
  }
}

// Every kernel-lab version of routing_source_logits (cuda::RoutingKernel::Logits: the
// token kernel one or four tokens a warp, and for which slots) at the full-routing model
// shapes and 1B block routing: all sources' logits of a step, as the layer loop calls
// them; the versions in turn, twice, so that drift between them shows. Bytes: v read,
// inv_rms and the ns H fp32 logits of every slot written.
TEST_F(OpTiming, DISABLED_RoutingLogitsVersions) {
  const int64_t N = 16384;
  for (const RoutingShape& sh : kRoutingShapes) {
    const RoutingLayout lay = RoutingLayout::blocks(sh.S, sh.block);
    const int64_t d = sh.d;
    const int S = sh.S, H = sh.H;
    Buffer hist = random_gpu(DType::BF16, {S, N, d});
    Buffer inv_rms(*gpu, DType::F32, {S, N}), weights(*gpu, DType::F32, {lay.pairs(), H, N});
    std::vector<Buffer> params;
    const RoutingParams rp = random_routing_params(S, d, params);
    const double bytes = 2.0 * N * d * S + 4.0 * N * S + 4.0 * double(lay.pairs()) * H * N;
    const std::string tag = std::string(sh.name) + " N16384 d" + std::to_string(d) + " S" +
                            std::to_string(S) + " H" + std::to_string(H);
    auto logits = [&] {
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(weights, inv_rms.t()[i], hist.t()[i], rp, lay, i, H, 1e-6);
    };
    const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::Logits);
    for (int round = 0; round < 2; ++round)
      for (int version = 1; version <= versions; ++version) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::Logits, version);
        report("routing_source_logits, all sources, v" + std::to_string(version) + ", " + tag,
               time_ms(logits, 5), 0, bytes);
      }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::Logits, 0);
  }
}

// The whole step's routing backward at the full-routing model shapes, as the layer loop
// runs it (untiled, and in the backward depth tiles of routing_source_backward_tile), so
// that the kernel rules are measured ones; the same inputs for every variant.
// limits: the fused/unfused choice (cuda/routing.cu: slots read by at most
// kFusedKeyMaxSites sites fuse the key path into the token kernel) swept over the limit,
// tiled under each numbered version of the pair kernel (cuda::routing_set_kernel_version).
// versions: each numbered version of the value and key-gradient kernels, and the version
// pairs a default would take together.
// pairs: the tiled backward at the default limit under the default pair and value versions (16 and
// by width: 7 at d 512, the radial sums from the accumulators: cuda/routing_backward_rows.cuh,
// key_site_chunks), the former defaults (15 and 5) and each new version alone, alternating, three
// rounds.
void OpTiming::routing_backward_sweeps(bool limits, bool versions, bool pairs) {
  const int64_t N = 16384;
  for (const FullRoutingShape& sh : kFullRoutingShapes) {
    const RoutingLayout lay = RoutingLayout::full(sh.S);
    const int64_t d = sh.d;
    const int S = sh.S, H = sh.H;
    RoutingStep st = routing_step(lay, N, d, H);
    Buffer &hist = st.hist, &xs = st.xs, &inv_rms = st.inv_rms, &weights = st.weights;
    Buffer &ubar = st.ubar, &gsum = st.gsum, &dv = st.dv, &mixed = st.mixed;
    const std::vector<Tensor>& dx_rows = st.dx_rows;
    const RoutingParams& rp = st.rp;
    // The backward overwrites the weights with ds r: each repetition starts from the
    // same weights (a device copy, timed separately and subtracted).
    auto restore = [&] { gpu->copy(weights, mixed); };
    const int tile = gpu->routing_backward_tile_slots(lay, d, H);
    auto backward = [&](bool tiled) {
      restore();
      gpu->zero(gsum);
      for (int i = S - 1; i >= 0; --i)
        if (const int count = tiled ? lay.back_tile_count(i, tile) : 0; count > 0)
          gpu->routing_source_backward_tile(dv, weights, ubar, gsum, dx_rows, xs.t()[i], hist,
                                            inv_rms, rp, lay, i, count, H);
        else
          gpu->routing_source_backward(dv, weights, ubar, gsum, dx_rows, xs.t()[i],
                                       hist.t()[i], inv_rms.t()[i], rp, lay, i, H);
      gpu->routing_param_grads(rp, gsum);
    };
    const double copy_ms = time_ms(restore, 3);
    const std::string tag = std::string(sh.name) + " d" + std::to_string(d) + " S" +
                            std::to_string(S) + " H" + std::to_string(H);
    // Tiled: each numbered version of the pair kernel (cuda/routing.cu: blocks per SM and
    // grid; the same arithmetic).
    const int pair_versions = cuda::routing_kernel_versions(cuda::RoutingKernel::BackwardPair);
    for (int limit : {0, 8, 12, 16, 24, 32, 256}) {
      if (!limits) break;
      cuda::routing_set_fused_key_max_sites(limit);
      const std::string head = "routing backward, fused up to " + std::to_string(limit) + " sites";
      report(head + ", " + tag, time_ms([&] { backward(false); }, 3) - copy_ms, 0, 0);
      for (int version = 1; tile > 1 && version <= pair_versions; ++version) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, version);
        report(head + ", tiles of " + std::to_string(tile) + ", pair kernel v" +
                   std::to_string(version) + ", " + tag,
               time_ms([&] { backward(true); }, 3) - copy_ms, 0, 0);
      }
      cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, 0);
    }
    cuda::routing_set_fused_key_max_sites(-1);
    // The question in hand, alternating: the logit gradients stored by token in 100M's fused
    // pair form (pair version 18) and in the plain calls' ring kernels (value version 8: 7
    // so, 100M's default; 9: 3 so, 350M's), apart and together, against the defaults
    // (fifty-third session: pair 17 against 16, which it replaced; the thirty-second's was
    // 15 and 16 against value versions 5 and 7).
    for (int round = 0; pairs && tile > 1 && round < 3; ++round)
      for (const auto& [pair_v, value_v] : {std::pair{0, 0}, std::pair{18, 0}, std::pair{0, 8},
                                            std::pair{0, 9}, std::pair{18, 8}}) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, pair_v);
        cuda::routing_set_kernel_version(cuda::RoutingKernel::SourceValue, value_v);
        auto name = [](int v) { return v == 0 ? std::string("default") : "v" + std::to_string(v); };
        report("routing backward, tiles of " + std::to_string(tile) + ", pair kernel " +
                   name(pair_v) + ", value kernel " + name(value_v) + ", " + tag,
               time_ms([&] { backward(true); }, 3) - copy_ms, 0, 0);
        cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, 0);
        cuda::routing_set_kernel_version(cuda::RoutingKernel::SourceValue, 0);
      }
    if (!versions) continue;
    // Each numbered version of one kernel at the default limit and pair kernel, untiled
    // and tiled: the plain calls' value kernel, the key gradients (1: the GEMMs past 8
    // sites; 2: the token-slab kernel at every slot; 3-4: tensor cores at every slot).
    auto sweep_versions = [&](cuda::RoutingKernel kernel, const std::string& name) {
      for (int version = 1; version <= cuda::routing_kernel_versions(kernel); ++version) {
        cuda::routing_set_kernel_version(kernel, version);
        const std::string head = "routing backward, " + name + " v" + std::to_string(version);
        report(head + ", untiled, " + tag, time_ms([&] { backward(false); }, 3) - copy_ms, 0, 0);
        if (tile > 1)
          report(head + ", tiles of " + std::to_string(tile) + ", " + tag,
                 time_ms([&] { backward(true); }, 3) - copy_ms, 0, 0);
      }
      cuda::routing_set_kernel_version(kernel, 0);
    };
    sweep_versions(cuda::RoutingKernel::SourceValue, "value kernel");
    sweep_versions(cuda::RoutingKernel::KeyGrad, "key grads");
    // Pairs of versions that a default would take together: row parts in both kernels
    // (pair v5 + value v3: parts of 2 chunks a lane; pair v6 + value v4: of 1); value v5
    // (every slot's key path fused) with its pair kernel's two forms (pair v6: 2 blocks an
    // SM, 4 sites in flight; otherwise 3 blocks, 2 sites).
    for (const auto& [pair_v, value_v] :
         {std::pair{5, 3}, std::pair{6, 4}, std::pair{4, 5}, std::pair{6, 5}}) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, pair_v);
      cuda::routing_set_kernel_version(cuda::RoutingKernel::SourceValue, value_v);
      const std::string head = "routing backward, pair v" + std::to_string(pair_v) +
                               " + value v" + std::to_string(value_v);
      report(head + ", untiled, " + tag, time_ms([&] { backward(false); }, 3) - copy_ms, 0, 0);
      if (tile > 1)
        report(head + ", tiles of " + std::to_string(tile) + ", " + tag,
               time_ms([&] { backward(true); }, 3) - copy_ms, 0, 0);
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::BackwardPair, 0);
    cuda::routing_set_kernel_version(cuda::RoutingKernel::SourceValue, 0);
  }
}
TEST_F(OpTiming, DISABLED_RoutingBackwardFusedLimit) { routing_backward_sweeps(true, false); }
TEST_F(OpTiming, DISABLED_RoutingBackwardVersions) { routing_backward_sweeps(false, true); }
TEST_F(OpTiming, DISABLED_RoutingPairVersions) { routing_backward_sweeps(false, false, true); }

// Delta's routing at the 1B shape (configs/1b_delta.json: d 1280, 73 sites, H 8, blocks
// of 8 sublayers), split by slot class: "short" slots (a block's partial sums, read by
// their own site only: 63 of 73) and "long" ones (the null and each closed block's last
// slot, read by every later site). Per class: the logits of every such source, and its
// source backward, in ms for the whole step's calls and by the bytes each must move
// (logits: v read, inv_rms and ns H fp32 logits written; backward: v, x, dv, the ns site
// rows, ns H weights read and written, ubar). MHAR_OP_TIMING_REPS (default 10) sets the
// repetitions: 1 under a kernel profiler (ncu), whose per-kernel summary splits each op.
TEST_F(OpTiming, DISABLED_DeltaRouting1B) {
  const int64_t N = 16384, d = 1280;
  const int S = 73, H = 8, reps = [] {
    const char* e = std::getenv("MHAR_OP_TIMING_REPS");
    return e ? std::max(1, std::atoi(e)) : 10;
  }();
  const RoutingLayout lay = RoutingLayout::blocks(S, 8);
  RoutingStep st = routing_step(lay, N, d, H);
  Buffer &hist = st.hist, &xs = st.xs, &inv_rms = st.inv_rms, &weights = st.weights;
  Buffer &ubar = st.ubar, &gsum = st.gsum, &dv = st.dv, &mixed = st.mixed;
  const std::vector<Tensor>& dx_rows = st.dx_rows;
  const RoutingParams& rp = st.rp;
  const double row = 2.0 * N * d, stat = 4.0 * H * N;
  for (bool long_slots : {false, true}) {
    std::vector<int> slots;
    double logit_bytes = 0, back_bytes = 0;
    for (int i = 0; i < S; ++i) {
      const int ns = lay.last_site(i) - i + 1;
      if ((ns > 1) != long_slots) continue;
      slots.push_back(i);
      logit_bytes += row + 4.0 * N + stat * ns;
      back_bytes += row * (3 + ns) + 2 * stat * ns + stat;
    }
    const std::string tag = std::string(long_slots ? "long" : "short") + " slots (" +
                            std::to_string(slots.size()) + "), 1B delta N16384 d1280 S73 H8";
    report("routing_source_logits, " + tag, time_ms([&] {
             for (int i : slots)
               gpu->routing_source_logits(weights, inv_rms.t()[i], hist.t()[i], rp, lay, i, H, 1e-6);
           }, reps), 0, logit_bytes);
    gpu->copy(weights, mixed);
    // The backward overwrites each pair's weight with ds r; the values do not change the
    // work, so the repetitions run on without restoring them.
    report("routing_source_backward, " + tag, time_ms([&] {
             for (auto it = slots.rbegin(); it != slots.rend(); ++it)
               gpu->routing_source_backward(dv, weights, ubar, gsum, dx_rows, xs.t()[*it],
                                            hist.t()[*it], inv_rms.t()[*it], rp, lay, *it, H);
           }, reps), 0, back_bytes);
    gpu->copy(weights, mixed);
    if (!long_slots) continue;
    // The long slots in the backward depth tiles residual_delta.cpp runs them in
    // (RoutingLayout::back_tile_count: (8, 0), (24, 16), ...; slot 64 alone); bytes by the
    // tiles: an older slot reads only its sites before the tile's first, plus its fp32
    // partial written and read (4 rows' bytes).
    const int tile = gpu->routing_backward_tile_slots(lay, d, H);
    double tiled_bytes = back_bytes;
    for (int i : slots)
      if (lay.back_tile_count(i, tile) == 2)
        tiled_bytes -= row * (lay.last_site(i) - i + 1) - 4 * row;
    report("routing_source_backward, tiles of " + std::to_string(tile) + ", " + tag,
           time_ms([&] {
             for (auto it = slots.rbegin(); it != slots.rend(); ++it) {
               if (const int count = lay.back_tile_count(*it, tile); count > 0)
                 gpu->routing_source_backward_tile(dv, weights, ubar, gsum, dx_rows, xs.t()[*it],
                                                   hist, inv_rms, rp, lay, *it, count, H);
               else
                 gpu->routing_source_backward(dv, weights, ubar, gsum, dx_rows, xs.t()[*it],
                                              hist.t()[*it], inv_rms.t()[*it], rp, lay, *it, H);
             }
           }, reps), 0, tiled_bytes);
    gpu->copy(weights, mixed);
  }
  // The short slots' whole site forward as residual_delta.cpp runs it
  // (Backend::delta_site_forward: the stream advance, the slot's logits, the mix, the
  // gate): by the op sequence (the default) and by the fused kernel. Bytes as fused: the
  // stream, v, prev (continuing) and the closed slots read; the stream, the slot
  // (continuing), r and x written.
  {
    Buffer stream = random_gpu(DType::BF16, {N, d}), x(*gpu, DType::BF16, {N, d});
    Buffer alpha = random_gpu(DType::BF16, {1});
    std::vector<int> sites;
    double bytes = 0;
    for (int i = 1; i < S; ++i) {
      if (lay.last_site(i) != i) continue;
      const bool continues = (i - 1) % 8 != 0;
      sites.push_back(i);
      bytes += row * (2 + 1 + (continues ? 2 : 0) + (lay.site_sources(i) - 1) + 2);
    }
    auto site_forward = [&](bool sequence) {
      for (int i : sites) {
        DeltaSiteForward a;
        a.stream = stream, a.history = hist, a.x = x, a.r = xs.t()[i], a.alpha = alpha;
        a.weights = weights, a.inv_rms = inv_rms.t()[i], a.params = &rp, a.layout = lay;
        a.site = i, a.heads = H, a.continues = (i - 1) % 8 != 0, a.eps = 1e-6;
        if (sequence) gpu->Backend::delta_site_forward(a);
        else gpu->delta_site_forward(a);
      }
    };
    const std::string tag = "short slots (" + std::to_string(sites.size()) + "), 1B delta";
    report("delta_site_forward, op sequence, " + tag, time_ms([&] { site_forward(true); }, reps),
           0, bytes);
    const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::DeltaForward);
    for (int version = 1; version <= versions; ++version) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::DeltaForward, version);
      report("delta_site_forward, fused kernel v" + std::to_string(version) + ", " + tag,
             time_ms([&] { site_forward(false); }, reps), 0, bytes);
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::DeltaForward, 0);
    gpu->copy(weights, mixed);
  }
  // The short slots' whole site backward as residual_delta.cpp runs it
  // (Backend::delta_site_backward: the gate backward, the slot's backward, its gradient
  // gathered): by the op sequence (the default) and by the fused kernel's lab versions.
  // Bytes: dx, r, dresid, v, next read once; dresid, dr, slot, out written.
  {
    Buffer dresid = random_gpu(DType::BF16, {N, d}), out(*gpu, DType::BF16, {N, d});
    Buffer next = random_gpu(DType::BF16, {N, d}), dx = random_gpu(DType::BF16, {N, d});
    Buffer alpha = random_gpu(DType::BF16, {1}), dalpha(*gpu, DType::F32, {1});
    Buffer scratch(*gpu, DType::F32, {64, d});
    std::vector<int> slots;
    for (int i = 1; i < S; ++i)
      if (lay.last_site(i) == i) slots.push_back(i);
    auto site_backward = [&](bool sequence) {
      for (auto it = slots.rbegin(); it != slots.rend(); ++it) {
        const int i = *it;
        DeltaSiteBackward a;
        a.dresid = dresid, a.dr = dx_rows[size_t(i)], a.dalpha = dalpha, a.dx = dx, a.r = xs.t()[i];
        a.alpha = alpha, a.scratch = scratch, a.slot = dv, a.weights = weights, a.ubar = ubar;
        a.gsum = gsum, a.v = hist.t()[i], a.inv_rms = inv_rms.t()[i], a.site_dx = &dx_rows;
        a.params = &rp, a.layout = lay, a.site = i, a.heads = H, a.out = out;
        if (i % 8 != 0) a.next = next;
        if (sequence) gpu->Backend::delta_site_backward(a);
        else gpu->delta_site_backward(a);
      }
    };
    const double bytes = double(slots.size()) * 9 * row;
    const std::string tag = "short slots (" + std::to_string(slots.size()) + "), 1B delta";
    report("delta_site_backward, op sequence, " + tag, time_ms([&] { site_backward(true); }, reps),
           0, bytes);
    const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::DeltaSite);
    for (int version = 1; version <= versions; ++version) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::DeltaSite, version);
      report("delta_site_backward, fused kernel v" + std::to_string(version) + ", " + tag,
             time_ms([&] { site_backward(false); }, reps), 0, bytes);
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::DeltaSite, 0);
  }
}

}  // namespace
}  // namespace mhar::test
