// report.h: the run report, RUN_DIR/report.html: one self-contained HTML file (inline
// SVG and CSS, no scripts, no network, no external fonts) with the train and validation
// loss curves, learning rate, gradient norm and throughput, and for routed runs
// (attnres, mhar) a heatmap per routing site of the mean routing weight of every source,
// per head, at the latest evaluation, and the table of the heads' disagreement and
// entropies (engine/probe.h) when the lines carry them.
//
// Inputs (both written by the trainer): RUN_DIR/config.json (Config::to_json) and
// RUN_DIR/metrics.jsonl, one JSON object per line:
//   {"kind":"train","step","loss","lr","grad_norm","tokens_per_s","tokens","elapsed_s"}
//   {"kind":"eval","step","val_loss","val_ppl","tokens"}
//   {"kind":"routing","step","site","heads","weights":[[w_0..w_site] per head],
//    "name","sources","entropy","token_entropy","js","token_js"} (probe_metrics_lines;
//    lines of older runs have only the first five fields)
//   {"kind":"skip","step","reason"}
// Reading is forgiving, because the report is a diagnostic written while the run goes:
// unknown kinds and missing fields are ignored, a truncated last line (a write in
// progress) is skipped, other malformed lines are counted and mentioned in the report,
// and when a step appears twice (a resumed run) the later line wins.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model.h"

namespace mhar {

// Renders the report and writes RUN_DIR/report.html atomically (a temporary file in
// RUN_DIR, then rename), so a reader never sees half a report. Throws mhar::Error when
// RUN_DIR is not a directory or the file cannot be written.
void write_run_report(const std::string& run_dir);

// The HTML that write_run_report() writes (for tests and for printing).
std::string render_run_report(const std::string& run_dir);

// Pieces of the report that other pages reuse (the routing probe, engine/probe.h):
// the SVG heatmap of one site's weights [head][source] (viridis, scaled to the largest
// weight; sources named emb, a0, m0, ... under full routing, and emb, B1, B2, ..., cur
// (block sums, the current block's partial sum) with block_size > 1), the page's CSS,
// and HTML escaping.
std::string routing_heatmap_html(int site, const std::vector<std::vector<double>>& weights, int n_layers,
                                 int block_size = 0);
const char* report_css();
std::string html_escape(const std::string& s);

}  // namespace mhar
