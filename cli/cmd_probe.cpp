// cmd_probe.cpp: `mhar probe --checkpoint DIR --data GLOB [--batches N] [--out DIR]`:
// runs the checkpoint forward over the first batches of token shards and writes the
// routing probe (engine/probe.h) as OUT/probe.json and OUT/probe.html.
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "data/loader.h"
#include "engine/backend_factory.h"
#include "engine/checkpoint.h"
#include "engine/file_io.h"
#include "engine/probe.h"

namespace mhar::cli {

void register_probe(CLI::App& app) {
  auto* cmd = app.add_subcommand("probe", "Routing probe of a checkpoint: depth maps, head entropy and head disagreement");
  static std::string checkpoint, glob, out_dir = "probe", device = "auto";
  static long long batches = 20;
  static int batch_size = 0, seq_len = 0;
  cmd->add_option("--checkpoint", checkpoint, "Checkpoint directory, or a run directory (its newest)")->required();
  cmd->add_option("--data", glob, "Shard glob, e.g. 'data/val_*.bin'")->required();
  cmd->add_option("--batches", batches, "Batches to average over")->capture_default_str()->check(CLI::Range(1LL, 1LL << 40));
  cmd->add_option("--batch-size", batch_size, "Windows per batch (default: the checkpoint's train.micro_batch)");
  cmd->add_option("--seq-len", seq_len, "Tokens per window (default: the checkpoint's train.seq_len)");
  cmd->add_option("--out", out_dir, "Output folder for probe.json and probe.html")->capture_default_str();
  cmd->add_option("--device", device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->callback([] {
    const auto t0 = std::chrono::steady_clock::now();
    CheckpointInfo ckpt = open_checkpoint(checkpoint);
    const Config& cfg = ckpt.config;
    if (!cfg.residual.routed())
      fail(ckpt.dir, ": residual.mode is ", residual_mode_name(cfg.residual.mode),
           ": there is no routing to probe (attnres and mhar route)");
    const auto [B, T] = checkpoint_batch_shape(cfg, batch_size, seq_len, cfg.train.seq_len, "probe");
    data::DataLoader loader(glob, B, T, 0, 0, 1, cfg.model.vocab_size, data::LoaderMode::Sequential);
    if (loader.num_batches() == 0)
      fail(glob, ": ", loader.total_tokens(), " tokens are fewer than one batch of ", B, " x ", T + 1);
    auto backend = make_backend(device);
    Model model(cfg.model, cfg.residual, *backend, B, T);
    load_model_weights(ckpt, model);
    const long long n = std::min<long long>(batches, (long long)loader.num_batches());
    std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
    RoutingProbe probe;
    for (long long b = 0; b < n; ++b) {
      loader.next_batch(x.data(), y.data());
      model.forward(x.data(), y.data(), 0.0);
      probe.add(model);
    }
    nlohmann::json j = probe.to_json();
    j["checkpoint"] = ckpt.dir;
    j["step"] = ckpt.step;
    j["mode"] = residual_mode_name(cfg.residual.mode);
    j["batches"] = n;
    j["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::filesystem::create_directories(out_dir);
    const std::string jp = (std::filesystem::path(out_dir) / "probe.json").string();
    const std::string hp = (std::filesystem::path(out_dir) / "probe.html").string();
    write_file_atomic(jp, j.dump(1) + "\n");
    write_file_atomic(hp, render_probe_html(j, ckpt.dir + " (step " + std::to_string(ckpt.step) + ")"));
    std::printf("%s\n", nlohmann::json({{"json", jp}, {"html", hp}, {"tokens", probe.tokens()}, {"batches", n},
                                        {"seconds", j["seconds"]}}).dump().c_str());
  });
}

}  // namespace mhar::cli
