// probe.cpp: the routing probe's statistics and its page (see probe.h).
#include "engine/probe.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "engine/cpu/routing.h"
#include "engine/error.h"
#include "engine/report.h"

namespace mhar {

double entropy_nats(const double* p, int n) { return cpu::entropy_nats(p, n); }
double js_divergence(const double* p, const double* q, int n) { return cpu::js_divergence(p, q, n); }

// The host reduction of Backend::routing_stats (the default; see backend.h): downloads
// the site's pairs and the sums, reduces, uploads the sums.
void Backend::routing_stats(Tensor stats, Tensor weights, const RoutingLayout& layout, int site,
                            int heads) {
  const int64_t N = weights.dim(2);
  MHAR_CHECK(weights.ndim == 3 && weights.dim(0) == layout.pairs() && weights.dim(1) == heads &&
                 site >= 0 && site < layout.sites,
             "routing_stats shapes");
  const int src = layout.site_sources(site);
  const size_t pair_size = size_t(heads) * size_t(N);
  std::vector<double> a(size_t(src) * pair_size), st(size_t(stats.numel()));
  for (int t = 0; t < src; ++t)
    download(a.data() + size_t(t) * pair_size, weights[layout.pair(layout.site_source(site, t), site)]);
  download(st.data(), stats);
  cpu::routing_stats(st.data(), [&](int t) { return a.data() + size_t(t) * pair_size; }, src, heads, N);
  upload(stats, st.data());
}

RoutingProbe::~RoutingProbe() {
  if (buffer_) be_->release(buffer_);
}

void RoutingProbe::add(Model& model) {
  if (!model.residual().routed())
    fail("probe: the model's residual mode is ", residual_mode_name(model.residual().mode),
         ": it has no routing to probe (train attnres or mhar)");
  const int S = model.config().n_sites(), H = model.residual().heads;
  if (!buffer_) {
    be_ = &model.backend();
    heads_ = H;
    n_layers_ = model.config().n_layers;
    block_size_ = model.residual().block_size;
    offset_.assign(1, 0);
    sources_.clear();
    for (int j = 0; j < S; ++j) {
      sources_.push_back(model.routing_sources(j));
      offset_.push_back(offset_.back() + int64_t(H) * (sources_.back() + 1) + 1);
    }
    buffer_ = be_->allocate(size_t(offset_.back()) * sizeof(double));  // zero-filled
  }
  MHAR_CHECK(be_ == &model.backend() && heads_ == H && int(offset_.size()) == S + 1, "routing probe fed two models");
  for (int j = 0; j < S; ++j)
    model.routing_stats(j, Tensor(static_cast<double*>(buffer_) + offset_[j], DType::F64, {offset_[j + 1] - offset_[j]}));
  tokens_ += int64_t(model.batch()) * model.seq_len();
}

nlohmann::json RoutingProbe::to_json() const {
  nlohmann::json sites = nlohmann::json::array();
  std::vector<double> all(offset_.empty() ? 0 : size_t(offset_.back()));
  if (buffer_) be_->download(all.data(), Tensor(buffer_, DType::F64, {offset_.back()}));
  const double T = double(tokens_);
  for (size_t j = 0; j + 1 < offset_.size() && tokens_ > 0; ++j) {
    const double* s = all.data() + offset_[j];
    const int src = sources_[j];
    std::vector<std::vector<double>> mean(static_cast<size_t>(heads_), std::vector<double>(static_cast<size_t>(src)));
    nlohmann::json entropy = nlohmann::json::array(), token_entropy = nlohmann::json::array();
    for (int h = 0; h < heads_; ++h) {
      for (int i = 0; i < src; ++i) mean[size_t(h)][size_t(i)] = s[size_t(h) * src + i] / T;
      entropy.push_back(entropy_nats(mean[size_t(h)].data(), src));
      token_entropy.push_back(s[size_t(heads_) * src + h] / T);
    }
    nlohmann::json js = nullptr, token_js = nullptr;
    if (heads_ > 1) {
      double sum = 0;
      for (int h = 0; h < heads_; ++h)
        for (int g = h + 1; g < heads_; ++g) sum += js_divergence(mean[size_t(h)].data(), mean[size_t(g)].data(), src);
      js = sum / (0.5 * heads_ * (heads_ - 1));
      token_js = s[size_t(heads_) * (src + 1)] / T;
    }
    std::string name = j == 2 * size_t(n_layers_) ? "final norm"
                                                  : (j % 2 == 0 ? "attention " : "MLP ") + std::to_string(j / 2);
    sites.push_back({{"site", int(j)}, {"name", name}, {"sources", src}, {"mean_weights", mean},
                     {"entropy", entropy}, {"token_entropy", token_entropy}, {"js", js}, {"token_js", token_js}});
  }
  return {{"tokens", tokens_}, {"heads", heads_}, {"n_layers", n_layers_}, {"block_size", block_size_}, {"entropy_unit", "nats"},
          {"sites", sites}};
}

namespace {
std::string f4(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}
std::string f4(const nlohmann::json& v) { return v.is_number() ? f4(v.get<double>()) : "&ndash;"; }
}  // namespace

nlohmann::json probe_metrics_lines(const nlohmann::json& probe, int64_t step) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : probe["sites"])
    out.push_back({{"kind", "routing"}, {"step", step}, {"site", s["site"]}, {"name", s["name"]},
                   {"sources", s["sources"]}, {"heads", probe["heads"]}, {"weights", s["mean_weights"]},
                   {"entropy", s["entropy"]}, {"token_entropy", s["token_entropy"]}, {"js", s["js"]},
                   {"token_js", s["token_js"]}});
  return out;
}

std::string probe_summary_table_html(const nlohmann::json& sites) {
  std::ostringstream o;
  o << "<table id=\"summary\"><tr><th>site</th><th>input of</th><th>sources</th><th>JS between heads (mean maps)</th>"
    << "<th>JS between heads (per token)</th><th>entropy per head (mean map)</th><th>entropy per head (per token)</th></tr>";
  const auto text = [](const nlohmann::json& v) {
    return v.is_string() ? html_escape(v.get<std::string>()) : v.is_number() ? v.dump() : std::string("&ndash;");
  };
  for (const auto& s : sites) {
    std::string ent, tent;
    const nlohmann::json none = nlohmann::json::array();
    const auto& e = s.contains("entropy") && s["entropy"].is_array() ? s["entropy"] : none;
    const auto& te = s.contains("token_entropy") && s["token_entropy"].is_array() ? s["token_entropy"] : none;
    for (size_t h = 0; h < e.size(); ++h) ent += (h ? " " : "") + f4(e[h]);
    for (size_t h = 0; h < te.size(); ++h) tent += (h ? " " : "") + f4(te[h]);
    o << "<tr><td>" << text(s.value("site", nlohmann::json())) << "</td><td>" << text(s.value("name", nlohmann::json()))
      << "</td><td>" << text(s.value("sources", nlohmann::json())) << "</td><td>" << f4(s.value("js", nlohmann::json()))
      << "</td><td>" << f4(s.value("token_js", nlohmann::json())) << "</td><td>" << ent << "</td><td>" << tent
      << "</td></tr>";
  }
  o << "</table>";
  return o.str();
}

std::string render_probe_html(const nlohmann::json& probe, const std::string& title) {
  const int n_layers = probe.value("n_layers", 0);
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>mhar routing probe: "
    << html_escape(title) << "</title><style>" << report_css() << "</style></head><body>\n<h1>mhar routing probe: "
    << html_escape(title) << "</h1><div class=\"muted\">" << probe.value("tokens", int64_t(0)) << " tokens, "
    << probe.value("heads", 0) << " routing head(s) per site; entropies and Jensen-Shannon divergences in nats "
    << "(ln 2 = 0.6931 is the largest divergence)</div>\n<h2>Head disagreement and entropy by site</h2>"
    << probe_summary_table_html(probe["sites"])
    << "\n<h2>Depth maps: mean routing weight of each source, per head</h2><div class=\"heatmaps\">";
  for (const auto& s : probe["sites"])
    o << routing_heatmap_html(s["site"].get<int>(), s["mean_weights"].get<std::vector<std::vector<double>>>(), n_layers,
                              probe.value("block_size", 0));
  o << "</div>\n</body></html>\n";
  return o.str();
}

}  // namespace mhar
