// routing_identity_test.cpp: identities the routing must satisfy exactly (fp64 CPU):
// - mhar with H = 1 is attnres (same weights give the same loss and gradients);
// - zero queries make every site the uniform mean of its sources;
// - mhar whose heads all see the same query slice, gain slice and source slices has
//   identical per-head logits, and then equals attnres with query q/H;
// - a site never reads a future source, and a source's gradient never reads the sites
//   before it, checked by poisoning;
// - block routing (residual.block_size = s): the sources of site j are v_0, the sums of
//   the completed blocks and the partial sum of the current block, exactly as
//   RoutingLayout enumerates them; with zero queries a site is their uniform mean (the
//   sublayer outputs recorded as their GEMMs write them, the block sums formed here);
//   s = 1 is full routing; the ops' poisoning checks hold for block layouts too.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "engine/forwarding_backend.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;

namespace {

TEST(RoutingIdentity, MharWithOneHeadIsAttnRes) {
  Config a = tiny_config(ResidualMode::AttnRes), m = tiny_config(ResidualMode::Mhar, 1);
  auto be = make_cpu_backend(DType::F64);
  Model ma(a.model, a.residual, *be, 2, 5), mm(m.model, m.residual, *be, 2, 5);
  randomize_weights(ma, 3);
  copy_weights(ma, mm);
  std::vector<int32_t> tok, tgt;
  random_tokens(10, a.model.vocab_size, 5, tok, tgt);
  ma.zero_grads();
  mm.zero_grads();
  const double la = ma.forward(tok.data(), tgt.data(), 1.0);
  const double lm = mm.forward(tok.data(), tgt.data(), 1.0);
  EXPECT_EQ(la, lm);
  ma.backward();
  mm.backward();
  for (auto& p : ma.parameters())
    EXPECT_EQ(download(*be, p.grad), download(*be, mm.parameter(p.name).grad)) << p.name;
}

TEST(RoutingIdentity, ZeroQueriesGiveTheUniformMeanOfSources) {
  for (int heads : {1, 2, 4}) {
    Config c = tiny_config(heads == 1 ? ResidualMode::AttnRes : ResidualMode::Mhar, heads);
    auto be = make_cpu_backend(DType::F64);
    Model m(c.model, c.residual, *be, 2, 5);
    randomize_weights(m, 9);
    for (auto& p : m.parameters())
      if (p.init == Init::Zero) be->zero(p.value);
    std::vector<int32_t> tok, tgt;
    random_tokens(10, c.model.vocab_size, 1, tok, tgt);
    m.forward(tok.data(), tgt.data(), 0.0);
    auto hist = download(*be, m.history());
    const size_t slot = hist.size() / size_t(c.model.n_sources());
    for (int j = 0; j < c.model.n_sites(); ++j) {
      auto x = download(*be, m.site_input(j));
      auto w = m.routing_weights(j);
      for (double a : w) EXPECT_NEAR(a, 1.0 / (j + 1), 1e-15);
      for (size_t e = 0; e < slot; ++e) {
        double mean = 0;
        for (int i = 0; i <= j; ++i) mean += hist[size_t(i) * slot + e];
        EXPECT_NEAR(x[e], mean / (j + 1), 1e-12) << "site " << j << " heads " << heads;
      }
    }
  }
}

// Every sublayer output v_j as its output GEMM writes it into history slot j (before
// block routing adds it into its block's running sum).
class OutputRecorder final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  Tensor history;  // the model's [S, N, d] history, once the model exists
  std::map<int, std::vector<double>> outputs;
  void matmul(Tensor c, Tensor a, Tensor b, bool ta, bool tb, bool acc) override {
    in_.matmul(c, a, b, ta, tb, acc);
    const char *h = static_cast<const char*>(history.data), *p = static_cast<const char*>(c.data);
    if (h && !acc && p >= h && p < h + history.bytes())
      outputs[int((p - h) / history[0].bytes())] = mhar::test::download(in_, c);
  }
};

// The sources of site j by the definition (DESIGN.md section 2): v_0, the sum of each
// completed block of s outputs among v_1..v_j, and the partial sum of the current
// block when it has any outputs.
std::vector<std::vector<double>> block_sources(const std::vector<std::vector<double>>& v, int j,
                                               int s) {
  std::vector<std::vector<double>> out = {v[0]};
  for (int first = 1; first <= j; first += s) {
    std::vector<double> sum(v[0].size(), 0.0);
    for (int i = first; i < first + s && i <= j; ++i)
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += v[size_t(i)][e];
    out.push_back(sum);
  }
  return out;
}

TEST(RoutingIdentity, RoutingLayoutEnumeratesTheBlockSources) {
  for (int S : {1, 2, 5, 9, 73})
    for (int s = 1; s <= std::max(1, S - 1); ++s) {
      const RoutingLayout lay = RoutingLayout::blocks(S, s);
      int64_t next_pair = 0;
      for (int i = 0; i < S; ++i) {
        // Slot i (v_0, or the running sum of v_i's block up to v_i) is read by site i and,
        // when it closes its block (or is v_0), by every later site.
        const bool closes = i == 0 || i % s == 0;
        EXPECT_EQ(lay.last_site(i), closes ? S - 1 : i) << "S " << S << " s " << s << " slot " << i;
        for (int k = i; k <= lay.last_site(i); ++k)
          EXPECT_EQ(lay.pair(i, k), next_pair++) << "pairs are source-major and contiguous";
      }
      EXPECT_EQ(lay.pairs(), next_pair);
      for (int k = 0; k < S; ++k) {
        std::vector<int> want = {0};
        for (int c = s; c <= k; c += s) want.push_back(c);  // completed blocks
        if (k % s) want.push_back(k);                       // the current block so far
        std::vector<int> got;
        for (int t = 0; t < lay.site_sources(k); ++t) {
          got.push_back(lay.site_source(k, t));
          EXPECT_EQ(lay.site_pair(k, t, k / s), lay.pair(got.back(), k));
        }
        EXPECT_EQ(got, want) << "S " << S << " s " << s << " site " << k;
      }
      if (s == 1) {
        EXPECT_EQ(lay.pairs(), int64_t(S) * (S + 1) / 2);
      }
    }
}

TEST(RoutingIdentity, ZeroQueriesGiveTheUniformMeanOfTheBlockSources) {
  for (int s : {1, 2, 3, 4})
    for (int heads : {1, 2}) {
      Config c = tiny_config(heads == 1 ? ResidualMode::AttnRes : ResidualMode::Mhar, heads,
                             true, s);
      auto cpu = make_cpu_backend(DType::F64);
      OutputRecorder be(*cpu);
      Model m(c.model, c.residual, be, 2, 5);
      be.history = m.history();
      randomize_weights(m, 9 + uint64_t(s));
      for (auto& p : m.parameters())
        if (p.init == Init::Zero) be.zero(p.value);
      std::vector<int32_t> tok, tgt;
      random_tokens(10, c.model.vocab_size, 1, tok, tgt);
      m.forward(tok.data(), tgt.data(), 0.0);
      const int S = c.model.n_sites();
      std::vector<std::vector<double>> v = {download(be, m.history()[0])};  // v_0: the embedding
      for (int j = 1; j < S; ++j) {
        ASSERT_EQ(be.outputs.count(j), 1u) << "sublayer output " << j;
        v.push_back(be.outputs[j]);
      }
      for (int j = 0; j < S; ++j) {
        const auto src = block_sources(v, j, s);
        ASSERT_EQ(m.routing_sources(j), int(src.size())) << "s " << s << " site " << j;
        for (double a : m.routing_weights(j)) EXPECT_NEAR(a, 1.0 / double(src.size()), 1e-15);
        const auto x = download(be, m.site_input(j));
        for (size_t e = 0; e < x.size(); ++e) {
          double mean = 0;
          for (const auto& u : src) mean += u[e];
          EXPECT_NEAR(x[e], mean / double(src.size()), 1e-12)
              << "s " << s << " heads " << heads << " site " << j;
        }
      }
    }
}

// Blocks of one output are the outputs themselves: block_size 1 computes exactly what
// full routing (block_size 0) does, loss, logits and every gradient, bit for bit.
TEST(RoutingIdentity, BlocksOfOneAreFullRouting) {
  for (int heads : {1, 4}) {
    const ResidualMode mode = heads == 1 ? ResidualMode::AttnRes : ResidualMode::Mhar;
    Config f = tiny_config(mode, heads, false, 0), b = tiny_config(mode, heads, false, 1);
    auto be = make_cpu_backend(DType::F64);
    Model mf(f.model, f.residual, *be, 2, 5), mb(b.model, b.residual, *be, 2, 5);
    randomize_weights(mf, 21);
    copy_weights(mf, mb);
    std::vector<int32_t> tok, tgt;
    random_tokens(10, f.model.vocab_size, 6, tok, tgt);
    mf.zero_grads();
    mb.zero_grads();
    EXPECT_EQ(mf.forward(tok.data(), tgt.data(), 1.0), mb.forward(tok.data(), tgt.data(), 1.0));
    EXPECT_EQ(download(*be, mf.logits()), download(*be, mb.logits()));
    mf.backward();
    mb.backward();
    for (auto& p : mf.parameters())
      EXPECT_EQ(download(*be, p.grad), download(*be, mb.parameter(p.name).grad)) << p.name;
  }
}

// A backend that asks for depth tiles (backend.h, routing_mix_tile: tiles of k sites from
// site 0, or the counts of `plan` in site order, where given) and holds the layer loop to
// the promise a tiling backend relies on: tiles start where the plan says, with its
// count, and a count of 1 comes as a plain mix; the tile's later sites come next, in order,
// through routing_mix with the same tensors; until then the slots <= the tile's first
// site and their pairs for the tile's sites are left as they were. The same for the
// backward's tiles of k slots (routing_source_backward_tile): in full routing they start
// at slots S-1, S-1-k, ... (but slot 0) with count min(k, slot + 1) and their older slots
// are slot - 1, ...; in a block layout of blocks of s they start at the closed slots c s
// with c % k == k - 1, count k, and their older slots are slot - s, ... (the closed slots
// before it). The tile's older slots come next, in order, through routing_source_backward
// with the same tensors (in a block layout the partial slots between them run their own
// plain calls in between), and until the last of them the site gradients >= the tile's
// first slot, the older slots' rows, inv_rms and pairs with those sites, and ubar's rows
// of those sites are left as they were. The ops themselves are the inner backend's.
class TileAuditor final : public ForwardingBackend {
 public:
  TileAuditor(Backend& inner, int k, std::vector<int> plan = {})
      : ForwardingBackend(inner), k_(k), plan_(std::move(plan)) {}
  int tiles = 0, tiled_sites = 0, lone_sites = 0;
  int back_tiles = 0, back_tiled_slots = 0, back_plain = 0;

  int routing_backward_tile_slots(const RoutingLayout&, int64_t, int) const override { return k_; }
  // The tile of k_ slots the layer loop must start at slot i (0: none), stated here apart
  // from RoutingLayout::back_tile_count, whose rule it checks.
  int tile_count(const RoutingLayout& lay, int i) const {
    if (i < 1) return 0;
    if (lay.block == 1) return (lay.sources - 1 - i) % k_ == 0 ? std::min(k_, i + 1) : 0;
    return i % lay.block == 0 && (i / lay.block) % k_ == k_ - 1 ? k_ : 0;
  }
  void routing_source_backward_tile(Tensor dv, Tensor w, Tensor ub, Tensor gs,
                                    const std::vector<Tensor>& dx, Tensor x, Tensor h, Tensor r,
                                    const RoutingParams& p, const RoutingLayout& lay, int i,
                                    int count, int heads) override {
    EXPECT_EQ(back_next_, -1) << "a backward tile began at slot " << i << " before slot "
                              << back_next_;
    EXPECT_GE(i, 1) << "a backward tile of slot 0 alone";
    EXPECT_EQ(count, tile_count(lay, i)) << "backward tile at slot " << i;
    ++back_tiles;
    in_.routing_source_backward_tile(dv, w, ub, gs, dx, x, h, r, p, lay, i, count, heads);
    back_first_ = i;
    back_end_ = i - count * lay.block;
    back_next_ = count > 1 ? i - lay.block : -1;
    back_ptrs_ = {w.data, ub.data, h.data, r.data, gs.data};
    back_snapshot_ = back_state(w, ub, dx, h, r, lay);
  }
  void routing_source_backward(Tensor dv, Tensor w, Tensor ub, Tensor gs,
                               const std::vector<Tensor>& dx, Tensor x, Tensor v, Tensor r,
                               const RoutingParams& p, const RoutingLayout& lay, int i,
                               int heads) override {
    if (back_next_ < 0 || i > back_next_) {
      EXPECT_EQ(tile_count(lay, i), 0) << "slot " << i << " starts a backward tile but came as a plain call";
      EXPECT_TRUE(back_next_ < 0 || (i < back_first_ && lay.block > 1))
          << "slot " << i << " came inside the backward tile at slot " << back_first_;
      ++back_plain;
    } else {
      EXPECT_EQ(i, back_next_) << "slot " << i << " out of its backward tile's order";
      // The tile's tensors, as rows of the same history and inv_rms.
      EXPECT_EQ(w.data, back_ptrs_[0]);
      EXPECT_EQ(ub.data, back_ptrs_[1]);
      EXPECT_EQ(gs.data, back_ptrs_[4]);
      EXPECT_EQ(v.data, back_row(back_ptrs_[2], v, i));
      EXPECT_EQ(r.data, back_row(back_ptrs_[3], r, i));
      Tensor hist(const_cast<void*>(back_ptrs_[2]), v.dtype, {lay.sources, v.dim(0), v.dim(1)});
      Tensor rms(const_cast<void*>(back_ptrs_[3]), r.dtype, {lay.sources, r.numel()});
      const auto now = back_state(w, ub, dx, hist, rms, lay);
      for (const auto& [key, value] : back_snapshot_) {
        const int kind = std::min(key.first, 2), slot = key.first >= 2 ? key.first - 2 : -1;
        if (slot > i) continue;  // a slot done since: its call wrote its own pairs
        EXPECT_EQ(now.at(key), value)
            << "backward tile at slot " << back_first_ << ": " << kBackWhat[kind] << " "
            << (slot >= 0 ? std::to_string(slot) + " " : "") << key.second
            << " changed before slot " << i;
      }
      ++back_tiled_slots;
      back_next_ = i - lay.block > back_end_ ? i - lay.block : -1;
    }
    in_.routing_source_backward(dv, w, ub, gs, dx, x, v, r, p, lay, i, heads);
  }

  int routing_tile_sites(const RoutingLayout&, int64_t, int) const override { return k_; }
  std::vector<int> routing_tile_plan(const RoutingLayout& lay, int64_t d,
                                     int heads) const override {
    return plan_.empty() ? Backend::routing_tile_plan(lay, d, heads) : plan_;
  }
  // The count of the plan's tile that starts at `site` (0 inside a tile).
  int tile_at(const RoutingLayout& lay, int site) const {
    int j = 0;
    for (int count : routing_tile_plan(lay, 0, 0)) {
      if (j == site) return count;
      j += count;
    }
    return 0;
  }
  void routing_mix_tile(Tensor x, Tensor w, Tensor h, const RoutingLayout& lay, int site,
                        int count, int heads) override {
    audit_tile(w, h, lay, site, count);
    in_.routing_mix_tile(x, w, h, lay, site, count, heads);
  }
  void routing_mix_tile_rmsnorm(Tensor x, Tensor y, Tensor r, Tensor w, Tensor h,
                                const RoutingLayout& lay, int site, int count, int heads,
                                Tensor norm_w, double eps) override {
    audit_tile(w, h, lay, site, count);
    in_.routing_mix_tile_rmsnorm(x, y, r, w, h, lay, site, count, heads, norm_w, eps);
  }
  void routing_mix(Tensor x, Tensor w, Tensor h, const RoutingLayout& lay, int site,
                   int heads) override {
    audit_mix(w, h, lay, site);
    in_.routing_mix(x, w, h, lay, site, heads);
  }
  void routing_mix_rmsnorm(Tensor x, Tensor y, Tensor r, Tensor w, Tensor h,
                           const RoutingLayout& lay, int site, int heads, Tensor norm_w,
                           double eps) override {
    audit_mix(w, h, lay, site);
    in_.routing_mix_rmsnorm(x, y, r, w, h, lay, site, heads, norm_w, eps);
  }

 private:
  void audit_tile(Tensor w, Tensor h, const RoutingLayout& lay, int site, int count) {
    EXPECT_EQ(next_, -1) << "a tile began at site " << site << " before site " << next_;
    EXPECT_GT(tile_at(lay, site), 1) << "tile at site " << site;
    EXPECT_EQ(count, tile_at(lay, site)) << "tile at site " << site;
    ++tiles;
    first_ = site;
    end_ = site + count;
    next_ = count > 1 ? site + 1 : -1;
    w_ = w.data;
    h_ = h.data;
    snapshot_ = old_state(w, h, lay);
  }
  void audit_mix(Tensor w, Tensor h, const RoutingLayout& lay, int site) {
    EXPECT_LE(tile_at(lay, site), 1) << "site " << site << " starts a tile but came as a plain mix";
    if (tile_at(lay, site) == 1) {
      EXPECT_EQ(next_, -1) << "site " << site << " (a tile of one) came inside a tile";
      ++lone_sites;
    } else {
      EXPECT_EQ(site, next_) << "site " << site << " out of its tile's order";
    }
    if (site == next_) {
      EXPECT_EQ(w.data, w_);
      EXPECT_EQ(h.data, h_);
      // Slot rows, and the pairs of this site and the later ones (earlier sites'
      // pairs have been normalised by their mixes).
      const auto now = old_state(w, h, lay);
      for (const auto& [key, value] : snapshot_)
        if (key.second < 0 || key.second >= site) {
          EXPECT_EQ(now.at(key), value)
              << "slot " << key.first
              << (key.second < 0 ? "" : " pair for site " + std::to_string(key.second))
              << " changed before site " << site << " of the tile at " << first_;
        }
      ++tiled_sites;
      next_ = site + 1 < end_ ? site + 1 : -1;
    }
  }

  // The slots <= first_ (key (i, -1)) and their pairs for the tile's later sites (key
  // (i, k): raw logits until site k's mix).
  using State = std::map<std::pair<int, int>, std::vector<double>>;
  State old_state(Tensor w, Tensor h, const RoutingLayout& lay) {
    State out;
    for (int i = 0; i <= first_; ++i) {
      if (lay.last_site(i) < first_) continue;  // a partial slot of an earlier site
      out[{i, -1}] = mhar::test::download(in_, h[i]);
      for (int k = first_ + 1; k < end_ && k <= lay.last_site(i); ++k)
        out[{i, k}] = mhar::test::download(in_, w[lay.pair(i, k)]);
    }
    return out;
  }
  int k_;
  std::vector<int> plan_;
  int first_ = -1, end_ = -1, next_ = -1;
  const void *w_ = nullptr, *h_ = nullptr;
  State snapshot_;

  // What the backward tile at back_first_ relies on, keyed (kind, index): (0, k) the site
  // gradients k >= back_first_, (1, k) ubar's rows of those sites, and for each older
  // slot i (2 + i, k) its pair with site k >= back_first_, (2 + i, -1) its row and
  // inv_rms. A slot's entries are checked until its own call, which writes its pairs.
  static constexpr const char* kBackWhat[] = {"site gradient", "ubar row", "slot"};
  State back_state(Tensor w, Tensor ub, const std::vector<Tensor>& dx, Tensor h, Tensor r,
                   const RoutingLayout& lay) {
    State out;
    const int S = lay.sites;
    for (int k = back_first_; k < S; ++k) {
      out[{0, k}] = mhar::test::download(in_, dx[size_t(k)]);
      out[{1, k}] = mhar::test::download(in_, ub[k]);
    }
    for (int i = back_first_ - lay.block; i > back_end_; i -= lay.block) {
      std::vector<double> row = mhar::test::download(in_, h[i]), rms = mhar::test::download(in_, r[i]);
      row.insert(row.end(), rms.begin(), rms.end());
      out[{2 + i, -1}] = row;
      for (int k = back_first_; k <= lay.last_site(i); ++k)
        out[{2 + i, k}] = mhar::test::download(in_, w[lay.pair(i, k)]);
    }
    return out;
  }
  static const void* back_row(const void* base, const Tensor& row, int i) {
    return static_cast<const char*>(base) + size_t(i) * row.bytes();
  }
  int back_first_ = -1, back_end_ = -1, back_next_ = -1;
  std::array<const void*, 5> back_ptrs_{};
  State back_snapshot_;
};

// Depth tiles change nothing a model computes: with a backend that tiles the mix and the
// backward (its contract audited above), loss, logits and every gradient equal the
// untiled model's bit for bit,
// for tiles of 2 and 3 sites, full and block routing, one and several heads.
TEST(RoutingIdentity, DepthTilesKeepTheLayerLoopsPromise) {
  // k = 0: a plan of tiles that grow with the depth (1, 2, 3, ...), as the CUDA
  // backend's plan does.
  for (int k : {2, 3, 0})
    for (int s : {0, 2, 3})
      for (int heads : {1, 4}) {
        const ResidualMode mode = heads == 1 ? ResidualMode::AttnRes : ResidualMode::Mhar;
        Config c = tiny_config(mode, heads, false, s);
        auto cpu = make_cpu_backend(DType::F64);
        const int S = c.model.n_sites();
        std::vector<int> plan;
        for (int j = 0, count = 1; k == 0 && j < S; j += plan.back(), ++count)
          plan.push_back(std::min(count, S - j));
        TileAuditor tiled_be(*cpu, k == 0 ? 2 : k, plan);
        Model plain(c.model, c.residual, *cpu, 2, 5), tiled(c.model, c.residual, tiled_be, 2, 5);
        randomize_weights(plain, 31);
        copy_weights(plain, tiled);
        std::vector<int32_t> tok, tgt;
        random_tokens(10, c.model.vocab_size, 8, tok, tgt);
        plain.zero_grads();
        tiled.zero_grads();
        const std::string tag = "k " + std::to_string(k) + " block " + std::to_string(s) +
                                " heads " + std::to_string(heads);
        EXPECT_EQ(plain.forward(tok.data(), tgt.data(), 1.0),
                  tiled.forward(tok.data(), tgt.data(), 1.0)) << tag;
        const std::vector<int> want = tiled_be.routing_tile_plan(RoutingLayout::full(S), 0, 0);
        EXPECT_EQ(tiled_be.tiles,
                  std::count_if(want.begin(), want.end(), [](int count) { return count > 1; }))
            << tag;
        EXPECT_EQ(tiled_be.lone_sites, std::count(want.begin(), want.end(), 1)) << tag;
        EXPECT_EQ(tiled_be.tiles + tiled_be.tiled_sites + tiled_be.lone_sites, S) << tag;
        EXPECT_EQ(download(*cpu, plain.logits()), download(*cpu, tiled.logits())) << tag;
        plain.backward();
        tiled.backward();
        // Backward tiles start at slots S-1, S-1-k, ... but slot 0 (full routing), at the
        // closed slots c s with c % k == k - 1 (blocks of s); the rest are plain.
        int back_tiles = 0, back_tiled = 0;
        for (int i = 1; i < S; ++i)
          if (const int count = tiled_be.tile_count(RoutingLayout::blocks(S, std::max(s, 1)), i))
            ++back_tiles, back_tiled += count - 1;
        EXPECT_EQ(tiled_be.back_tiles, back_tiles) << tag;
        EXPECT_EQ(tiled_be.back_tiled_slots, back_tiled) << tag;
        EXPECT_EQ(tiled_be.back_tiles + tiled_be.back_tiled_slots + tiled_be.back_plain, S) << tag;
        for (auto& p : plain.parameters())
          EXPECT_EQ(download(*cpu, p.grad), download(*cpu, tiled.parameter(p.name).grad))
              << p.name << " " << tag;
      }
}

// Op-level fixture: S sources/sites, history [S, N, d], one query and gain per site, on the
// fp64 backend.
struct RoutingOp {
  std::unique_ptr<Backend> be = make_cpu_backend(DType::F64);
  int S, N, d;
  RoutingLayout lay;
  std::vector<double> hist, inv_rms, weights;
  std::vector<std::vector<double>> query, gain;  // per site
  RoutingOp(int S_, int N_, int d_, int block = 1)
      : S(S_), N(N_), d(d_), lay(RoutingLayout::blocks(S_, block)) {
    query.assign(size_t(S), std::vector<double>(size_t(d)));
    gain = query;
  }
  Tensor t(std::vector<double>& v, std::initializer_list<int64_t> shape) {
    return Tensor(v.data(), DType::F64, shape);
  }
  RoutingParams params() {
    RoutingParams p;
    for (int k = 0; k < S; ++k) {
      p.query.push_back(t(query[size_t(k)], {d}));
      p.gain.push_back(t(gain[size_t(k)], {d}));
    }
    return p;
  }
  // Logits of sources 0..last, then site `site`'s mix; returns x [N, d].
  std::vector<double> forward(int site, int heads, int last_source) {
    inv_rms.assign(size_t(S) * N, 0);
    weights.assign(size_t(lay.pairs()) * heads * N, 0);
    const RoutingParams p = params();
    for (int i = 0; i <= last_source; ++i)
      be->routing_source_logits(t(weights, {lay.pairs(), heads, N}), t(inv_rms, {S, N})[i],
                                t(hist, {S, N, d})[i], p, lay, i, heads, 1e-6);
    std::vector<double> x(size_t(N) * d, 0);
    be->routing_mix(t(x, {N, d}), t(weights, {lay.pairs(), heads, N}), t(hist, {S, N, d}), lay,
                    site, heads);
    return x;
  }
  double weight(int i, int site, int h, int n, int heads) const {
    return weights[(size_t(lay.pair(i, site)) * heads + h) * N + n];
  }
};

TEST(RoutingIdentity, SameSliceInEveryHeadEqualsAttnResWithQueryOverH) {
  const int S = 5, N = 7, d = 12, H = 3, hs = d / H;
  RoutingOp op(S, N, d);
  std::mt19937_64 rng(2);
  std::normal_distribution<double> nd;
  // Sources, query and gain repeat the same hs-wide slice in every head.
  op.hist.resize(size_t(S) * N * d);
  for (int i = 0; i < S; ++i)
    for (int n = 0; n < N; ++n) {
      std::vector<double> slice(hs);
      for (double& x : slice) x = nd(rng);
      for (int c = 0; c < d; ++c) op.hist[(size_t(i) * N + n) * d + c] = slice[c % hs];
    }
  std::vector<double> qs(hs), gs(hs);
  for (int c = 0; c < hs; ++c) qs[c] = nd(rng), gs[c] = 1 + 0.3 * nd(rng);
  for (int k = 0; k < S; ++k)
    for (int c = 0; c < d; ++c) op.query[k][c] = qs[c % hs], op.gain[k][c] = gs[c % hs];
  const int site = S - 1;
  auto x_mhar = op.forward(site, H, site);
  std::vector<double> w_mhar = op.weights;
  for (auto& q : op.query)
    for (double& x : q) x /= H;  // attnres sums the logit over all H slices
  auto x_attn = op.forward(site, 1, site);
  for (size_t e = 0; e < x_mhar.size(); ++e) EXPECT_NEAR(x_mhar[e], x_attn[e], 1e-13);
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < S; ++i)
        EXPECT_NEAR(w_mhar[(size_t(op.lay.pair(i, site)) * H + h) * N + n],
                    op.weight(i, site, 0, n, 1), 1e-14);
  // And the weights are far from uniform, so the identity is not the trivial one.
  double spread = 0;
  for (int i = 0; i < S; ++i) spread = std::max(spread, std::fabs(op.weight(i, site, 0, 0, 1) - 1.0 / S));
  EXPECT_GT(spread, 0.05);
}

TEST(RoutingIdentity, SiteNeverReadsAFutureSource) {
  const int S = 7, N = 6, d = 8;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int block : {1, 2, 3})
  for (int heads : {1, 2, 4})
    for (int site = 0; site < S - 1; ++site) {
      RoutingOp op(S, N, d, block);
      std::mt19937_64 rng(site * 10 + heads);
      std::normal_distribution<double> nd;
      op.hist.resize(size_t(S) * N * d);
      for (double& x : op.hist) x = nd(rng);
      for (int k = 0; k < S; ++k)
        for (int c = 0; c < d; ++c) op.query[k][c] = nd(rng), op.gain[k][c] = 1 + 0.2 * nd(rng);
      auto clean = op.forward(site, heads, S - 1);
      // Poison every future slot; the site's own logits come from sources <= site only.
      for (size_t e = size_t(site + 1) * N * d; e < op.hist.size(); ++e) op.hist[e] = nan;
      auto poisoned = op.forward(site, heads, site);
      EXPECT_EQ(clean, poisoned) << "site " << site << " heads " << heads << " block " << block;
    }
}

TEST(RoutingIdentity, SourceGradientReadsOnlyLaterSites) {
  const int S = 6, N = 5, d = 8;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int block : {1, 2, 3})
  for (int heads : {1, 2, 4})
    for (int source = 0; source < S; ++source) {
      RoutingOp op(S, N, d, block);
      std::mt19937_64 rng(source * 10 + heads + 100);
      std::normal_distribution<double> nd;
      op.hist.resize(size_t(S) * N * d);
      for (double& x : op.hist) x = nd(rng);
      for (int k = 0; k < S; ++k)
        for (int c = 0; c < d; ++c) op.query[k][c] = nd(rng), op.gain[k][c] = 1 + 0.2 * nd(rng);
      // The forward of every site on one set of logits: x of every site, softmax weights.
      const RoutingLayout& lay = op.lay;
      op.weights.assign(size_t(lay.pairs()) * heads * N, 0);
      op.inv_rms.assign(size_t(S) * N, 0);
      RoutingParams p = op.params();
      std::vector<double> x(size_t(S) * N * d);
      for (int i = 0; i < S; ++i) {
        op.be->routing_source_logits(op.t(op.weights, {lay.pairs(), heads, N}),
                                     op.t(op.inv_rms, {S, N})[i], op.t(op.hist, {S, N, d})[i],
                                     p, lay, i, heads, 1e-6);
        op.be->routing_mix(op.t(x, {S, N, d})[i], op.t(op.weights, {lay.pairs(), heads, N}),
                           op.t(op.hist, {S, N, d}), lay, i, heads);
      }
      std::vector<double> dx(size_t(S) * N * d), ubar(size_t(S) * heads * N);
      for (double& e : dx) e = nd(rng);
      // ubar of sites > source, as their own source backward would have left it.
      for (int k = source + 1; k < S; ++k)
        for (int h = 0; h < heads; ++h)
          for (int n = 0; n < N; ++n) {
            double acc = 0;
            for (int c = h * d / heads; c < (h + 1) * d / heads; ++c)
              acc += dx[(size_t(k) * N + n) * d + c] * x[(size_t(k) * N + n) * d + c];
            ubar[(size_t(k) * heads + h) * N + n] = acc;
          }
      auto run = [&](std::vector<double> dxs, std::vector<double> ub, std::vector<double> w) {
        std::vector<double> dv(size_t(N) * d, 0), gsum(size_t(S) * d, 0);
        op.be->routing_source_backward(
            op.t(dv, {N, d}), op.t(w, {lay.pairs(), heads, N}), op.t(ub, {S, heads, N}),
            op.t(gsum, {1, S, d}), routing_rows(op.t(dxs, {S, N, d})), op.t(x, {S, N, d})[source],
            op.t(op.hist, {S, N, d})[source], op.t(op.inv_rms, {S, N})[source], p, lay,
            source, heads);
        dv.insert(dv.end(), gsum.begin(), gsum.end());
        return dv;
      };
      const auto clean = run(dx, ubar, op.weights);
      for (double e : clean) EXPECT_TRUE(std::isfinite(e));
      // Poison the input gradients, ubar rows and weight pairs of the sites before it and
      // of the sites after the last that reads it (a partial block sum is read by its own
      // site only), and the pairs of other sources.
      auto dx_p = dx, ub_p = ubar, w_p = op.weights;
      for (int k = 0; k < S; ++k)
        if (k < source || k > lay.last_site(source)) {
          for (size_t e = size_t(k) * N * d; e < size_t(k + 1) * N * d; ++e) dx_p[e] = nan;
          for (size_t e = size_t(k) * heads * N; e < size_t(k + 1) * heads * N; ++e) ub_p[e] = nan;
        }
      for (int i = 0; i < S; ++i)
        for (int k = i; k <= lay.last_site(i); ++k)
          if (i != source)
            for (int e = 0; e < heads * N; ++e)
              w_p[size_t(lay.pair(i, k)) * heads * N + e] = nan;
      EXPECT_EQ(clean, run(dx_p, ub_p, w_p))
          << "source " << source << " heads " << heads << " block " << block;
    }
}

}  // namespace
