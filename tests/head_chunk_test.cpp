// head_chunk_test.cpp: the LM head run in chunks of tokens (model.cpp's head_forward,
// train.logits_chunk) against the same model with one chunk (the unchunked head, which
// the golden fixtures and the gradient checks pin), on the CPU backend in fp64 and fp32:
// losses, per-token losses and every gradient, for chunk sizes that divide N and that do
// not, tied and untied, over two micro-batches of gradient accumulation with a loss scale
// that is not 1. Also logits(first, rows) paging, and the plan bytes of the 1B shape with
// the GPT-2 and Qwen3 vocabularies (the figures in BENCHMARKS.md, "plan bytes").
//
// What may differ, and why: a token row's logits, its cross-entropy and its rows of
// d(final norm output) are products and reductions over V or d within that row. OpenBLAS
// does not compute a row's dot products the same way at every row count M: rows in the
// remainder of its M-blocking go through other micro-kernels with another summation order
// (seen here: chunks of 1, 2, 3, 5, 7 and 9 of N = 10 change the last bits of logits
// that chunks of 4 leave alone), so the models below run on a backend whose products
// that keep rows (forward, input gradient) go one row at a time: then a row's values do
// not depend on the chunk, and the losses and every gradient that flows through d(xn)
// (all but the head's weight) must be bit-identical, which checks the chunking itself
// (rows, offsets, scales, accumulation) exactly. On the plain backend the chunked head
// differs from the one-chunk head by that GEMM rounding only (the GPU's ModelParity
// `_chunk48` cases hold it to the model's bounds). The head's weight
// gradient sums one term per token; chunks sum them chunk by chunk, another order. Both
// results are floating-point sums of the same m terms (with the tied embedding's scatter),
// so each is within gamma_m = m u / (1 - m u) of the exact sum times the sum of the
// terms' magnitudes, and they differ by at most twice that, element by element. The
// magnitudes are recorded from the products the model actually issues.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "engine/error.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

// Products whose output rows are the rows of their first operand (op(A) = A: forward and
// input gradient) one row at a time, so that every row is computed by the same kernel
// whatever the row count (header); weight gradients (op(A) = A^T) unchanged.
class RowwiseProducts : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    if (ta) return ForwardingBackend::matmul(c, a, b, ta, tb, acc);
    for (int64_t r = 0; r < a.dim(0); ++r) {
      Tensor ar = a[r], cr = c[r];
      ForwardingBackend::matmul(cr.view({1, cr.numel()}), ar.view({1, ar.numel()}), b, ta, tb, acc);
    }
  }
};

// Records, for one gradient tensor (the head's weight gradient), the sum over every term
// added into each element of |term|, and how many terms an element receives at most.
class TermRecorder final : public RowwiseProducts {
 public:
  using RowwiseProducts::RowwiseProducts;
  const void* target = nullptr;
  const std::vector<int32_t>* tokens = nullptr;  // of the current micro-batch
  std::vector<double> abs_sum;                   // [V, d]
  int64_t terms = 0;                             // per element, an upper bound

  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    if (c.data == target) {  // dW += dlogits^T xn
      EXPECT_TRUE(ta && !tb && acc);
      const int64_t rows = a.dim(0), V = a.dim(1), d = b.dim(1);
      const auto ha = test::download(*this, a), hb = test::download(*this, b);
      abs_sum.resize(size_t(V * d), 0.0);
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t v = 0; v < V; ++v)
          for (int64_t k = 0; k < d; ++k)
            abs_sum[size_t(v * d + k)] += std::fabs(ha[size_t(n * V + v)] * hb[size_t(n * d + k)]);
      terms += rows;
    }
    RowwiseProducts::matmul(c, a, b, ta, tb, acc);
  }
  void embedding_backward(Tensor dtable, Tensor dout, Tensor toks) override {
    if (dtable.data == target) {  // tied: the embedding's scatter adds into the same gradient
      const int64_t N = dout.dim(0), d = dout.dim(1);
      const auto h = test::download(*this, dout);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < d; ++k)
          abs_sum[size_t(int64_t((*tokens)[size_t(n)]) * d + k)] += std::fabs(h[size_t(n * d + k)]);
      terms += N;
    }
    ForwardingBackend::embedding_backward(dtable, dout, toks);
  }
};

struct Result {
  std::vector<double> loss, token_losses;
  std::vector<std::vector<double>> grads;  // per parameter
};

// Two micro-batches of gradient accumulation, each with loss scale 1/3, as TrainStep runs them.
Result train_two(Model& m, Backend& be, TermRecorder* rec, int V) {
  Result r;
  m.zero_grads();
  for (uint64_t mb = 0; mb < 2; ++mb) {
    std::vector<int32_t> tok, tgt;
    random_tokens(m.batch() * m.seq_len(), V, 31 + mb, tok, tgt);
    if (rec) rec->tokens = &tok;
    r.loss.push_back(m.forward(tok.data(), tgt.data(), 1.0 / 3.0));
    const auto l = download(be, m.losses());
    r.token_losses.insert(r.token_losses.end(), l.begin(), l.end());
    m.backward();
  }
  for (const auto& p : m.parameters()) r.grads.push_back(download(be, p.grad));
  return r;
}

struct ChunkCase {
  DType dtype;
  bool tied;
  ResidualMode mode;
};

class HeadChunk : public ::testing::TestWithParam<ChunkCase> {};

TEST_P(HeadChunk, ChunkedHeadMatchesOneChunk) {
  const ChunkCase cc = GetParam();
  const Config cfg = tiny_config(cc.mode, cc.mode == ResidualMode::Standard ? 0 : 2, cc.tied);
  const int B = cfg.train.micro_batch, T = cfg.train.seq_len, V = cfg.model.vocab_size;
  const int64_t N = int64_t(B) * T;  // 10
  auto cpu = make_cpu_backend(cc.dtype);
  RowwiseProducts base(*cpu);
  Model ref(cfg.model, cfg.residual, base, B, T, 1, N);
  ASSERT_EQ(ref.logits_chunk(), N);
  randomize_weights(ref, 5);
  const Result want = train_two(ref, base, nullptr, V);
  const std::string head = cc.tied ? "model.embed_tokens.weight" : "lm_head.weight";
  const double u = cc.dtype == DType::F64 ? 0x1p-53 : 0x1p-24;

  // 1, 2, 5 divide N = 10; 3, 4, 7, 9 leave a shorter last chunk; 64 is clamped to N.
  for (int64_t chunk : {1, 2, 3, 4, 5, 7, 9, 64}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    TermRecorder rec(*cpu);
    Model m(cfg.model, cfg.residual, rec, B, T, 1, chunk);
    EXPECT_EQ(m.logits_chunk(), std::min<int64_t>(chunk, N));
    copy_weights(ref, m);
    rec.target = m.parameter(head).grad.data;
    const Result got = train_two(m, rec, &rec, V);
    EXPECT_EQ(got.loss, want.loss);
    EXPECT_EQ(got.token_losses, want.token_losses);
    const double m_terms = double(rec.terms) + 1;
    const double gamma = m_terms * u / (1 - m_terms * u);
    for (size_t i = 0; i < m.parameters().size(); ++i) {
      const std::string& name = m.parameters()[i].name;
      if (name != head) {
        EXPECT_EQ(got.grads[i], want.grads[i]) << name;
        continue;
      }
      ASSERT_EQ(rec.abs_sum.size(), got.grads[i].size());
      int worse = 0;
      for (size_t e = 0; e < got.grads[i].size(); ++e)
        if (std::fabs(got.grads[i][e] - want.grads[i][e]) > 2 * gamma * rec.abs_sum[e]) ++worse;
      EXPECT_EQ(worse, 0) << name << ": elements beyond 2 gamma_" << m_terms
                          << " x sum |terms|";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HeadChunk,
    ::testing::Values(ChunkCase{DType::F64, true, ResidualMode::Standard},
                      ChunkCase{DType::F64, false, ResidualMode::Standard},
                      ChunkCase{DType::F32, true, ResidualMode::Standard},
                      ChunkCase{DType::F32, false, ResidualMode::Standard},
                      ChunkCase{DType::F32, true, ResidualMode::Mhar},
                      ChunkCase{DType::F64, false, ResidualMode::Mhar}),
    [](const auto& info) {
      return std::string(info.param.dtype == DType::F64 ? "F64" : "F32") +
             (info.param.tied ? "_tied_" : "_untied_") + residual_mode_name(info.param.mode);
    });

// A forward without a loss scale adds nothing to any gradient (the chunked head computes
// gradients only with one), and logits(first, rows) pages through the same values the
// one-chunk model's logits() holds (row by row products, as above), whether the chunk buffer holds them already (the last
// chunk after such a forward) or recomputes them (any other rows, or after a forward with
// a loss scale, whose cross-entropy overwrote the buffer with gradients).
TEST(HeadChunkLogits, PagesGiveTheOneChunkLogits) {
  for (bool tied : {true, false}) {
    const Config cfg = tiny_config(ResidualMode::Standard, 0, tied);
    const int B = cfg.train.micro_batch, T = cfg.train.seq_len, V = cfg.model.vocab_size;
    const int64_t N = int64_t(B) * T;
    auto cpu = make_cpu_backend(DType::F64);
    RowwiseProducts rowwise(*cpu);
    Backend* be = &rowwise;
    Model ref(cfg.model, cfg.residual, *be, B, T), m(cfg.model, cfg.residual, *be, B, T, 1, 4);
    ASSERT_EQ(ref.logits_chunk(), N);  // automatic: a tiny model's logits fit in one chunk
    randomize_weights(ref, 3);
    copy_weights(ref, m);
    std::vector<int32_t> tok, tgt;
    random_tokens(int(N), V, 9, tok, tgt);
    ref.forward(tok.data(), tgt.data(), 0.0);
    const auto all = download(*be, ref.logits());
    for (double scale : {0.0, 1.0}) {
      m.zero_grads();
      m.forward(tok.data(), tgt.data(), scale);
      if (scale == 0) {
        for (double g : download(*be, m.all_gradients())) ASSERT_EQ(g, 0.0);
      }
      // The last chunk (rows 8, 9) first: held after a forward without a loss scale.
      for (int64_t first : {8, 0, 4, 3, 9}) {
        const int64_t rows = std::min<int64_t>(4, N - first);
        const auto got = download(*be, m.logits(first, rows));
        const std::vector<double> exp(all.begin() + first * V, all.begin() + (first + rows) * V);
        EXPECT_EQ(got, exp) << "rows from " << first << " scale " << scale;
      }
      EXPECT_THROW(m.logits(), Error);     // 10 rows, but the head holds 4 at a time
      EXPECT_THROW(m.logits(0, 5), Error);
      EXPECT_THROW(m.logits(8, 3), Error);  // past the last token
      if (scale != 0) m.backward();
    }
  }
}

// The automatic chunk: one chunk while the logits fit the budget, else balanced chunks of
// at most the budget, in multiples of 64 rows when that still fits.
TEST(HeadChunkPolicy, AutomaticChunkFitsTheBudget) {
  EXPECT_EQ(logits_chunk_tokens(10, 23, 8, 0), 10);
  EXPECT_EQ(logits_chunk_tokens(10, 23, 8, 4), 4);
  EXPECT_EQ(logits_chunk_tokens(10, 23, 8, 11), 10);
  for (int64_t V : {50304, 151936})
    for (int64_t N : {1, 1000, 16384, 16385, 1 << 20}) {
      const int64_t c = logits_chunk_tokens(N, V, 2, 0);
      const int64_t fit = int64_t(kLogitsChunkBytes / (double(V) * 2));
      EXPECT_GE(c, 1);
      EXPECT_LE(c, std::min(N, fit)) << V << " " << N;
      if (N <= fit) {
        EXPECT_EQ(c, N);
      }
      // Balanced: as few chunks as the budget allows.
      EXPECT_EQ((N + c - 1) / c, (N + fit - 1) / fit) << V << " " << N;
    }
}

// The activation plan of the 1B shape (configs/1b_standard.json: d 1280, 36 layers,
// micro-batch 16 x 1024) with the GPT-2 vocabulary (50,304: 50,257 padded to 128) and
// the Qwen3 one (151,936), planned at the CUDA backend's dtypes without memory: one chunk
// of all N tokens (the logits [N, V] as the head held them before chunking) against the
// automatic chunk. Prints the BENCHMARKS.md figures.
TEST(HeadChunkPlan, OneBillionPlanBytes) {
  nlohmann::json j = {
      {"model", {{"vocab_size", 151936}, {"d_model", 1280}, {"n_layers", 36}, {"n_heads", 16},
                 {"n_kv_heads", 8}, {"head_dim", 128}, {"d_ff", 5120}, {"context_length", 1024},
                 {"tie_embeddings", true}}},
      {"residual", {{"mode", "standard"}}},
      {"train", {{"micro_batch", 16}, {"seq_len", 1024}, {"warmup_steps", 0}}}};
  auto cpu = make_cpu_backend(DType::F32);
  PlanOnly be(*cpu);
  for (int V : {50304, 151936}) {
    j["model"]["vocab_size"] = V;
    const Config cfg = config_from_json(j, "1b");
    const int B = cfg.train.micro_batch, T = cfg.train.seq_len;
    const int64_t N = int64_t(B) * T;
    Model one(cfg.model, cfg.residual, be, B, T, 1, N), auto_(cfg.model, cfg.residual, be, B, T);
    const size_t before = one.activation_plan().total_bytes();
    const size_t after = auto_.activation_plan().total_bytes();
    const size_t model_bytes = one.parameter_plan().total_bytes() * 3;  // bf16 weights, fp32 grads
    const int64_t c = auto_.logits_chunk();
    EXPECT_LE(double(c) * V * 2, kLogitsChunkBytes);
    if (double(N) * V * 2 <= kLogitsChunkBytes) {  // GPT-2's vocabulary: one chunk fits
      EXPECT_EQ(c, N);
      EXPECT_EQ(after, before);
    } else {
      EXPECT_LT(c, N);
      // The logits buffer shrinks from N x V to c x V; the plan's peak can fall by at
      // most that much (less where another event's buffers become the peak).
      EXPECT_LT(after, before);
      EXPECT_LE(before - after, size_t(N - c) * size_t(V) * 2);
    }
    std::printf(
        "plan bytes, 1B standard, vocab %d, %d x %d tokens: activations %s (logits [%lld, %d]) "
        "-> %s (chunks of %lld tokens), saved %s; parameters + gradients %s\n",
        V, B, T, format_bytes(before).c_str(), (long long)N, V, format_bytes(after).c_str(),
        (long long)c, format_bytes(before - after).c_str(), format_bytes(model_bytes).c_str());
  }
}

}  // namespace
