// probe.h: routing probes (`mhar probe`): which depths each routing head reads.
//
// Per site j and head h, over every token of the forwards it is given:
//   mean_weights[h][i]  the mean routing weight of source i (the paper's depth map);
//   entropy[h]          the entropy (nats) of that mean distribution;
//   token_entropy[h]    the mean over tokens of the entropy of the token's distribution;
//   js                  the mean over head pairs h < h' of the Jensen-Shannon divergence
//                       (nats, natural log, in [0, ln 2]) between their mean
//                       distributions: the disagreement between heads that separates
//                       MHAR from AttnRes (null for a single head);
//   token_js            the same divergence per token, averaged over tokens.
// Reduced where the model runs (Backend::routing_stats): a small buffer of sums per site
// stays in the backend's memory across batches and is downloaded once, by to_json(),
// instead of every routing pair of every batch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model.h"

namespace mhar {

double entropy_nats(const double* p, int n);
// JS(p, q) = (KL(p||m) + KL(q||m)) / 2 with m = (p + q) / 2, natural log.
double js_divergence(const double* p, const double* q, int n);

class RoutingProbe {
 public:
  RoutingProbe() = default;
  ~RoutingProbe();
  RoutingProbe(const RoutingProbe&) = delete;
  RoutingProbe& operator=(const RoutingProbe&) = delete;

  // After a forward; fails for a standard (unrouted) model. Every call must see the same
  // model (its backend must outlive the probe).
  void add(Model& model);
  int64_t tokens() const { return tokens_; }
  // {"tokens","heads","n_layers","block_size","entropy_unit","sites":[{"site","name","sources",
  //   "mean_weights","entropy","token_entropy","js","token_js"}]}
  nlohmann::json to_json() const;

 private:
  Backend* be_ = nullptr;
  void* buffer_ = nullptr;  // F64 sums of every site, back to back
  std::vector<int64_t> offset_;  // per site, plus the total
  std::vector<int> sources_;     // per site: how many sources it mixes
  int heads_ = 0, n_layers_ = 0, block_size_ = 0;
  int64_t tokens_ = 0;
};

// The probe's sites as metrics.jsonl lines, one per site: {"kind":"routing","step",
// "site","name","sources","heads","weights" (= mean_weights),"entropy","token_entropy",
// "js","token_js"}: what the trainer logs at each evaluation and the run report draws.
nlohmann::json probe_metrics_lines(const nlohmann::json& probe, int64_t step);

// The table over sites (JS divergence between heads, entropies per head) of a probe's
// "sites" array, or of metrics lines in that shape: the probe page's and the run report's.
std::string probe_summary_table_html(const nlohmann::json& sites);

// A self-contained HTML page of a probe's JSON: one heatmap per site (the run report's,
// engine/report.h) with its entropies and head disagreement, and a table over sites.
std::string render_probe_html(const nlohmann::json& probe, const std::string& title);

}  // namespace mhar
