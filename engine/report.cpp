// report.cpp: reading the run directory (config.json, metrics.jsonl), rendering the
// report (summary, SVG line charts, routing heatmaps) and the routing-weight averages
// the trainer logs. Everything is drawn server-side into inline SVG so the file opens
// anywhere, offline, with no scripts; long runs are bucket-averaged to at most
// kMaxPointsPerSeries points per curve so the file stays small at any step count.
#include "engine/report.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/probe.h"

namespace mhar {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr size_t kMaxPointsPerSeries = 1200;

// ---------------------------------------------------------------- reading the run

struct TrainRow {
  double loss = kNaN, lr = kNaN, grad_norm = kNaN, tokens_per_s = kNaN, tokens = kNaN,
         elapsed_s = kNaN;
};
struct EvalRow {
  double val_loss = kNaN, val_ppl = kNaN, tokens = kNaN;
};
struct RoutingSite {
  int heads = 0;
  std::vector<std::vector<double>> weights;  // [head][source]
  json line;  // the whole metrics line: the probe's entropies and divergences, when logged
};

struct RunData {
  std::string run_dir;
  json config;             // null when missing or unreadable
  std::string config_note; // why the config is missing, if it is
  bool have_metrics = false;
  std::map<int64_t, TrainRow> train;
  std::map<int64_t, EvalRow> eval;
  // The routing of the latest step that has any (only that one is drawn; keeping one
  // bounds memory for long runs of big models).
  int64_t routing_step = -1;
  std::map<int, RoutingSite> routing;  // site -> weights
  std::vector<std::pair<int64_t, std::string>> skips;
  int64_t lines = 0, malformed = 0, unknown_kinds = 0;
  bool truncated_last_line = false;
};

// A number from a metrics line: NaN when absent or not a number (nlohmann writes
// non-finite doubles as null).
double number(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

bool integer(const json& j, const char* key, int64_t& out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return false;
  const double v = it->get<double>();
  if (!std::isfinite(v)) return false;
  out = int64_t(v);
  return true;
}

void read_metrics_line(RunData& run, const json& j) {
  if (!j.is_object()) {
    ++run.malformed;
    return;
  }
  const std::string kind = j.value("kind", std::string());
  int64_t step = 0;
  if (kind != "train" && kind != "eval" && kind != "routing" && kind != "skip") {
    ++run.unknown_kinds;
    return;
  }
  if (!integer(j, "step", step)) {
    ++run.malformed;
    return;
  }
  if (kind == "train") {
    TrainRow r;
    r.loss = number(j, "loss");
    r.lr = number(j, "lr");
    r.grad_norm = number(j, "grad_norm");
    r.tokens_per_s = number(j, "tokens_per_s");
    r.tokens = number(j, "tokens");
    r.elapsed_s = number(j, "elapsed_s");
    run.train[step] = r;
  } else if (kind == "eval") {
    EvalRow r;
    r.val_loss = number(j, "val_loss");
    r.val_ppl = number(j, "val_ppl");
    r.tokens = number(j, "tokens");
    run.eval[step] = r;
  } else if (kind == "skip") {
    auto it = j.find("reason");
    run.skips.emplace_back(step, it != j.end() ? (it->is_string() ? it->get<std::string>() : it->dump())
                                               : std::string("(no reason given)"));
  } else {  // routing
    int64_t site = -1, heads = 0;
    auto w = j.find("weights");
    if (!integer(j, "site", site) || site < 0 || w == j.end() || !w->is_array() || w->empty()) {
      ++run.malformed;
      return;
    }
    RoutingSite rs;
    rs.heads = integer(j, "heads", heads) ? int(heads) : int(w->size());
    for (const json& row : *w) {
      if (!row.is_array()) {
        ++run.malformed;
        return;
      }
      std::vector<double> r;
      for (const json& x : row) r.push_back(x.is_number() ? x.get<double>() : kNaN);
      rs.weights.push_back(std::move(r));
    }
    rs.line = j;
    if (step < run.routing_step) return;
    if (step > run.routing_step) {
      run.routing.clear();
      run.routing_step = step;
    }
    run.routing[int(site)] = std::move(rs);
  }
}

RunData read_run(const std::string& run_dir) {
  RunData run;
  run.run_dir = run_dir;
  const fs::path dir(run_dir);
  const fs::path config_path = dir / "config.json";
  if (!fs::exists(config_path)) {
    run.config_note = "config.json not found";
  } else {
    std::ifstream in(config_path);
    try {
      run.config = json::parse(in);
    } catch (const json::exception& e) {
      run.config = nullptr;
      run.config_note = std::string("config.json is not valid JSON: ") + e.what();
    }
  }
  std::ifstream in(dir / "metrics.jsonl", std::ios::binary);
  if (!in) return run;
  run.have_metrics = true;
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const bool last = end == std::string::npos;
    if (last) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++run.lines;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      // A last line without its newline is a write in progress, not damage.
      if (last) run.truncated_last_line = true;
      else ++run.malformed;
      continue;
    }
    read_metrics_line(run, j);
  }
  return run;
}

// ---------------------------------------------------------------- formatting

std::string escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Compact, readable numbers for labels: 3.142, 0.0005, 1.2e+04, 20000.
std::string num(double v) {
  if (!std::isfinite(v)) return "–";
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-4)) return fmt("%.2e", v);
  if (a >= 1000) return fmt("%.0f", v);
  return fmt("%.4g", v);
}

std::string count(double v) {  // 1234567 -> 1.23M
  if (!std::isfinite(v)) return "–";
  const double a = std::fabs(v);
  if (a >= 1e12) return fmt("%.2fT", v / 1e12);
  if (a >= 1e9) return fmt("%.2fG", v / 1e9);
  if (a >= 1e6) return fmt("%.2fM", v / 1e6);
  if (a >= 1e4) return fmt("%.1fk", v / 1e3);
  return fmt("%.0f", v);
}

std::string duration(double s) {
  if (!std::isfinite(s)) return "–";
  const long long t = (long long)std::llround(s);
  char buf[64];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh %02lldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm %02llds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

// ---------------------------------------------------------------- line charts

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;  // (step, value); NaN values break the line
  double width = 1.6;
  double opacity = 1.0;
  bool markers = false;
};

// Averages runs of consecutive points so a curve has at most `max_points` points.
std::vector<std::pair<double, double>> downsample(const std::vector<std::pair<double, double>>& p,
                                                  size_t max_points) {
  if (p.size() <= max_points) return p;
  std::vector<std::pair<double, double>> out;
  const double per = double(p.size()) / double(max_points);
  for (size_t b = 0; b < max_points; ++b) {
    const size_t lo = size_t(double(b) * per), hi = std::min(p.size(), size_t(double(b + 1) * per));
    double sx = 0, sy = 0;
    size_t n = 0;
    for (size_t i = lo; i < hi; ++i)
      if (std::isfinite(p[i].second)) {
        sx += p[i].first;
        sy += p[i].second;
        ++n;
      }
    if (n) out.emplace_back(sx / double(n), sy / double(n));
    else if (hi > lo) out.emplace_back(p[lo].first, kNaN);
  }
  return out;
}

// Centred moving average over +-half_width points (NaNs skipped): unlike an EMA it does
// not lag behind a falling loss.
std::vector<std::pair<double, double>> smooth(const std::vector<std::pair<double, double>>& p,
                                              size_t half_width) {
  std::vector<double> sum(p.size() + 1, 0.0), n(p.size() + 1, 0.0);
  for (size_t i = 0; i < p.size(); ++i) {
    const bool ok = std::isfinite(p[i].second);
    sum[i + 1] = sum[i] + (ok ? p[i].second : 0.0);
    n[i + 1] = n[i] + (ok ? 1.0 : 0.0);
  }
  std::vector<std::pair<double, double>> out;
  for (size_t i = 0; i < p.size(); ++i) {
    const size_t lo = i > half_width ? i - half_width : 0, hi = std::min(p.size(), i + half_width + 1);
    if (n[hi] - n[lo] > 0) out.emplace_back(p[i].first, (sum[hi] - sum[lo]) / (n[hi] - n[lo]));
  }
  return out;
}

// About `n` round tick values (1, 2, 5 x 10^k steps) covering [lo, hi].
std::vector<double> nice_ticks(double lo, double hi, int n) {
  std::vector<double> t;
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / mag, step = (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * mag;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
    t.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  return t;
}

std::string line_chart(const std::string& title, const std::vector<Series>& series_in,
                       const std::string& note = "", bool allow_log_y = false) {
  constexpr double W = 560, H = 300, left = 64, right = 16, top = 34, bottom = 40;
  const double pw = W - left - right, ph = H - top - bottom;
  std::vector<Series> series = series_in;
  for (auto& s : series) s.points = downsample(s.points, kMaxPointsPerSeries);

  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y) || !std::isfinite(x)) continue;
      x0 = std::min(x0, x), x1 = std::max(x1, x);
      y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  std::ostringstream o;
  o << "<figure class=\"chart\"><svg viewBox=\"0 0 " << W << " " << H << "\" width=\"" << W
    << "\" height=\"" << H << "\" role=\"img\" aria-label=\"" << escape(title) << "\">";
  o << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#ffffff\"/>";
  o << "<text x=\"" << left << "\" y=\"20\" class=\"ct\">" << escape(title) << "</text>";
  if (!std::isfinite(x0)) {
    o << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"#f6f7f9\" stroke=\"#d0d4da\"/><text x=\"" << left + pw / 2 << "\" y=\""
      << top + ph / 2 << "\" text-anchor=\"middle\" class=\"muted\">no data yet</text></svg>";
    o << "</figure>";
    return o.str();
  }
  // A log axis when the values are positive and span more than two decades (gradient
  // norms early in training), otherwise linear.
  const bool log_y = allow_log_y && y0 > 0 && y1 / y0 > 100;
  auto fy = [&](double y) { return log_y ? std::log10(y) : y; };
  double ly0 = fy(y0), ly1 = fy(y1);
  if (ly1 - ly0 < 1e-12 * std::max(1.0, std::fabs(ly1))) {  // flat: give it some height
    const double pad = std::max(std::fabs(ly1) * 0.05, 1e-6);
    ly0 -= pad, ly1 += pad;
  } else {
    const double pad = (ly1 - ly0) * 0.04;
    ly0 -= pad, ly1 += pad;
  }
  if (x1 == x0) x0 -= 1, x1 += 1;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (fy(y) - ly0) / (ly1 - ly0)) * ph; };

  o << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"#fbfcfd\" stroke=\"#d0d4da\"/>";
  // Grid and ticks.
  std::vector<double> yt;
  if (log_y) {
    for (double e = std::ceil(ly0); e <= ly1; e += 1) yt.push_back(std::pow(10.0, e));
  } else {
    yt = nice_ticks(ly0, ly1, 5);
  }
  for (double v : yt) {
    const double y = log_y ? top + (1 - (std::log10(v) - ly0) / (ly1 - ly0)) * ph : top + (1 - (v - ly0) / (ly1 - ly0)) * ph;
    if (y < top - 0.5 || y > top + ph + 0.5) continue;
    o << "<line x1=\"" << left << "\" x2=\"" << left + pw << "\" y1=\"" << y << "\" y2=\"" << y
      << "\" class=\"grid\"/><text x=\"" << left - 6 << "\" y=\"" << y + 4
      << "\" text-anchor=\"end\" class=\"tick\">" << escape(num(v)) << "</text>";
  }
  for (double v : nice_ticks(x0, x1, 6)) {
    const double x = px(v);
    o << "<line x1=\"" << x << "\" x2=\"" << x << "\" y1=\"" << top << "\" y2=\"" << top + ph
      << "\" class=\"grid\"/><text x=\"" << x << "\" y=\"" << top + ph + 16
      << "\" text-anchor=\"middle\" class=\"tick\">" << escape(count(v)) << "</text>";
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 6
    << "\" text-anchor=\"middle\" class=\"tick\">step" << (log_y ? " (log y axis)" : "")
    << "</text>";
  // Curves.
  for (const auto& s : series) {
    std::ostringstream path;
    bool pen_down = false;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) {
        pen_down = false;
        continue;
      }
      path << (pen_down ? " L" : " M") << fmt("%.1f", px(x)) << "," << fmt("%.1f", py(y));
      pen_down = true;
    }
    o << "<path d=\"" << path.str() << "\" fill=\"none\" stroke=\"" << s.color
      << "\" stroke-width=\"" << s.width << "\" stroke-opacity=\"" << s.opacity
      << "\" stroke-linejoin=\"round\"/>";
    if (s.markers)
      for (const auto& [x, y] : s.points)
        if (std::isfinite(y))
          o << "<circle cx=\"" << fmt("%.1f", px(x)) << "\" cy=\"" << fmt("%.1f", py(y))
            << "\" r=\"3\" fill=\"" << s.color << "\"><title>step " << count(x) << ": "
            << escape(num(y)) << "</title></circle>";
  }
  // Legend (top right).
  double lx = left + pw - 8;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    const double w = 7.0 * double(it->name.size()) + 26;
    lx -= w;
    o << "<line x1=\"" << lx << "\" x2=\"" << lx + 16 << "\" y1=\"" << top + 12 << "\" y2=\""
      << top + 12 << "\" stroke=\"" << it->color << "\" stroke-width=\"3\"/><text x=\""
      << lx + 20 << "\" y=\"" << top + 16 << "\" class=\"tick\">" << escape(it->name)
      << "</text>";
  }
  o << "</svg>";
  if (!note.empty()) o << "<figcaption>" << escape(note) << "</figcaption>";
  o << "</figure>";
  return o.str();
}

// ---------------------------------------------------------------- routing heatmaps

// Viridis at five stops, linearly interpolated: perceptually even and readable in grey.
std::string viridis(double t) {
  static const double stops[5][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::isfinite(t) ? std::clamp(t, 0.0, 1.0) : 0.0;
  const double f = t * 4;
  const int i = std::min(3, int(f));
  const double u = f - i;
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x",
                int(std::lround(stops[i][0] + u * (stops[i + 1][0] - stops[i][0]))),
                int(std::lround(stops[i][1] + u * (stops[i + 1][1] - stops[i][1]))),
                int(std::lround(stops[i][2] + u * (stops[i + 1][2] - stops[i][2]))));
  return buf;
}

// Source t of a site's routing. Full routing: source i is v_i, v_0 the embedding, v_{2l+1}
// attention of layer l, v_{2l+2} its MLP (DESIGN.md 2). Blocks of s sublayers: source 0 is
// the embedding, source m >= 1 up to the site's closed blocks is block m's sum (sublayer
// outputs v_{(m-1)s+1} .. v_{ms}), and a site inside a block also reads the block's
// partial sum so far, its last source ("cur").
std::string source_name(int t, int site, int block) {
  if (t == 0) return "emb";
  if (block <= 1) return (t % 2 ? "a" : "m") + std::to_string((t - 1) / 2);
  return t <= site / block ? "B" + std::to_string(t) : "cur";
}
std::string source_detail(int t, int site, int block) {
  if (t == 0 || block <= 1) return source_name(t, site, block);
  if (t <= site / block)
    return "block " + std::to_string(t) + ": v" + std::to_string((t - 1) * block + 1) + "..v" + std::to_string(t * block);
  return "current block so far: v" + std::to_string(site / block * block + 1) + "..v" + std::to_string(site);
}

std::string site_name(int j, int n_layers) {
  if (n_layers > 0 && j == 2 * n_layers) return "final norm";
  return (j % 2 == 0 ? "attention " : "MLP ") + std::to_string(j / 2);
}

std::string heatmap(int site, const RoutingSite& rs, int n_layers, int block) {
  const int H = int(rs.weights.size());
  size_t n_src = 0;
  double vmax = 0;
  for (const auto& row : rs.weights) {
    n_src = std::max(n_src, row.size());
    for (double w : row)
      if (std::isfinite(w)) vmax = std::max(vmax, w);
  }
  if (vmax <= 0) vmax = 1;
  const double cw = std::clamp(420.0 / double(std::max<size_t>(n_src, 1)), 7.0, 26.0);
  const double ch = H > 12 ? 10 : 14, left = 30, top = 6;
  const double width = left + cw * double(n_src) + 6, height = top + ch * H + 30;
  // Label every k-th source so labels never overlap.
  const int label_every = std::max(1, int(std::ceil(22.0 / cw)));
  std::ostringstream o;
  o << "<figure class=\"heatmap\"><figcaption><b>site " << site << "</b> &rarr; "
    << escape(site_name(site, n_layers)) << " input <span class=\"muted\">max "
    << escape(fmt("%.3f", vmax)) << ", uniform " << escape(fmt("%.3f", 1.0 / double(std::max<size_t>(n_src, 1))))
    << "</span></figcaption><svg viewBox=\"0 0 " << width << " " << height << "\" width=\""
    << width << "\" height=\"" << height << "\">";
  for (int h = 0; h < H; ++h) {
    const double y = top + ch * h;
    o << "<text x=\"" << left - 4 << "\" y=\"" << y + ch - 3
      << "\" text-anchor=\"end\" class=\"hl\">h" << h << "</text>";
    for (size_t i = 0; i < rs.weights[size_t(h)].size(); ++i) {
      const double w = rs.weights[size_t(h)][i];
      o << "<rect x=\"" << fmt("%.2f", left + cw * double(i)) << "\" y=\"" << y << "\" width=\""
        << fmt("%.2f", cw) << "\" height=\"" << ch << "\" fill=\"" << viridis(w / vmax)
        << "\"><title>site " << site << ", head " << h << ", source " << i << " ("
        << escape(source_detail(int(i), site, block)) << "): " << escape(fmt("%.4f", w)) << "</title></rect>";
    }
  }
  for (size_t i = 0; i < n_src; i += size_t(label_every))
    o << "<text x=\"" << fmt("%.2f", left + cw * (double(i) + 0.5)) << "\" y=\""
      << top + ch * H + 12 << "\" text-anchor=\"middle\" class=\"hl\">"
      << escape(source_name(int(i), site, block)) << "</text>";
  o << "</svg></figure>";
  return o.str();
}

// ---------------------------------------------------------------- the page

const char* kStyle = R"(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px;color:#1d2330;background:#eef1f5}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 10px}
.muted{color:#6b7280} .warn{color:#9a3412;background:#fff4e5;padding:6px 10px;border-radius:4px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{background:#fff;border:1px solid #d8dde5;border-radius:6px;padding:8px 14px;min-width:120px}
.card .v{font-size:19px;font-weight:600} .card .k{font-size:12px;color:#6b7280}
.charts{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0} .chart{background:#fff;border:1px solid #d8dde5;border-radius:6px;padding:4px}
.chart figcaption{font-size:12px;color:#6b7280;padding:0 8px 6px}
.heatmaps{display:flex;flex-wrap:wrap;gap:10px;align-items:flex-start}
.heatmap{background:#fff;border:1px solid #d8dde5;border-radius:6px;padding:6px 8px}
.heatmap figcaption{font-size:12px;margin-bottom:2px}
svg text{font-family:inherit} .ct{font-size:14px;font-weight:600;fill:#1d2330}
.tick{font-size:11px;fill:#4b5563} .hl{font-size:9px;fill:#4b5563} .grid{stroke:#e5e8ec;stroke-width:1}
table{border-collapse:collapse;background:#fff;font-size:13px} td,th{border:1px solid #d8dde5;padding:3px 8px;text-align:left}
pre{background:#fff;border:1px solid #d8dde5;padding:10px;font-size:12px;overflow:auto}
)";

std::string card(const std::string& value, const std::string& key) {
  return "<div class=\"card\"><div class=\"v\">" + escape(value) + "</div><div class=\"k\">" +
         escape(key) + "</div></div>";
}

const json* find_path(const json& j, std::initializer_list<const char*> path) {
  const json* cur = &j;
  for (const char* k : path) {
    if (!cur->is_object()) return nullptr;
    auto it = cur->find(k);
    if (it == cur->end()) return nullptr;
    cur = &*it;
  }
  return cur;
}

std::string config_text(const json& cfg, std::initializer_list<const char*> path) {
  const json* v = find_path(cfg, path);
  if (!v) return "–";
  return v->is_string() ? v->get<std::string>() : v->dump();
}

std::string render(const RunData& run) {
  const json& cfg = run.config;
  const std::string mode = cfg.is_object() ? config_text(cfg, {"residual", "mode"}) : "–";
  const json* layers_j = cfg.is_object() ? find_path(cfg, {"model", "n_layers"}) : nullptr;
  const int n_layers = layers_j && layers_j->is_number_integer() ? layers_j->get<int>() : 0;
  const json* block_j = cfg.is_object() ? find_path(cfg, {"residual", "block_size"}) : nullptr;
  const int block = block_j && block_j->is_number_integer() ? block_j->get<int>() : 0;
  std::string name = fs::path(run.run_dir).filename().string();
  if (name.empty() || name == ".") name = fs::absolute(run.run_dir).lexically_normal().string();

  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
    << "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
    << "<title>mhar run report: " << escape(name) << "</title><style>" << kStyle
    << "</style></head><body>\n";
  char when[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  o << "<h1>mhar run report: " << escape(name) << "</h1><div class=\"muted\">"
    << escape(fs::absolute(run.run_dir).lexically_normal().string()) << " &middot; generated "
    << escape(when) << " by mhar " << MHAR_VERSION << "</div>\n";

  // Warnings about the inputs.
  if (!run.config_note.empty())
    o << "<p class=\"warn\">" << escape(run.config_note) << "</p>";
  if (!run.have_metrics)
    o << "<p class=\"warn\">metrics.jsonl not found: no metrics yet.</p>";
  if (run.malformed)
    o << "<p class=\"warn\">" << run.malformed << " malformed line(s) in metrics.jsonl were skipped.</p>";

  // Series.
  std::vector<std::pair<double, double>> loss, lr, gnorm, tps, val;
  double last_tokens = kNaN, last_elapsed = kNaN;
  for (const auto& [step, r] : run.train) {
    const double x = double(step);
    loss.emplace_back(x, r.loss);
    lr.emplace_back(x, r.lr);
    gnorm.emplace_back(x, r.grad_norm);
    tps.emplace_back(x, r.tokens_per_s);
    if (std::isfinite(r.tokens)) last_tokens = r.tokens;
    if (std::isfinite(r.elapsed_s)) last_elapsed = r.elapsed_s;
  }
  int64_t best_step = -1;
  double best_val = kNaN, last_val = kNaN;
  for (const auto& [step, r] : run.eval) {
    val.emplace_back(double(step), r.val_loss);
    if (std::isfinite(r.val_loss)) {
      last_val = r.val_loss;
      if (!(best_val <= r.val_loss)) best_val = r.val_loss, best_step = step;
    }
  }
  // Smoothing scaled to the run length (a window of ~4% of the steps), none for very
  // short runs.
  const size_t half_width = std::min<size_t>(loss.size() / 50, 500);
  const auto loss_smooth = smooth(loss, half_width);
  double mean_tps = kNaN;
  {
    // Throughput over the last 10% of steps: the steady state, past warm-up effects.
    double s = 0;
    int n = 0;
    for (size_t i = tps.size() - std::min(tps.size(), std::max<size_t>(1, tps.size() / 10));
         i < tps.size(); ++i)
      if (std::isfinite(tps[i].second)) s += tps[i].second, ++n;
    if (n) mean_tps = s / n;
  }

  // Summary cards.
  const int64_t last_step = run.train.empty() ? 0 : run.train.rbegin()->first;
  const std::string planned = cfg.is_object() ? config_text(cfg, {"train", "steps"}) : "–";
  o << "<div class=\"cards\">" << card(mode, "residual mode")
    << card(std::to_string(last_step) + " / " + planned, "steps")
    << card(count(last_tokens), "tokens seen") << card(duration(last_elapsed), "elapsed")
    << card(loss_smooth.empty() ? "–" : num(loss_smooth.back().second), "train loss (smoothed)")
    << card(num(last_val), "last val loss")
    << card(best_step < 0 ? "–" : num(best_val) + " @" + std::to_string(best_step), "best val loss")
    << card(count(mean_tps), "tokens/s (recent)")
    << card(std::to_string(run.skips.size()), "skipped steps") << "</div>\n";

  // Charts.
  std::vector<Series> loss_series;
  loss_series.push_back({"train", "#93c5fd", loss, 1.0, 0.9, false});
  if (half_width > 0) loss_series.push_back({"train (smoothed)", "#1d4ed8", loss_smooth, 2.0, 1.0, false});
  // Markers while they stay readable; a long run's many evaluations make a line.
  loss_series.push_back({"validation", "#dc2626", val, 2.0, 1.0, val.size() <= 60});
  o << "<h2>Training</h2><div class=\"charts\">"
    << line_chart("Loss", loss_series,
                  "cross-entropy per token (nats); validation at each evaluation")
    << line_chart("Learning rate", {{"lr", "#7c3aed", lr}})
    << line_chart("Gradient norm", {{"global norm (before clipping)", "#ea580c", gnorm}}, "", true)
    << line_chart("Throughput", {{"tokens/s", "#059669", tps}})
    << "</div>\n";

  // Routing.
  const bool routed = mode == "attnres" || mode == "mhar" || !run.routing.empty();
  if (routed) {
    o << "<h2>Routing</h2>";
    if (run.routing.empty()) {
      o << "<p class=\"muted\">No routing weights logged yet (they are written at each "
           "evaluation).</p>";
    } else {
      o << "<p class=\"muted\">Mean routing weight of each source (columns: emb = embedding, "
           "a<i>l</i> / m<i>l</i> = attention / MLP output of layer <i>l</i>) per routing head "
           "(rows), over the validation tokens at step "
        << run.routing_step << ". Colour scale per site from 0 (dark) to the site's largest weight "
           "(yellow); hover a cell for its value.</p><div class=\"heatmaps\">";
      for (const auto& [site, rs] : run.routing) o << heatmap(site, rs, n_layers, block);
      o << "</div>\n";
      json sites = json::array();  // lines written before the probe's statistics have none
      for (const auto& [site, rs] : run.routing)
        if (rs.line.contains("entropy")) sites.push_back(rs.line);
      if (!sites.empty())
        o << "<h3>Head disagreement and entropy by site</h3><p class=\"muted\">Over the same tokens: "
             "the mean pairwise Jensen-Shannon divergence between the heads' depth distributions "
             "(of the mean maps above, and per token averaged over tokens) and each head's entropy, "
             "in nats (ln 2 = 0.6931 is the largest divergence; see <code>mhar probe</code>).</p>"
          << probe_summary_table_html(sites) << "\n";
    }
  }

  // Skips.
  if (!run.skips.empty()) {
    o << "<h2>Skipped steps</h2><table><tr><th>step</th><th>reason</th></tr>";
    const size_t first = run.skips.size() > 50 ? run.skips.size() - 50 : 0;
    for (size_t i = first; i < run.skips.size(); ++i)
      o << "<tr><td>" << run.skips[i].first << "</td><td>" << escape(run.skips[i].second)
        << "</td></tr>";
    o << "</table>";
    if (first) o << "<p class=\"muted\">(the last 50 of " << run.skips.size() << ")</p>";
  }

  // Config.
  if (cfg.is_object()) {
    o << "<h2>Configuration</h2><table>";
    auto row = [&](const char* label, const std::string& value) {
      o << "<tr><th>" << escape(label) << "</th><td>" << escape(value) << "</td></tr>";
    };
    row("d_model", config_text(cfg, {"model", "d_model"}));
    row("layers", config_text(cfg, {"model", "n_layers"}));
    row("heads / KV heads", config_text(cfg, {"model", "n_heads"}) + " / " +
                                config_text(cfg, {"model", "n_kv_heads"}));
    row("head_dim", config_text(cfg, {"model", "head_dim"}));
    row("d_ff", config_text(cfg, {"model", "d_ff"}));
    row("vocab", config_text(cfg, {"model", "vocab_size"}));
    row("context", config_text(cfg, {"model", "context_length"}));
    if (mode == "hyper") row("hyper streams", config_text(cfg, {"residual", "hyper_n"}));
    else row("routing heads", config_text(cfg, {"residual", "heads"}));
    row("lr", config_text(cfg, {"train", "lr"}));
    row("schedule", config_text(cfg, {"train", "schedule"}));
    row("batch tokens", config_text(cfg, {"train", "batch_tokens"}));
    row("micro batch x seq_len", config_text(cfg, {"train", "micro_batch"}) + " x " +
                                     config_text(cfg, {"train", "seq_len"}));
    row("seed", config_text(cfg, {"train", "seed"}));
    o << "</table><details><summary>config.json</summary><pre>" << escape(cfg.dump(2))
      << "</pre></details>\n";
  }
  o << "<p class=\"muted\">" << run.lines << " metrics lines read";
  if (run.unknown_kinds) o << ", " << run.unknown_kinds << " of unknown kinds ignored";
  if (run.truncated_last_line) o << ", the last line incomplete (being written) and skipped";
  o << ".</p></body></html>\n";
  return o.str();
}

}  // namespace

std::string render_run_report(const std::string& run_dir) {
  if (!fs::is_directory(run_dir))
    fail(run_dir, ": not a directory (expected a run directory written by `mhar train`)");
  return render(read_run(run_dir));
}

void write_run_report(const std::string& run_dir) {
  write_file_atomic((fs::path(run_dir) / "report.html").string(), render_run_report(run_dir));
}

// ---------------------------------------------------------------- pieces reused elsewhere

std::string routing_heatmap_html(int site, const std::vector<std::vector<double>>& weights, int n_layers,
                                 int block_size) {
  RoutingSite rs;
  rs.heads = int(weights.size());
  rs.weights = weights;
  return heatmap(site, rs, n_layers, block_size);
}
const char* report_css() { return kStyle; }
std::string html_escape(const std::string& s) { return escape(s); }

}  // namespace mhar
