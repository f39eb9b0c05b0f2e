// cmd_import.cpp: `mhar import --hf HF_DIR --out RUN_DIR [--set k=v ...] [--overwrite]`
// brings a Hugging Face Qwen3 model (or an mhar export) in as a run directory with a
// step-0 checkpoint (engine/hf_import.h). The tokenizer and the data named by --set are
// checked here, where the data library is at hand.
#include <cstdio>

#include "cli/commands.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "engine/error.h"
#include "engine/hf_export.h"
#include "engine/hf_import.h"
#include "engine/trainer.h"

namespace mhar::cli {

void register_import(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "import", "Bring a Hugging Face Qwen3 model (or an mhar export) in as a run directory with a checkpoint");
  cmd->footer(
      "Reads config.json and model.safetensors (or the shards of model.safetensors.index.json;\n"
      "F32, BF16 or F16). The run config takes the model from config.json and defaults for the\n"
      "rest; --set changes any field. The tokenizer is HF_DIR's tokenizer.json (copied into\n"
      "RUN_DIR) unless --set data.tokenizer=gpt2|qwen3|PATH names another. The checkpoint\n"
      "(step 0, a fresh optimizer) serves `mhar eval`, `mhar sample` and `mhar train CONFIG\n"
      "--init-from RUN_DIR`; with --set data.train=GLOB --set data.val=GLOB, also `mhar train\n"
      "--resume RUN_DIR`. Unsupported models (sliding window, RoPE scaling, biases, MoE) are\n"
      "refused naming the field.");
  static std::string hf, out;
  static std::vector<std::string> sets;
  static bool overwrite = false;
  cmd->add_option("--hf", hf, "Hugging Face model directory (config.json + *.safetensors)")->required();
  cmd->add_option("--out", out, "Run directory to create (must not exist, unless --overwrite)")->required();
  cmd->add_option("--set", sets, "Set a field of the run config, e.g. --set train.lr=3e-4");
  cmd->add_flag("--overwrite", overwrite, "Replace --out if it exists (once the new one is complete)");
  cmd->callback([] {
    if (path_within(hf, out))
      fail("--out ", out, " holds the model being imported (", hf, "); choose another directory");
    const HfImportPlan plan = plan_hf_import(hf, out, sets);
    Config cfg = plan.config;
    resolve_data_paths(cfg);  // relative --set paths are relative to the working directory

    const std::string tok_src = plan.tokenizer_source.empty() ? cfg.data.tokenizer : plan.tokenizer_source;
    const data::Tokenizer tok = [&] {
      try {
        return data::Tokenizer::load(tok_src);
      } catch (const Error& e) {
        fail(e.what(), "\n  (the model's tokenizer; name another with --set data.tokenizer=gpt2|qwen3|PATH)");
      }
    }();
    if (tok.vocab_size() > cfg.model.vocab_size)
      fail("tokenizer ", tok.origin(), " has ", tok.vocab_size(), " tokens but config.json's vocab_size is ",
           cfg.model.vocab_size, ": it is not this model's tokenizer (see --set data.tokenizer)");

    nlohmann::json loader = nlohmann::json::object();
    if (!cfg.data.train.empty() || !cfg.data.val.empty()) {
      if (cfg.data.train.empty() || cfg.data.val.empty())
        fail("--set data.train and --set data.val go together (a resumable run needs both)");
      const auto& t = cfg.train;
      data::DataLoader train(cfg.data.train, t.micro_batch, t.seq_len, t.seed, 0, 1, cfg.model.vocab_size,
                             data::LoaderMode::Shuffled);
      data::DataLoader val(cfg.data.val, t.micro_batch, t.seq_len, t.seed, 0, 1, cfg.model.vocab_size,
                           data::LoaderMode::Sequential);
      loader = train.state();
    }
    const HfImportResult r = write_hf_import(plan, cfg, loader, overwrite);
    std::string dtypes;
    for (const auto& [dt, n] : r.dtypes) dtypes += (dtypes.empty() ? "" : ", ") + std::to_string(n) + " " + dt;
    std::printf("imported   %s (model_type %s, %zu file(s): %s tensors) -> %s\n", hf.c_str(),
                plan.model_type.c_str(), plan.weight_files.size(), dtypes.c_str(), r.run_dir.c_str());
    std::printf("model      %lld parameters, residual %s, %d layers, d_model %d, vocab %d, tie_embeddings %s\n",
                static_cast<long long>(r.parameters), residual_mode_name(cfg.residual.mode), cfg.model.n_layers,
                cfg.model.d_model, cfg.model.vocab_size, cfg.model.tie_embeddings ? "true" : "false");
    std::printf("tokenizer  %s (vocab %d)\n", cfg.data.tokenizer.c_str(), tok.vocab_size());
    std::printf("checkpoint %s\n", r.checkpoint_dir.c_str());
    if (loader.empty())
      std::printf("next       mhar eval --checkpoint %s --data GLOB  |  mhar train CONFIG --init-from %s\n",
                  r.run_dir.c_str(), r.run_dir.c_str());
    else
      std::printf("next       mhar train --resume %s\n", r.run_dir.c_str());
  });
}

}  // namespace mhar::cli
