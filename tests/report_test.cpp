// report_test.cpp: the run report (engine/report.h).
// - A synthetic mhar run (train, eval, routing, skip, unknown-kind, malformed and
//   truncated lines) renders into one self-contained file: SVG charts, one heatmap per
//   routing site, no external references, written atomically.
// - Headless Chromium renders it, and the screenshot is decoded (PNG, zlib) and must not
//   be blank: many distinct colours and a good share of non-white pixels. Chromium is
//   installed by tools/setup.sh; when it is absent the test fails if $CI or
//   $MHAR_REQUIRE_BROWSER is set and otherwise skips with a loud banner.
// - The trainer's routing lines (a RoutingProbe's, probe_metrics_lines) hold the mean
//   routing weights over tokens and batches and render with the probe's statistics.
// - The routing probe's page (engine/probe.h) renders in Chromium the same way.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "engine/probe.h"
#include "engine/report.h"
#include "tests/data_test_util.h"
#include "tests/model_test_util.h"

using namespace mhar;
using namespace mhar::test;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(::testing::TempDir()) /
               ("mhar_report_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

int count_of(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// A run dir as the trainer writes it: an mhar model of 4 layers (9 routing sites, 4
// heads), 400 steps with a falling loss, evaluations every 50 steps with routing lines.
fs::path make_synthetic_run(const std::string& name, ResidualMode mode) {
  const fs::path dir = fresh_dir(name);
  nlohmann::json cj = {
      {"model", {{"vocab_size", 512}, {"d_model", 64}, {"n_layers", 4}, {"n_heads", 4},
                 {"n_kv_heads", 4}, {"head_dim", 16}, {"d_ff", 128}, {"context_length", 64}}},
      {"residual", {{"mode", residual_mode_name(mode)}, {"heads", mode == ResidualMode::Mhar ? 4 : 0}}},
      {"train", {{"steps", 400}, {"seq_len", 64}, {"micro_batch", 4}, {"warmup_steps", 20}}}};
  Config cfg = config_from_json(cj, "synthetic");
  std::ofstream(dir / "config.json") << cfg.to_json().dump(2) << "\n";

  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::ofstream m(dir / "metrics.jsonl");
  const int steps = 400, sites = 2 * 4 + 1, H = 4;
  for (int s = 1; s <= steps; ++s) {
    const double lr = s < 20 ? 5e-4 * s / 20 : 5e-5 + 4.5e-4 * 0.5 * (1 + std::cos(3.141592653589793 * (s - 20) / 380.0));
    nlohmann::json t = {{"kind", "train"}, {"step", s},
                        {"loss", 3.0 + 3.5 * std::exp(-s / 80.0) + 0.08 * noise(rng)},
                        {"lr", lr}, {"grad_norm", 0.3 + 2.0 * std::exp(-s / 30.0) + 0.05 * std::fabs(noise(rng))},
                        {"tokens_per_s", 21000 + 400 * noise(rng)}, {"tokens", s * 256},
                        {"elapsed_s", s * 0.012}};
    m << t.dump() << "\n";
    if (s == 137) m << R"({"kind":"skip","step":137,"reason":"non-finite gradient <norm=nan>"})" << "\n";
    if (s == 200) m << R"({"kind":"future_kind","step":200,"x":1})" << "\n";
    if (s == 201) m << "{this line is damaged\n";
    if (s % 50 == 0) {
      m << nlohmann::json({{"kind", "eval"}, {"step", s}, {"val_loss", 3.1 + 3.4 * std::exp(-s / 80.0)},
                           {"val_ppl", std::exp(3.1 + 3.4 * std::exp(-s / 80.0))}, {"tokens", s * 256}})
               .dump()
        << "\n";
      if (mode == ResidualMode::Standard) continue;
      for (int j = 0; j < sites; ++j) {
        nlohmann::json weights = nlohmann::json::array();
        for (int h = 0; h < H; ++h) {
          std::vector<double> w(size_t(j) + 1);
          double sum = 0;
          for (int i = 0; i <= j; ++i) sum += (w[size_t(i)] = std::exp(1.5 * noise(rng) + (i == j ? 1.0 : 0.0)));
          nlohmann::json row = nlohmann::json::array();
          for (double x : w) row.push_back(x / sum);
          weights.push_back(row);
        }
        m << nlohmann::json({{"kind", "routing"}, {"step", s}, {"site", j}, {"heads", H},
                             {"weights", weights}})
                 .dump()
          << "\n";
      }
    }
  }
  m << R"({"kind":"train","step":401,"loss":2.9,"lr")";  // a write in progress
  return dir;
}

// ---- PNG decoding (8-bit RGB/RGBA, non-interlaced: what Chromium writes).
// zlib is loaded at run time from libz.so.1 (on every Debian system), which keeps the
// test binary's link line unchanged.
using UncompressFn = int (*)(unsigned char*, unsigned long*, const unsigned char*, unsigned long);

UncompressFn zlib_uncompress() {
  static UncompressFn fn = [] {
    void* lib = dlopen("libz.so.1", RTLD_NOW);
    return lib ? reinterpret_cast<UncompressFn>(dlsym(lib, "uncompress")) : nullptr;
  }();
  return fn;
}

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3
};

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

Image decode_png(const std::string& bytes) {
  Image img;
  const auto* d = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < 8 || std::memcmp(d, "\x89PNG\r\n\x1a\n", 8) != 0)
    throw std::runtime_error("not a PNG file");
  size_t pos = 8;
  int bit_depth = 0, colour_type = 0, interlace = 0;
  std::vector<uint8_t> idat;
  while (pos + 12 <= bytes.size()) {
    const uint32_t len = be32(d + pos);
    const std::string type(bytes, pos + 4, 4);
    const uint8_t* body = d + pos + 8;
    if (pos + 12 + len > bytes.size()) throw std::runtime_error("truncated PNG chunk " + type);
    if (type == "IHDR") {
      img.width = int(be32(body));
      img.height = int(be32(body + 4));
      bit_depth = body[8];
      colour_type = body[9];
      interlace = body[12];
    } else if (type == "IDAT") {
      idat.insert(idat.end(), body, body + len);
    } else if (type == "IEND") {
      break;
    }
    pos += 12 + len;
  }
  if (bit_depth != 8 || (colour_type != 2 && colour_type != 6) || interlace != 0)
    throw std::runtime_error("unsupported PNG: depth " + std::to_string(bit_depth) + " colour type " +
                             std::to_string(colour_type) + " interlace " + std::to_string(interlace));
  const int bpp = colour_type == 6 ? 4 : 3;
  const size_t stride = size_t(img.width) * bpp;
  std::vector<uint8_t> raw((stride + 1) * size_t(img.height));
  unsigned long raw_len = raw.size();
  UncompressFn uncompress = zlib_uncompress();
  if (!uncompress) throw std::runtime_error("libz.so.1 not found");
  if (uncompress(raw.data(), &raw_len, idat.data(), idat.size()) != 0 || raw_len != raw.size())
    throw std::runtime_error("PNG image data does not inflate to the expected size");
  std::vector<uint8_t> cur(stride), prev(stride, 0);
  img.rgb.resize(size_t(img.width) * img.height * 3);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = raw[size_t(y) * (stride + 1)];
    const uint8_t* in = &raw[size_t(y) * (stride + 1) + 1];
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= size_t(bpp) ? cur[i - bpp] : 0, b = prev[i],
                c = i >= size_t(bpp) ? prev[i - bpp] : 0;
      int pred = 0;
      switch (filter) {
        case 0: pred = 0; break;
        case 1: pred = a; break;
        case 2: pred = b; break;
        case 3: pred = (a + b) / 2; break;
        case 4: {
          const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
          pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
          break;
        }
        default: throw std::runtime_error("bad PNG filter " + std::to_string(filter));
      }
      cur[i] = uint8_t(in[i] + pred);
    }
    for (int x = 0; x < img.width; ++x)
      for (int k = 0; k < 3; ++k) img.rgb[(size_t(y) * img.width + x) * 3 + k] = cur[size_t(x) * bpp + k];
    std::swap(cur, prev);
  }
  return img;
}

std::string find_chromium() {
  if (const char* env = std::getenv("MHAR_CHROMIUM")) return env;
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"}) {
    const std::string cmd = std::string("command -v ") + name + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return name;
  }
  return "";
}

TEST(RunReport, SyntheticMharRunRendersSelfContained) {
  const fs::path dir = make_synthetic_run("mhar", ResidualMode::Mhar);
  write_run_report(dir.string());
  const std::string html = read_bytes(dir / "report.html");
  ASSERT_FALSE(html.empty());
  // Atomic write: no temporary file is left behind.
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".report.html.tmp"), std::string::npos);
  // Self-contained: nothing to fetch, nothing to run.
  for (const char* banned : {"http:", "https:", "<script", "@import", "url(", "<link", "<img"})
    EXPECT_EQ(html.find(banned), std::string::npos) << banned;
  EXPECT_EQ(count_of(html, "<figure class=\"chart\">"), 4);    // loss, lr, grad norm, throughput
  EXPECT_EQ(count_of(html, "<figure class=\"heatmap\">"), 9);  // one per routing site
  // The latest evaluation's routing (step 400); 4 heads x (1 + ... + 9) sources cells.
  EXPECT_NE(html.find("at step 400"), std::string::npos);
  EXPECT_EQ(count_of(html, "<title>site "), 4 * 45);
  // The skip, escaped; the damaged line counted; the truncated last line noticed.
  EXPECT_NE(html.find("non-finite gradient &lt;norm=nan&gt;"), std::string::npos);
  EXPECT_NE(html.find("1 malformed line(s)"), std::string::npos);
  EXPECT_NE(html.find("1 of unknown kinds ignored"), std::string::npos);
  EXPECT_NE(html.find("last line incomplete"), std::string::npos);
  EXPECT_NE(html.find("400 / 400"), std::string::npos);
  EXPECT_NE(html.find("<th>d_model</th><td>64</td>"), std::string::npos);
  EXPECT_NE(html.find("<th>heads / KV heads</th><td>4 / 4</td>"), std::string::npos);
  // Rewriting replaces the file in place.
  write_run_report(dir.string());
  EXPECT_EQ(count_of(read_bytes(dir / "report.html"), "<figure class=\"heatmap\">"), 9);
  if (!HasFailure()) fs::remove_all(dir);  // kept for inspection when something failed
}

TEST(RunReport, StandardRunHasNoRoutingSection) {
  const fs::path dir = make_synthetic_run("standard", ResidualMode::Standard);
  const std::string html = render_run_report(dir.string());
  EXPECT_EQ(html.find("<h2>Routing</h2>"), std::string::npos);
  EXPECT_EQ(count_of(html, "<figure class=\"chart\">"), 4);
  if (!HasFailure()) fs::remove_all(dir);
}

TEST(RunReport, EmptyOrMissingInputs) {
  const fs::path dir = fresh_dir("empty");
  // No metrics, no config: still a valid page that says so (the trainer may call early).
  std::string html = render_run_report(dir.string());
  EXPECT_NE(html.find("metrics.jsonl not found"), std::string::npos);
  EXPECT_NE(html.find("config.json not found"), std::string::npos);
  EXPECT_NE(html.find("no data yet"), std::string::npos);
  std::ofstream(dir / "metrics.jsonl") << "";
  std::ofstream(dir / "config.json") << "{ not json";
  html = render_run_report(dir.string());
  EXPECT_NE(html.find("config.json is not valid JSON"), std::string::npos);
  EXPECT_THROW(write_run_report((dir / "no_such_dir").string()), Error);
  fs::remove_all(dir);
}

// Renders `html` in headless Chromium at 1280 px wide and counts what the screenshot
// shows: a blank or failed render has a handful of colours at most. Skips (or fails
// under $CI / $MHAR_REQUIRE_BROWSER) when no Chromium is installed.
void expect_rendered_page(const fs::path& html, const fs::path& dir, const char* test_name,
                          size_t min_colours, double min_non_white, int min_height) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) {
    const bool required = std::getenv("CI") || std::getenv("MHAR_REQUIRE_BROWSER");
    std::fprintf(stderr,
                 "\n############################################################\n"
                 "# %s: NO CHROMIUM FOUND.\n"
                 "# The page was NOT rendered in a browser. Install it with    #\n"
                 "# tools/setup.sh (Debian package `chromium`) or point        #\n"
                 "# $MHAR_CHROMIUM at a Chromium/Chrome binary.                #\n"
                 "############################################################\n\n", test_name);
    if (required) FAIL() << "chromium is required here ($CI or $MHAR_REQUIRE_BROWSER is set)";
    GTEST_SKIP() << "chromium not installed (see the banner above)";
  }
  const fs::path shot = dir / "shot.png", profile = dir / "chromium-profile", log = dir / "chromium.log";
  // A fresh profile and every background service off: nothing touches the network.
  const std::string cmd =
      "timeout 120 " + chromium +
      " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage"
      " --disable-background-networking --disable-component-update --disable-sync"
      " --disable-extensions --disable-default-apps --no-first-run --no-default-browser-check"
      " --hide-scrollbars --user-data-dir=" + profile.string() +
      " --window-size=1280,1800 --screenshot=" + shot.string() + " file://" +
      fs::absolute(html).string() + " >" + log.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  ASSERT_EQ(rc, 0) << cmd << "\n" << read_bytes(log);
  ASSERT_TRUE(fs::exists(shot)) << read_bytes(log);
  Image img;
  ASSERT_NO_THROW(img = decode_png(read_bytes(shot)));
  ASSERT_EQ(img.width, 1280);
  ASSERT_GT(img.height, min_height);
  std::set<uint32_t> colours;
  size_t non_white = 0;
  const size_t pixels = size_t(img.width) * img.height;
  for (size_t i = 0; i < pixels; ++i) {
    const uint8_t r = img.rgb[3 * i], g = img.rgb[3 * i + 1], b = img.rgb[3 * i + 2];
    colours.insert(uint32_t(r) << 16 | g << 8 | b);
    if (r < 245 || g < 245 || b < 245) ++non_white;
  }
  std::fprintf(stderr, "[ %s ] screenshot %dx%d: %zu distinct colours, %.1f%% non-white\n", test_name,
               img.width, img.height, colours.size(), 100.0 * double(non_white) / double(pixels));
  EXPECT_GE(colours.size(), min_colours);
  EXPECT_GE(double(non_white) / double(pixels), min_non_white);
}

TEST(RunReport, ChromiumScreenshotIsNotBlank) {
  const fs::path dir = make_synthetic_run("browser", ResidualMode::Mhar);
  write_run_report(dir.string());
  // The page background is grey-blue, the charts white with coloured curves, the
  // heatmaps viridis.
  expect_rendered_page(dir / "report.html", dir, "report", 200, 0.2, 1000);
  if (!HasFailure() && !IsSkipped()) fs::remove_all(dir);  // the screenshot stays when the check failed
}

// The routing probe's page (engine/probe.h) reuses the report's heatmaps and style.
TEST(ProbePage, ChromiumScreenshotIsNotBlank) {
  const fs::path dir = fresh_dir("probe_browser");
  Config cfg = tiny_config(ResidualMode::Mhar, 4);
  cfg.model.n_layers = 4;
  auto be = make_cpu_backend(DType::F64);
  Model m(cfg.model, cfg.residual, *be, 2, 6);
  randomize_weights(m, 8);
  RoutingProbe probe;
  std::vector<int32_t> tok, tgt;
  random_tokens(12, cfg.model.vocab_size, 4, tok, tgt);
  m.forward(tok.data(), tgt.data(), 0.0);
  probe.add(m);
  std::ofstream(dir / "probe.html") << render_probe_html(probe.to_json(), "tiny");
  // Nine viridis heatmaps of four heads and a table: a few hundred colours.
  expect_rendered_page(dir / "probe.html", dir, "probe", 100, 0.1, 600);
  if (!HasFailure() && !IsSkipped()) fs::remove_all(dir);
}

// What the trainer logs at an evaluation (a RoutingProbe over the validation batches,
// probe_metrics_lines) carries the mean routing weights over every token of every batch
// and the probe's statistics, and the run report draws both: the heatmaps and the table
// of head disagreement and entropies. Full routing (site j mixes j+1 sources) and blocks
// of 3 (fewer).
TEST(RunReport, TrainerRoutingLinesCarryTheProbeAndRender) {
  for (int block : {0, 3}) {
    SCOPED_TRACE("block_size " + std::to_string(block));
    Config cfg = tiny_config(ResidualMode::Mhar, 2, true, block);
    auto be = make_cpu_backend(DType::F64);
    Model m(cfg.model, cfg.residual, *be, 2, 5);
    randomize_weights(m, 3);
    RoutingProbe probe;
    std::vector<std::vector<double>> expect(size_t(cfg.model.n_sites()));
    const int batches = 2, N = 10, H = 2;
    for (int b = 0; b < batches; ++b) {
      std::vector<int32_t> tok, tgt;
      random_tokens(N, cfg.model.vocab_size, 10 + b, tok, tgt);
      m.forward(tok.data(), tgt.data(), 0.0);
      probe.add(m);
      for (int j = 0; j < cfg.model.n_sites(); ++j) {
        const auto w = m.routing_weights(j);
        auto& e = expect[size_t(j)];
        e.resize(size_t(H) * size_t(m.routing_sources(j)), 0.0);
        for (int n = 0; n < N; ++n)
          for (size_t k = 0; k < e.size(); ++k) e[k] += w[size_t(n) * e.size() + k] / (batches * N);
      }
    }
    const nlohmann::json lines = probe_metrics_lines(probe.to_json(), 300);
    ASSERT_EQ(int(lines.size()), cfg.model.n_sites());
    for (int j = 0; j < cfg.model.n_sites(); ++j) {
      const auto& l = lines[size_t(j)];
      const int src = m.routing_sources(j);
      EXPECT_EQ(l["kind"], "routing");
      EXPECT_EQ(l["step"], 300);
      EXPECT_EQ(l["site"], j);
      EXPECT_EQ(l["heads"], H);
      EXPECT_EQ(l["sources"], src);
      ASSERT_EQ(l["entropy"].size(), size_t(H));
      ASSERT_TRUE(l["js"].is_number());
      ASSERT_EQ(l["weights"].size(), size_t(H));
      for (int h = 0; h < H; ++h) {
        ASSERT_EQ(l["weights"][size_t(h)].size(), size_t(src));
        for (int i = 0; i < src; ++i)  // sums of 20 doubles in another order
          EXPECT_NEAR(l["weights"][size_t(h)][size_t(i)].get<double>(), expect[size_t(j)][size_t(h) * src + i], 1e-14);
      }
    }
    const fs::path dir = fresh_dir("probe_lines_" + std::to_string(block));
    std::ofstream(dir / "config.json") << cfg.to_json().dump(2) << "\n";
    {
      std::ofstream out(dir / "metrics.jsonl");
      out << R"({"kind":"eval","step":300,"val_loss":3.0,"val_ppl":20.1,"tokens":20})" << "\n";
      for (const auto& l : lines) out << l.dump() << "\n";
    }
    const std::string html = render_run_report(dir.string());
    EXPECT_EQ(count_of(html, "<figure class=\"heatmap\">"), cfg.model.n_sites());
    EXPECT_NE(html.find("Head disagreement and entropy by site"), std::string::npos);
    // One table row per site (the header row has <th> cells), each with the site's name and JS.
    EXPECT_EQ(count_of(html, "<tr><td>"), cfg.model.n_sites());
    const int last = cfg.model.n_sites() - 1;
    char js[32];
    std::snprintf(js, sizeof js, "%.4f", lines[size_t(last)]["js"].get<double>());
    EXPECT_NE(html.find(std::string("<td>final norm</td><td>") + std::to_string(m.routing_sources(last)) +
                        "</td><td>" + js),
              std::string::npos);
    // Sources named as the routing reads them: v_i under full routing; the embedding,
    // block sums and the current block's partial sum with blocks.
    if (block == 0) {
      EXPECT_NE(html.find(">a0</text>"), std::string::npos);
      EXPECT_NE(html.find(", source 4 (m1): "), std::string::npos);
    } else {
      EXPECT_NE(html.find(">B1</text>"), std::string::npos);
      EXPECT_NE(html.find(">cur</text>"), std::string::npos);
      EXPECT_NE(html.find("site 4, head 0, source 1 (block 1: v1..v3): "), std::string::npos);
      EXPECT_NE(html.find("site 4, head 0, source 2 (current block so far: v4..v4): "), std::string::npos);
      EXPECT_EQ(html.find(">a0</text>"), std::string::npos);
    }
    if (!HasFailure()) fs::remove_all(dir);
  }
  // Lines of older runs, without the statistics, draw the heatmaps and no table.
  const fs::path old = make_synthetic_run("old_lines", ResidualMode::Mhar);
  EXPECT_EQ(count_of(render_run_report(old.string()), "Head disagreement and entropy"), 0);
  if (!HasFailure()) fs::remove_all(old);
}

}  // namespace
