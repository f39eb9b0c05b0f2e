// routing_cudatest.cpp: CUDA depth routing against the CPU reference, op by op, through a
// whole step's worth of calls: the logits of every source, the mix of every site, the
// backward of every source (last to first), then the query/gain gradients. Shapes cover
// H = 1..16 and H > 32, head sizes that are and are not multiples of 8 (the segmented-scan
// and the head-by-head warp sums), heads that span a lane's chunk rows (d 640, 1280),
// d up to 2048 (8 chunks per lane), token counts that are and are not multiples of 4 (the
// key-gradient kernel's vector path), and 1..9 sources; block routing's layouts
// (partial block sums read by their own site only, closed ones by every later site)
// from blocks of 2 to one block of all outputs, and the 1B config's 8 blocks of 9; the
// span layout (d % 256 == 0, H dividing 32) for every H and row width it covers. The
// logits and the backward run again inside a bound pass (a model's op scratch) at
// RoutingKernel::QgTables version 2, where every site's q*g comes from the pass's tables
// (QgPassTables, cuda/kernels.h): the unbound calls' bits, also when a second set of
// parameters takes the pass's tables over, and when the first takes them back.
#include <gtest/gtest.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "tests/cuda_test_util.h"

namespace mhar::test {
namespace {

class RoutingParity : public CudaParity {
 protected:
  // RoutingKernel::QgTables version 2 (a bound pass's q*g tables) while in scope.
  struct QgPassTablesOn {
    QgPassTablesOn() { cuda::routing_set_kernel_version(cuda::RoutingKernel::QgTables, 2); }
    ~QgPassTablesOn() { cuda::routing_set_kernel_version(cuda::RoutingKernel::QgTables, 0); }
    QgPassTablesOn(const QgPassTablesOn&) = delete;
    QgPassTablesOn& operator=(const QgPassTablesOn&) = delete;
  };
  // Depth tiles (routing_mix_tile; `plan` their counts in site order, as
  // Backend::routing_tile_plan gives them) as the layer loop runs them: slot j is written
  // just before site j's mix and the later slots hold NaN, so a tile that read ahead would
  // show; x and the normalised weights against the CPU's plain
  // mixes (xs.c, weights.c). Then a tile cut short: slot 0 rewritten and its logits made
  // again (the next forward) before site 1's mix, which must see the new slot.
  void check_tiles(const std::string& tag, const std::vector<int>& plan, const RoutingLayout& lay,
                   int64_t N, int64_t d, int H, Pair& history,
                   const std::vector<double>& raw_logits, Pair& xs, Pair& weights,
                   const RoutingParams& pc, const RoutingParams& pg, double eps) {
    const int S = lay.sites;
    const std::vector<double> clean = history.c.get();
    Buffer hist(*gpu, DType::BF16, {S, N, d}), x(*gpu, DType::BF16, {S, N, d});
    Buffer w(*gpu, DType::F32, {lay.pairs(), H, N});
    // The consumers' norms (normed steps): outputs and one weight row.
    Buffer y(*gpu, DType::BF16, {S, N, d}), rstd(*gpu, DType::F32, {S, N});
    const Pair norm_w = random_pair(DType::BF16, {d});
    // The count of the tile that starts at each site (0 inside a tile).
    std::vector<int> tile_at(size_t(S), 0);
    for (int j = 0, t = 0; j < S; j += plan[size_t(t++)]) tile_at[size_t(j)] = plan[size_t(t)];
    // The step's mixes from the raw logits, each slot written just before its site's mix.
    // normed: with the consumers' norms as the routed scheme calls them (a tile's first
    // site by routing_mix_tile_rmsnorm, the others by routing_mix_rmsnorm).
    auto mix_step = [&](bool normed = false) {
      hist.poison();
      x.poison();
      y.poison();
      rstd.poison();
      w.set(raw_logits);
      for (int j = 0; j < S; ++j) {
        gpu->upload(hist.t()[j], clean.data() + size_t(j) * size_t(N * d));
        if (tile_at[size_t(j)] > 1 && normed) {
          gpu->routing_mix_tile_rmsnorm(x.t()[j], y.t()[j], rstd.t()[j], w, hist, lay, j,
                                        tile_at[size_t(j)], H, norm_w.g, eps);
        } else if (tile_at[size_t(j)] > 1) {
          gpu->routing_mix_tile(x.t()[j], w, hist, lay, j, tile_at[size_t(j)], H);
        } else if (normed) {
          gpu->routing_mix_rmsnorm(x.t()[j], y.t()[j], rstd.t()[j], w, hist, lay, j, H, norm_w.g,
                                   eps);
        } else {
          gpu->routing_mix(x.t()[j], w, hist, lay, j, H);
        }
      }
    };
    mix_step();
    expect_close("routing_mix_tile x " + tag, x, xs.c, kTolBf16Output);
    expect_close("routing_mix_tile weights " + tag, w, weights.c, kTolF32Output);
    // Every kernel-lab version of the tile and finish kernels
    // (cuda::routing_set_kernel_version) does the same operations per output value in the
    // same order: the same bits as the default's, x, weights and therefore the finish
    // kernels' partials alike.
    {
      const std::vector<double> x_default = x.get(), w_default = w.get();
      // The tile kernel's versions, then the finish kernel's (the tile's later sites).
      for (const auto& [kernel, name] : {std::pair{cuda::RoutingKernel::MixTile, "tile"},
                                         std::pair{cuda::RoutingKernel::MixFinish, "finish"}}) {
        const int versions = cuda::routing_kernel_versions(kernel);
        for (int version = 1; version <= versions; ++version) {
          cuda::routing_set_kernel_version(kernel, version);
          mix_step();
          const std::vector<double> xv = x.get(), wv = w.get();
          int64_t x_diff = 0, w_diff = 0;
          for (size_t e = 0; e < xv.size(); ++e) x_diff += !(xv[e] == x_default[e]);
          for (size_t e = 0; e < wv.size(); ++e) w_diff += !(wv[e] == w_default[e]);
          EXPECT_EQ(x_diff, 0) << name << " kernel v" << version << " x " << tag;
          EXPECT_EQ(w_diff, 0) << name << " kernel v" << version << " weights " << tag;
        }
        cuda::routing_set_kernel_version(kernel, 0);
      }
    }
    // The mix with its consumer's norm (routing_mix_rmsnorm, and routing_mix_tile_rmsnorm
    // at a tile's first site, as the routed scheme calls them): x and the weights
    // routing_mix's bits, y and rstd those of rmsnorm_forward of that x, for every finish
    // version (4 and 6 fuse the norm into their pass, the others run the two ops) and every
    // tile version (5 fuses it).
    {
      Buffer y_ref(*gpu, DType::BF16, {S, N, d}), rstd_ref(*gpu, DType::F32, {S, N});
      mix_step();
      for (int j = 0; j < S; ++j)
        gpu->rmsnorm_forward(y_ref.t()[j], rstd_ref.t()[j], x.t()[j], norm_w.g, eps);
      const std::vector<std::vector<double>> want = {x.get(), w.get(), y_ref.get(), rstd_ref.get()};
      for (const auto& [kernel, name] : {std::pair{cuda::RoutingKernel::MixFinish, "finish"},
                                         std::pair{cuda::RoutingKernel::MixTile, "tile"}}) {
        const int versions = cuda::routing_kernel_versions(kernel);
        const int norms = cuda::routing_kernel_versions(cuda::RoutingKernel::MixNorm);
        for (int run = 0; run < (versions + 1) * norms; ++run) {
          // Versions 0 (the default) .. versions, each at every MixNorm version (1 the
          // norm on its own, 2 fused in the finishes and the tile kernel, 3 in the
          // finishes only).
          const int version = run / norms, norm_version = 1 + run % norms;
          cuda::routing_set_kernel_version(kernel, version);
          cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, norm_version);
          mix_step(true);
          const std::vector<std::vector<double>> got = {x.get(), w.get(), y.get(), rstd.get()};
          const char* names[] = {"x", "weights", "y", "rstd"};
          for (size_t o = 0; o < got.size(); ++o) {
            int64_t diff = 0;
            for (size_t e = 0; e < got[o].size(); ++e) diff += !(got[o][e] == want[o][e]);
            EXPECT_EQ(diff, 0) << "routing_mix_rmsnorm " << names[o] << ", " << name << " v"
                               << version << ", norm v" << norm_version << " " << tag;
          }
        }
        cuda::routing_set_kernel_version(kernel, 0);
      }
      cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, 0);
    }
    if (S < 2) return;
    // Cut short: slot 0 scaled by 3 (its RMS, logits and share of every mix change).
    std::vector<double> changed = clean;
    for (int64_t e = 0; e < N * d; ++e) changed[size_t(e)] *= 3.0;
    Buffer inv_rms_g(*gpu, DType::F32, {N}), inv_rms_c(*cpu, DType::F32, {N});
    Buffer x1(*cpu, DType::F32, {N, d}), wc(*cpu, DType::F32, {lay.pairs(), H, N});
    Buffer hc(*cpu, DType::F32, {S, N, d});
    hc.set(changed);
    wc.set(raw_logits);
    hist.set(clean);
    w.set(raw_logits);
    gpu->routing_mix_tile(x.t()[0], w, hist, lay, 0, std::min(std::max(plan[0], 2), S), H);
    gpu->upload(hist.t()[0], changed.data());
    gpu->routing_source_logits(w, inv_rms_g, hist.t()[0], pg, lay, 0, H, eps);
    cpu->routing_source_logits(wc, inv_rms_c, hc.t()[0], pc, lay, 0, H, eps);
    gpu->routing_mix(x.t()[1], w, hist, lay, 1, H);
    cpu->routing_mix(x1, wc, hc, lay, 1, H);
    std::vector<double> got(size_t(N * d));
    gpu->download(got.data(), x.t()[1]);
    expect_close("routing_mix after a tile cut short " + tag, got, x1.get(), kTolBf16Output);
  }

  // The backward's outputs of one run, compared bit for bit across kernel-lab versions.
  struct BackwardBits {
    std::vector<double> dv, ubar, weights, gsum;
    void expect_same(const BackwardBits& o, const std::string& what) const {
      auto diff = [](const std::vector<double>& a, const std::vector<double>& b) {
        int64_t n = 0;
        for (size_t e = 0; e < a.size(); ++e)
          n += !(a[e] == b[e]) && !(a[e] != a[e] && b[e] != b[e]);
        return n;
      };
      EXPECT_EQ(diff(dv, o.dv), 0) << what << " dv";
      EXPECT_EQ(diff(ubar, o.ubar), 0) << what << " ubar";
      EXPECT_EQ(diff(weights, o.weights), 0) << what << " ds*r";
      EXPECT_EQ(diff(gsum, o.gsum), 0) << what << " key grads";
    }
  };

  static const char* kernel_name(cuda::RoutingKernel kernel) {
    return kernel == cuda::RoutingKernel::BackwardPair   ? "pair"
           : kernel == cuda::RoutingKernel::KeyGrad      ? "key grad"
           : kernel == cuda::RoutingKernel::SourceFinish ? "finish"
                                                         : "value";
  }

  // Every kernel-lab version of the backward's `kernels` (BackwardPair, SourceValue,
  // KeyGrad, SourceFinish): the bits of `run()` at the defaults wherever
  // cuda::routing_backward_sum_order says the sums run in the defaults' order, else `close`
  // (the CPU reference's bounds: row parts sum each head's dot product in another order,
  // the key-gradient versions each key gradient, pair versions 12-13 their tensor cores,
  // source-finish versions 2-4 each key row).
  // Then every version again with the backward's one-wave grids capped at one block
  // (cuda::routing_set_grid_cap): each warp takes several tokens, through the kernels'
  // token loops and the stream versions' cursor across token boundaries, and must still
  // give the defaults' bits (or, reordered, stay within the CPU's bounds). Returns the
  // defaults' outputs.
  template <class Run, class Close>
  BackwardBits expect_versions_same_bits(const std::string& tag, int64_t d, int H,
                                         std::initializer_list<cuda::RoutingKernel> kernels,
                                         Run&& run, Close&& close) {
    const BackwardBits base = run();
    const int base_order = cuda::routing_backward_sum_order(d, H);
    for (const bool one_block : {false, true}) {
      const int cap_before = cuda::routing_set_grid_cap(one_block ? 1 : 0);
      for (cuda::RoutingKernel kernel : kernels) {
        for (int version = 1; version <= cuda::routing_kernel_versions(kernel); ++version) {
          cuda::routing_set_kernel_version(kernel, version);
          const std::string what = tag + (one_block ? ", one block, " : ", ") +
                                   kernel_name(kernel) + " kernel v" + std::to_string(version);
          if (cuda::routing_backward_sum_order(d, H) == base_order) {
            run().expect_same(base, what);
          } else {
            std::printf("REORDERED %s: against the CPU\n", what.c_str());
            close(run(), what);
          }
        }
        cuda::routing_set_kernel_version(kernel, 0);
      }
      cuda::routing_set_grid_cap(cap_before);
    }
    return base;
  }

  // Key-gradient slabs summed (the GPU's and the CPU's slab counts differ).
  static std::vector<double> slab_sums(const std::vector<double>& g, int64_t slabs, size_t n) {
    std::vector<double> out(n, 0.0);
    for (int64_t r = 0; r < slabs; ++r)
      for (size_t e = 0; e < n; ++e) out[e] += g[size_t(r) * n + e];
    return out;
  }

  // A backward's outputs against the CPU's plain backward.
  void expect_backward_close(const std::string& what, const BackwardBits& got, Pair& dv,
                             Pair& ubar, Pair& weights, Pair& gsum) {
    const size_t n = size_t(gsum.c.t().dim(1) * gsum.c.t().dim(2));
    expect_close(what + " dv", got.dv, dv.c.get(), kTolBf16Output);
    expect_close(what + " ubar", got.ubar, ubar.c.get(), kTolF32Output);
    expect_close(what + " ds*r", got.weights, weights.c.get(), kTolF32Output);
    expect_close(what + " key grads", slab_sums(got.gsum, 8, n),
                 slab_sums(gsum.c.get(), gsum.c.t().dim(0), n), kTolF32Output);
  }

  // Backward depth tiles (routing_source_backward_tile of k slots where
  // RoutingLayout::back_tile_count starts them: full routing from S-1, S-1-k, ... but slot
  // 0, block layouts at closed slots, paired with the closed slots before them) as the
  // layer loops run them, from the same normalised weights (`mixed`) and site gradients as
  // the plain backward: dv, ubar, ds*r and the key-gradient slab sums against the CPU's
  // plain backward. Where the backend tiles (unfused slots: read by more than
  // routing_fused_key_max_sites() sites), the site gradients >= the tile's first slot
  // hold NaN until the tile ends, so an older slot of the tile that read them again
  // instead of its partial gradient would show; in a block layout the partial slots
  // between the tile's slots run their plain calls in between, as in the layer loop.
  void check_back_tiles(const std::string& tag, int k, const RoutingLayout& lay, int64_t N,
                        int64_t d, int H, Pair& history, Pair& xs, Pair& inv_rms, Pair& site_dx,
                        const std::vector<double>& mixed, const RoutingParams& pg, Pair& dv,
                        Pair& ubar, Pair& weights, Pair& gsum) {
    const int S = lay.sites;
    Buffer w(*gpu, DType::F32, {lay.pairs(), H, N}), ub(*gpu, DType::F32, {S, H, N});
    Buffer gs(*gpu, DType::F32, {8, S, d}), dvt(*gpu, DType::BF16, {S, N, d});
    const std::vector<Tensor> rows = routing_rows(site_dx.g.t());
    const std::vector<double> dx_clean = site_dx.c.get();
    const std::vector<double> nan_row(size_t(N * d), std::nan(""));
    const int fused_limit = cuda::routing_fused_key_max_sites();
    int tiles = 0;
    auto run = [&] {
      w.set(mixed);
      ub.poison();
      dvt.poison();
      gs.set(std::vector<double>(size_t(8 * S * d), 0.0));
      int poisoned_from = -1, tile_end = -1;
      tiles = 0;
      for (int i = S - 1; i >= 0; --i) {
        if (const int count = lay.back_tile_count(i, k); count > 0) {
          gpu->routing_source_backward_tile(dvt.t()[i], w, ub, gs, rows, xs.g.t()[i], history.g,
                                            inv_rms.g, pg, lay, i, count, H);
          if (lay.last_site(i) - i + 1 > fused_limit) {
            ++tiles;
            poisoned_from = i;
            tile_end = i - count * lay.block;  // the tile's oldest slot is tile_end + block
            for (int j = i; j < S; ++j) gpu->upload(site_dx.g.t()[j], nan_row.data());
          }
        } else {
          gpu->routing_source_backward(dvt.t()[i], w, ub, gs, rows, xs.g.t()[i], history.g.t()[i],
                                       inv_rms.g.t()[i], pg, lay, i, H);
        }
        if (poisoned_from >= 0 && i == tile_end + lay.block) {
          for (int j = poisoned_from; j < S; ++j)
            gpu->upload(site_dx.g.t()[j], dx_clean.data() + size_t(j) * size_t(N * d));
          poisoned_from = -1;
        }
      }
      return BackwardBits{dvt.get(), ub.get(), w.get(), gs.get()};
    };
    // Every version of the tile's pair kernel and of the plain calls' value kernel.
    auto against_cpu = [&](const BackwardBits& got, const std::string& what) {
      expect_backward_close("routing_source_backward_tile " + what, got, dv, ubar, weights, gsum);
    };
    const BackwardBits got = expect_versions_same_bits(
        "backward tiles " + tag, d, H,
        {cuda::RoutingKernel::BackwardPair, cuda::RoutingKernel::SourceValue,
         cuda::RoutingKernel::KeyGrad, cuda::RoutingKernel::SourceFinish},
        run, against_cpu);
    std::printf("BACKWARD_TILES %s: %d tiles of %d slots\n", tag.c_str(), tiles, k);
    against_cpu(got, tag);
  }

  // `block` s: block routing's layout (1: full routing).
  void check(int64_t N, int64_t d, int S, int H, int block = 1) {
    const std::string tag = "N" + std::to_string(N) + " d" + std::to_string(d) + " S" +
                            std::to_string(S) + " H" + std::to_string(H) + " block" +
                            std::to_string(block);
    const double eps = 1e-6;
    const RoutingLayout lay = RoutingLayout::blocks(S, block);
    const int64_t P = lay.pairs();
    // Sources of different scales (like real sublayer outputs), so the RMS matters.
    Pair history = pair(DType::BF16, {S, N, d});
    {
      std::vector<double> h;
      for (int64_t i = 0; i < S; ++i) {
        auto v = random_normal(rng, N * d, DType::BF16, 0.5 + 0.4 * double(i));
        h.insert(h.end(), v.begin(), v.end());
      }
      history.set(h);
    }
    // Logits s = r * sum_{c in h} q g v have std about |q| |g| sqrt(d/H): scale q so that
    // the softmax is neither uniform nor one-hot.
    const double q_std = 1.5 / std::sqrt(double(d / H));
    std::vector<Pair> query, gain, dquery, dgain;
    RoutingParams pc, pg;
    for (int k = 0; k < S; ++k) {
      query.push_back(random_pair(DType::BF16, {d}, q_std));
      gain.push_back(random_pair(DType::BF16, {d}, 0.3, 1.0));
      dquery.push_back(random_pair(DType::F32, {d}, 0.1));  // += outputs start non-zero
      dgain.push_back(random_pair(DType::F32, {d}, 0.1));
    }
    for (int k = 0; k < S; ++k) {
      pc.query.push_back(query[k].c), pc.gain.push_back(gain[k].c);
      pg.query.push_back(query[k].g), pg.gain.push_back(gain[k].g);
      pc.dquery.push_back(dquery[k].c), pc.dgain.push_back(dgain[k].c);
      pg.dquery.push_back(dquery[k].g), pg.dgain.push_back(dgain[k].g);
    }

    // ---- logits of every source
    Pair inv_rms = pair(DType::F32, {S, N});
    Pair weights = pair(DType::F32, {P, H, N});
    inv_rms.g.poison();
    weights.g.poison();
    for (int i = 0; i < S; ++i) {
      cpu->routing_source_logits(weights.c, inv_rms.c.t()[i], history.c.t()[i], pc, lay, i, H, eps);
      gpu->routing_source_logits(weights.g, inv_rms.g.t()[i], history.g.t()[i], pg, lay, i, H, eps);
    }
    expect_close("routing_source_logits inv_rms " + tag, inv_rms.g, inv_rms.c, kTolF32Output);
    expect_close("routing_source_logits logits " + tag, weights.g, weights.c, kTolF32Output);
    // A bound pass: the op scratch of these shapes (nothing else planned: no attention, no
    // depth tiles), in which the logits take every site's q*g from the pass's tables.
    OpScratchShapes shapes;
    shapes.batch = 1, shapes.seq_len = N, shapes.d_model = d;
    shapes.routing = lay, shapes.routing_heads = H;
    Buffer scratch(*gpu, DType::F32, {int64_t((gpu->op_scratch_bytes(shapes) + 3) / 4)});
    {
      const std::vector<double> unbound = weights.g.get(), unbound_rms = inv_rms.g.get();
      // Other parameters for the same sites (new tensors): the pass's tables must follow
      // whichever parameters a call brings.
      std::vector<Buffer> other_q;
      other_q.reserve(size_t(S));
      RoutingParams other = pg;
      for (int k = 0; k < S; ++k) {
        other_q.emplace_back(*gpu, DType::BF16, std::initializer_list<int64_t>{d});
        other_q.back().set(random_normal(rng, d, DType::BF16, q_std));
        other.query[size_t(k)] = other_q.back();
      }
      Buffer w_other(*gpu, DType::F32, {P, H, N}), r_other(*gpu, DType::F32, {S, N});
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(w_other, r_other.t()[i], history.g.t()[i], other, lay, i, H,
                                   eps);
      const std::vector<double> unbound_other = w_other.get();
      const QgPassTablesOn pass_tables;
      const OpScratchBinding bind(*gpu, {scratch, shapes});
      weights.g.poison();
      inv_rms.g.poison();
      w_other.poison();
      // Every source with pg (its tables filled once), then with the other parameters (filled
      // again, once), then pg's last source again (back to pg's).
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(weights.g, inv_rms.g.t()[i], history.g.t()[i], pg, lay, i, H,
                                   eps);
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(w_other, r_other.t()[i], history.g.t()[i], other, lay, i, H,
                                   eps);
      gpu->routing_source_logits(weights.g, inv_rms.g.t()[S - 1], history.g.t()[S - 1], pg, lay,
                                 S - 1, H, eps);
      EXPECT_TRUE(weights.g.get() == unbound) << "logits in a bound pass " << tag;
      EXPECT_TRUE(inv_rms.g.get() == unbound_rms) << "inv_rms in a bound pass " << tag;
      EXPECT_TRUE(w_other.get() == unbound_other)
          << "logits of other parameters in the same bound pass " << tag;
    }
    inv_rms.g.set(inv_rms.c.get());  // identical inputs for what follows
    const std::vector<double> raw_logits = weights.c.get();
    weights.g.set(raw_logits);

    // ---- mix of every site
    Pair xs = pair(DType::BF16, {S, N, d});
    xs.g.poison();
    for (int j = 0; j < S; ++j) {
      cpu->routing_mix(xs.c.t()[j], weights.c, history.c, lay, j, H);
      gpu->routing_mix(xs.g.t()[j], weights.g, history.g, lay, j, H);
    }
    expect_close("routing_mix x " + tag, xs.g, xs.c, kTolBf16Output);
    expect_close("routing_mix weights " + tag, weights.g, weights.c, kTolF32Output);
    {  // A site never reads a later source: poison the slots after site j on the GPU.
      const int j = S / 2;
      const std::vector<double> normalised = weights.g.get(), clean = history.c.get();
      std::vector<double> poisoned = clean;
      for (size_t e = size_t(j + 1) * size_t(N * d); e < poisoned.size(); ++e)
        poisoned[e] = std::nan("");
      Pair x_clean = pair(DType::BF16, {N, d}), x_poisoned = pair(DType::BF16, {N, d});
      for (auto* run : {&x_clean, &x_poisoned}) {
        weights.g.set(raw_logits);  // the mix normalises in place: start from the logits
        history.g.set(run == &x_clean ? clean : poisoned);
        gpu->routing_mix(run->g, weights.g, history.g, lay, j, H);
      }
      history.g.set(clean);
      weights.g.set(normalised);
      EXPECT_EQ(x_poisoned.g.get(), x_clean.g.get())
          << "routing_mix read a source after site " << j << " " << tag;
    }
    {  // routing_mix_rmsnorm at every site, each mixed on its own (no tile in flight; the
       // tiles' fused forms are check_tiles'): x and the weights routing_mix's bits, y and
       // rstd those of rmsnorm_forward of that x, at every MixNorm version (4 fuses the norm
       // into the plain mix kernels, which read it back where they store in the span order).
      const Pair norm_w = random_pair(DType::BF16, {d});
      Buffer x(*gpu, DType::BF16, {S, N, d}), y(*gpu, DType::BF16, {S, N, d});
      Buffer y_ref(*gpu, DType::BF16, {S, N, d}), rstd(*gpu, DType::F32, {S, N});
      Buffer rstd_ref(*gpu, DType::F32, {S, N}), w(*gpu, DType::F32, {P, H, N});
      for (int j = 0; j < S; ++j)
        gpu->rmsnorm_forward(y_ref.t()[j], rstd_ref.t()[j], xs.g.t()[j], norm_w.g, eps);
      const std::vector<std::vector<double>> want = {xs.g.get(), weights.g.get(), y_ref.get(),
                                                     rstd_ref.get()};
      const int norms = cuda::routing_kernel_versions(cuda::RoutingKernel::MixNorm);
      for (int version = 1; version <= norms; ++version) {
        cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, version);
        x.poison();
        y.poison();
        rstd.poison();
        w.set(raw_logits);
        for (int j = 0; j < S; ++j)
          gpu->routing_mix_rmsnorm(x.t()[j], y.t()[j], rstd.t()[j], w, history.g, lay, j, H,
                                   norm_w.g, eps);
        const std::vector<std::vector<double>> got = {x.get(), w.get(), y.get(), rstd.get()};
        const char* names[] = {"x", "weights", "y", "rstd"};
        for (size_t o = 0; o < got.size(); ++o) {
          int64_t diff = 0;
          for (size_t e = 0; e < got[o].size(); ++e) diff += !(got[o][e] == want[o][e]);
          EXPECT_EQ(diff, 0) << "plain routing_mix_rmsnorm " << names[o] << ", norm v" << version
                             << " " << tag;
        }
      }
      cuda::routing_set_kernel_version(cuda::RoutingKernel::MixNorm, 0);
    }
    // The backend's plan, and tiles of its largest count from site 0 (every tile size at
    // the first site, and a last tile cut short by the depth, where the plan has none).
    if (const int k = gpu->routing_tile_sites(lay, d, H); k > 1) {
      const std::vector<int> plan = gpu->routing_tile_plan(lay, d, H);
      const std::vector<int> fixed = lay.uniform_tiles(k);
      for (const std::vector<int>* p : {&plan, &fixed}) {
        std::string counts;
        for (int c : *p) counts += (counts.empty() ? "" : ",") + std::to_string(c);
        if (*std::max_element(p->begin(), p->end()) > 1 && (p == &plan || fixed != plan))
          check_tiles(tag + " tiles " + counts, *p, lay, N, d, H, history, raw_logits, xs, weights,
                      pc, pg, eps);
      }
    }
    weights.g.set(weights.c.get());
    xs.c.set(xs.g.get());  // the GPU's bf16 site inputs on both sides

    // ---- backward of every source, last to first
    const std::vector<double> mixed = weights.g.get();
    Pair site_dx = random_pair(DType::BF16, {S, N, d});
    Pair ubar = pair(DType::F32, {S, H, N});
    Pair gsum = pair(DType::F32, {8, S, d});
    Pair dv = pair(DType::BF16, {S, N, d});
    ubar.g.poison();  // rows are written source by source; reading one early gives NaN
    dv.g.poison();
    gsum.set(std::vector<double>(size_t(8 * S * d), 0.0));
    for (int i = S - 1; i >= 0; --i) {
      cpu->routing_source_backward(dv.c.t()[i], weights.c, ubar.c, gsum.c,
                                   routing_rows(site_dx.c.t()),
                                   xs.c.t()[i], history.c.t()[i], inv_rms.c.t()[i], pc, lay, i, H);
      gpu->routing_source_backward(dv.g.t()[i], weights.g, ubar.g, gsum.g,
                                   routing_rows(site_dx.g.t()),
                                   xs.g.t()[i], history.g.t()[i], inv_rms.g.t()[i], pg, lay, i, H);
    }
    expect_close("routing_source_backward dv " + tag, dv.g, dv.c, kTolBf16Output);
    expect_close("routing_source_backward ubar " + tag, ubar.g, ubar.c, kTolF32Output);
    expect_close("routing_source_backward ds*r " + tag, weights.g, weights.c, kTolF32Output);
    {  // every version of the value kernel: the default's bits
      Buffer w(*gpu, DType::F32, {lay.pairs(), H, N}), ub(*gpu, DType::F32, {S, H, N});
      Buffer gs(*gpu, DType::F32, {8, S, d}), dvp(*gpu, DType::BF16, {S, N, d});
      auto run = [&] {
        w.set(mixed);
        ub.poison();
        dvp.poison();
        gs.set(std::vector<double>(size_t(8 * S * d), 0.0));
        for (int i = S - 1; i >= 0; --i)
          gpu->routing_source_backward(dvp.t()[i], w, ub, gs, routing_rows(site_dx.g.t()),
                                       xs.g.t()[i], history.g.t()[i], inv_rms.g.t()[i], pg, lay, i,
                                       H);
        return BackwardBits{dvp.get(), ub.get(), w.get(), gs.get()};
      };
      expect_versions_same_bits("routing_source_backward " + tag, d, H,
                                {cuda::RoutingKernel::SourceValue, cuda::RoutingKernel::KeyGrad,
                                 cuda::RoutingKernel::SourceFinish},
                                run, [&](const BackwardBits& got, const std::string& what) {
                                  expect_backward_close(what, got, dv, ubar, weights, gsum);
                                });
      const BackwardBits unbound = run();  // then in a bound pass: the pass's q*g rows
      const QgPassTablesOn pass_tables;
      const OpScratchBinding bind(*gpu, {scratch, shapes});
      run().expect_same(unbound, "routing_source_backward in a bound pass " + tag);
    }
    if (const int k = gpu->routing_backward_tile_slots(lay, d, H); k > 1)
      check_back_tiles(tag, k, lay, N, d, H, history, xs, inv_rms, site_dx, mixed, pg, dv, ubar,
                       weights, gsum);

    // ---- query and gain gradients
    cpu->routing_param_grads(pc, gsum.c);
    gpu->routing_param_grads(pg, gsum.g);
    std::vector<double> dq_c, dq_g, dg_c, dg_g;
    for (int k = 0; k < S; ++k) {
      for (double v : dquery[k].c.get()) dq_c.push_back(v);
      for (double v : dquery[k].g.get()) dq_g.push_back(v);
      for (double v : dgain[k].c.get()) dg_c.push_back(v);
      for (double v : dgain[k].g.get()) dg_g.push_back(v);
    }
    expect_close("routing_param_grads dquery " + tag, dq_g, dq_c, kTolF32Output);
    expect_close("routing_param_grads dgain " + tag, dg_g, dg_c, kTolF32Output);
  }
};

TEST_F(RoutingParity, SmallWidthEverySourceCount) {
  // d = 96: heads of 96, 48, 24 (segmented scan) and 12 (head by head, warp sums).
  for (int S = 1; S <= 9; ++S)
    for (int H : {1, 2, 4, 8}) check(37, 96, S, H);
}

TEST_F(RoutingParity, HeadsSpanningChunkRows) {
  // d = 640: 3 chunk rows per lane, heads of 80 features span rows for H = 8.
  for (int S : {1, 4, 9})
    for (int H : {1, 2, 4, 8}) check(32, 640, S, H);
}

TEST_F(RoutingParity, ModelWidths) {
  check(21, 1280, 9, 8);   // the 1B config: 5 chunk rows, heads of 160
  check(21, 1280, 73, 8);  // the 1B config's depth: nine depth tiles of 8 sites, the last of 1
  check(24, 1024, 49, 8);  // the 350M config's depth
  check(16, 2048, 5, 16);  // 8 chunk rows, heads of 128
  check(24, 1024, 7, 8);   // the 350M config
  check(24, 512, 25, 4);   // the 100M config: 4 heads of 128 (8 lanes a head), its depth
}

TEST_F(RoutingParity, BlockLayouts) {
  for (int S : {3, 5, 9, 13})
    for (int block = 2; block < S; ++block)
      for (int H : {1, 4}) check(37, 96, S, H, block);
  check(32, 640, 9, 8, 3);    // heads spanning chunk rows
  check(21, 1280, 73, 8, 9);  // configs/1b_block_mhar.json: 72 sublayers in 8 blocks of 9
  check(21, 1280, 73, 8, 8);  // configs/1b_delta.json's routing: blocks of 8 sublayers
  check(24, 1024, 49, 8, 6);  // configs/350m_block_mhar.json
}

TEST_F(RoutingParity, SpanLayout) {
  // d % 256 == 0 and H dividing 32: the kernels where each lane owns contiguous features
  // and a head is a run of lanes (ModelWidths and the model-width BlockLayouts use them
  // too), for every H that allows it and every row width up to 2048.
  for (int H : {1, 2, 4, 8, 16, 32}) check(19, 768, 5, H);
  // Slots read by more than 8 sites take the unfused backward (value kernel, key GEMM,
  // finish kernel); up to 8, the fused one: S = 12 has both.
  for (int H : {1, 8, 32}) check(19, 768, 12, H);
  for (int64_t d : {256, 512, 1536, 1792, 2048}) check(11, d, 4, 8);
  // Row parts (value kernel versions 3-4, pair versions 5-6) where the row splits into 2,
  // 4 and 8 parts with unfused slots, heads of 2 to 16 lanes a part.
  check(11, 2048, 12, 16);
  check(13, 1024, 12, 32);
  check(19, 512, 9, 4, 2);  // block layout
  check(16, 512, 25, 4);    // the 100M config's width and depth (backward tiles at 2 chunks)
}

// Every kernel-lab version of routing_source_logits (cuda::RoutingKernel::Logits): the
// logits and inv_rms of every source against the CPU within fp32 rounding, and wherever a
// version takes the token kernel, the bits of version 4 (the token kernel for every
// slot): one and four tokens a warp add each token's terms in the same order. Token
// counts that are not multiples of 4 take the four-token kernel's scalar tail stores.
TEST_F(RoutingParity, LogitsVersions) {
  struct Case {
    int64_t N, d;
    int S, H, block;
  };
  // Tensor cores (versions 5-9) at head_dim 128 and 160 with 4 and 8 heads: slots of one
  // site group and of several (1B's 73 sites: up to 5 groups of 16, or 10 of 8); the last
  // two span several blocks of 128 tokens (version 8's where a slot takes several groups).
  for (const Case c : {Case{37, 512, 25, 4, 1}, Case{40, 512, 25, 4, 1}, Case{21, 1280, 73, 8, 1},
                       Case{19, 768, 12, 8, 1}, Case{19, 512, 9, 4, 2}, Case{37, 96, 9, 4, 1},
                       Case{21, 1024, 49, 8, 1}, Case{23, 640, 40, 4, 1}, Case{300, 1280, 73, 8, 1},
                       Case{150, 640, 40, 4, 1}}) {
    const std::string tag = "N" + std::to_string(c.N) + " d" + std::to_string(c.d) + " S" +
                            std::to_string(c.S) + " H" + std::to_string(c.H) + " block" +
                            std::to_string(c.block);
    const RoutingLayout lay = RoutingLayout::blocks(c.S, c.block);
    const int64_t N = c.N, d = c.d, P = lay.pairs();
    const int S = c.S, H = c.H;
    Pair history = random_pair(DType::BF16, {S, N, d}, 0.7);
    const double q_std = 1.5 / std::sqrt(double(d / H));
    std::vector<Pair> query, gain;
    RoutingParams pc, pg;
    for (int k = 0; k < S; ++k) {
      query.push_back(random_pair(DType::BF16, {d}, q_std));
      gain.push_back(random_pair(DType::BF16, {d}, 0.3, 1.0));
    }
    for (int k = 0; k < S; ++k) {
      pc.query.push_back(query[k].c), pc.gain.push_back(gain[k].c);
      pg.query.push_back(query[k].g), pg.gain.push_back(gain[k].g);
    }
    Pair inv_rms = pair(DType::F32, {S, N});
    Pair weights = pair(DType::F32, {P, H, N});
    for (int i = 0; i < S; ++i)
      cpu->routing_source_logits(weights.c, inv_rms.c.t()[i], history.c.t()[i], pc, lay, i, H,
                                 1e-6);
    // Version 4 (the token kernel at every slot) first: its outputs are the reference for
    // every version's token-kernel slots. Version 6 takes every slot of a tensor-core shape
    // on tensor cores; its outputs are the reference for the slots that versions 5 and 7-9
    // take there (5 and 9 some, by head_dim and site count; 7 in site groups of 8; 8 and 9 in
    // blocks of 128 tokens where a slot takes several groups): a logit's sum does not
    // depend on its site group or on the block its token falls in.
    constexpr int kTokenVersion = 4, kMmaVersion = 5, kMmaEveryDim = 6;
    const int versions = cuda::routing_kernel_versions(cuda::RoutingKernel::Logits);
    std::vector<int> order{kTokenVersion};
    for (int v = 1; v < kMmaVersion; ++v)
      if (v != kTokenVersion) order.push_back(v);
    order.push_back(kMmaEveryDim);
    for (int v = kMmaVersion; v <= versions; ++v)
      if (v != kMmaEveryDim) order.push_back(v);
    const int dh = int(d / H);
    const bool mma_shape = d == int64_t(dh) * H && (dh == 128 || dh == 160) && (H == 4 || H == 8);
    std::vector<double> token_w, token_r;  // version 4's outputs
    std::vector<double> mma_w, mma_r;      // version 6's
    for (const int version : order) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::Logits, version);
      const std::string what = "v" + std::to_string(version) + " " + tag;
      inv_rms.g.poison();
      weights.g.poison();
      for (int i = 0; i < S; ++i)
        gpu->routing_source_logits(weights.g, inv_rms.g.t()[i], history.g.t()[i], pg, lay, i, H,
                                   1e-6);
      expect_close("routing_source_logits inv_rms " + what, inv_rms.g, inv_rms.c, kTolF32Output);
      expect_close("routing_source_logits logits " + what, weights.g, weights.c, kTolF32Output);
      const std::vector<double> w = weights.g.get(), r = inv_rms.g.get();
      if (version == kTokenVersion) {
        token_w = w, token_r = r;
        continue;
      }
      if (version == kMmaEveryDim) mma_w = w, mma_r = r;
      int token_slots = 0, mma_slots = 0;
      // Slot i's inv_rms row equals the reference's, and its logits' rows.
      auto slot_is = [&](int i, const std::vector<double>& ref_w, const std::vector<double>& ref_r,
                         int ref_version) {
        const int ns = lay.last_site(i) - i + 1;
        const size_t r0 = size_t(i) * size_t(N), w0 = size_t(lay.pair_base(i) * H * N);
        const size_t wn = size_t(ns) * size_t(H * N);
        EXPECT_TRUE(std::equal(r.begin() + r0, r.begin() + r0 + size_t(N), ref_r.begin() + r0))
            << what << ": inv_rms of slot " << i << " differs from version " << ref_version;
        EXPECT_TRUE(std::equal(w.begin() + w0, w.begin() + w0 + wn, ref_w.begin() + w0))
            << what << ": logits of slot " << i << " differ from version " << ref_version;
      };
      for (int i = 0; i < S; ++i) {
        const int ns = lay.last_site(i) - i + 1;
        const bool mma = cuda::routing_logits_by_tensor_cores(d, H, ns);
        if (version == kMmaEveryDim) {
          EXPECT_EQ(mma, mma_shape) << what << ": slot " << i << " (" << ns << " sites)";
        }
        if (mma) {
          ++mma_slots;
          if (version != kMmaEveryDim) slot_is(i, mma_w, mma_r, kMmaEveryDim);
        }
        if (!cuda::routing_logits_by_token_kernel(d, H, ns)) continue;
        EXPECT_FALSE(mma) << what << ": slot " << i << " claimed by two kernels";
        ++token_slots;
        slot_is(i, token_w, token_r, kTokenVersion);
      }
      // Versions 1-4 take no tensor cores; the span layout takes the token kernel at least
      // for the slots read by few sites, wherever some slot is off the tensor cores.
      if (version < kMmaVersion) {
        EXPECT_EQ(mma_slots, 0) << what;
      }
      if (d % 256 == 0 && mma_slots < S) {
        EXPECT_GT(token_slots, 0) << what;
      }
    }
    cuda::routing_set_kernel_version(cuda::RoutingKernel::Logits, 0);
  }
}

TEST_F(RoutingParity, ManyHeads) {
  check(13, 512, 5, 64);  // H > 32: per-head softmax statistics in shared memory
  check(12, 96, 4, 48);   // H > 32 and heads of 2 features
}

// The depth-tile plan (cuda::routing_tile_plan, host code: runs without a GPU) covers the
// sites in order with tiles the kernels take, and no partition of the sites into such tiles
// moves fewer rows by its traffic model (cuda::routing_tile_rows): against every
// partition where there are few enough to list (S <= 14), else against tiles of every
// fixed count and against the plan with any two neighbouring tiles' sites redistributed.
// TilePlan version 2 takes tiles up to the largest the kernels take, version 3 one site
// fewer.
TEST(RoutingTilePlan, CoversTheSitesWithTheFewestRows) {
  // The version in force before, restored on the way out whatever fails.
  struct PlanVersion {
    int before = cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, 0);
    ~PlanVersion() { cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, before); }
  } plan_version;
  auto rows = cuda::routing_plan_rows;
  for (const int version : {2, 3})
    for (const auto& [d, H] : {std::pair<int64_t, int>{512, 4}, {1024, 8}, {1280, 8}}) {
      cuda::routing_set_kernel_version(cuda::RoutingKernel::TilePlan, version);
      for (int S = 1; S <= 80; ++S) {
        const RoutingLayout lay = RoutingLayout::full(S);
        const int largest = cuda::routing_tile_sites(lay, d, H);
        ASSERT_GT(largest, 2) << "d " << d << " H " << H << " S " << S;
        const int kmax = version == 3 ? largest - 1 : largest;
        const std::vector<int> plan = cuda::routing_tile_plan(lay, d, H);
        const std::string what = "version " + std::to_string(version) + ", d " + std::to_string(d) +
                                 " S " + std::to_string(S);
        int covered = 0;
        for (int c : plan) {
          EXPECT_TRUE(c >= 1 && c <= kmax) << what << ": a tile of " << c;
          covered += c;
        }
        ASSERT_EQ(covered, S) << what;
        const int64_t best = rows(plan);
        if (S <= 14) {
          // Every composition of S into parts <= kmax: bit b of `cuts` set = a tile ends
          // after site b.
          for (int cuts = 0; cuts < (1 << (S - 1)); ++cuts) {
            std::vector<int> other;
            int len = 1;
            for (int b = 0; b < S - 1; ++b, ++len)
              if (cuts >> b & 1) other.push_back(len), len = 0;
            other.push_back(len);
            if (*std::max_element(other.begin(), other.end()) <= kmax) {
              EXPECT_LE(best, rows(other)) << what;
            }
          }
          continue;
        }
        for (int k = 1; k <= kmax; ++k) {
          EXPECT_LE(best, rows(lay.uniform_tiles(k))) << what << ", tiles of " << k;
        }
        for (size_t t = 0; t + 1 < plan.size(); ++t)
          for (int first = 1; first < plan[t] + plan[t + 1]; ++first) {
            std::vector<int> other = plan;
            other[t] = first, other[t + 1] = plan[t] + plan[t + 1] - first;
            if (other[t] <= kmax && other[t + 1] <= kmax) {
              EXPECT_LE(best, rows(other)) << what;
            }
          }
      }
    }
  // Shapes that do not tile (block layouts; heads that do not tile the warp): one site a
  // tile.
  EXPECT_EQ(cuda::routing_tile_plan(RoutingLayout::blocks(25, 3), 512, 4), std::vector<int>(25, 1));
  EXPECT_EQ(cuda::routing_tile_plan(RoutingLayout::full(25), 512, 3), std::vector<int>(25, 1));
}

}  // namespace
}  // namespace mhar::test
