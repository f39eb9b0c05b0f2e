// cmd_export.cpp: `mhar export --checkpoint DIR --out HF_DIR [--dtype fp32|bf16]
// [--max-shard-size SIZE] [--tokenizer NAME] [--overwrite]` writes a Hugging Face model
// directory (engine/hf_export.h): a stock Qwen3ForCausalLM for `standard` runs, a
// trust_remote_code model (model_type "mhar") for every other residual mode, with the
// run's tokenizer.
#include <cstdio>

#include "cli/commands.h"
#include "data/tokenizer.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/hf_export.h"

namespace mhar::cli {

void register_export(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "export", "Write a checkpoint as a Hugging Face model directory (transformers, lm-evaluation-harness)");
  cmd->footer(
      "standard models load as a stock Qwen3ForCausalLM; attnres, mhar (full or block routing),\n"
      "hyper and delta models carry their own modeling code (model_type \"mhar\"): load them with\n"
      "trust_remote_code=True. The run's\n"
      "tokenizer (tokenizer.json) goes along. The directory is written under a temporary name\n"
      "and renamed when complete.");
  static std::string checkpoint, out, dtype = "fp32", shard_size = "5GB", tokenizer_name;
  static bool overwrite = false;
  cmd->add_option("--checkpoint", checkpoint, "Checkpoint directory, or a run directory (its newest)")
      ->required();
  cmd->add_option("--out", out, "Output directory (must not exist, unless --overwrite)")->required();
  cmd->add_option("--dtype", dtype, "Weight dtype: fp32 (the master weights exactly) or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--max-shard-size", shard_size,
                  "Largest safetensors file before sharding (5GB, 500MB, 64MiB or bytes)")
      ->capture_default_str();
  cmd->add_option("--tokenizer", tokenizer_name,
                  "gpt2, qwen3 or a tokenizer.json path (default: the checkpoint's data.tokenizer)");
  cmd->add_flag("--overwrite", overwrite, "Replace --out if it exists (once the new export is complete)");
  cmd->callback([] {
    HfExportOptions opt;
    opt.out_dir = out;
    opt.dtype = dtype == "bf16" ? HfDType::BF16 : HfDType::F32;
    opt.max_shard_bytes = parse_byte_size(shard_size, "--max-shard-size");
    opt.overwrite = overwrite;
    const CheckpointInfo ckpt = open_checkpoint(checkpoint);
    if (path_within(ckpt.dir, out))
      fail("--out ", out, " holds the checkpoint being exported (", ckpt.dir, "); choose another directory");
    const Config& cfg = ckpt.config;
    require_exportable(cfg.residual, ckpt.dir);

    const data::Tokenizer tok = load_run_tokenizer(cfg, tokenizer_name);
    if (tok.vocab_size() > cfg.model.vocab_size)
      fail("tokenizer ", tok.origin(), " has ", tok.vocab_size(), " tokens but the checkpoint's model.vocab_size is ",
           cfg.model.vocab_size, ": it is not the tokenizer this model was trained with (see --tokenizer)");
    HfTokenizerInfo& info = opt.tokenizer;
    info.tokenizer_json = tok.origin();
    info.vocab_size = tok.vocab_size();
    // The engine's one special token: every document starts after <|endoftext|> and
    // sampling stops at it. Qwen's tokenizers name it pad (and have no bos); GPT-2's and
    // those trained here name it bos and eos.
    if (const auto eot = tok.token_id("<|endoftext|>")) {
      info.eos = "<|endoftext|>";
      info.eos_id = *eot;
      if (tok.token_id("<|im_end|>")) {
        info.pad = info.eos;
        info.pad_id = *eot;
      } else {
        info.bos = info.eos;
        info.bos_id = *eot;
      }
    }
    const HfExportResult r = export_hf(ckpt, opt);
    const bool routed = r.model_type == "mhar";
    std::printf("exported   %s (step %lld, residual %s) -> %s\n", ckpt.dir.c_str(),
                static_cast<long long>(ckpt.step), residual_mode_name(cfg.residual.mode), out.c_str());
    std::printf("model      model_type %s (%s)\n", r.model_type.c_str(),
                routed ? "MharForCausalLM: load with trust_remote_code=True"
                       : "Qwen3ForCausalLM: loads without trust_remote_code");
    std::printf("weights    %s, %lld parameters, %.1f MB in %d safetensors file(s)\n", dtype.c_str(),
                static_cast<long long>(r.parameters), double(r.tensor_bytes) / 1e6, r.shards);
    std::printf("tokenizer  %s (vocab %d; bos %s, eos %s, pad %s)\n", tok.origin().c_str(), tok.vocab_size(),
                info.bos.empty() ? "none" : info.bos.c_str(), info.eos.empty() ? "none" : info.eos.c_str(),
                info.pad.empty() ? "none" : info.pad.c_str());
  });
}

}  // namespace mhar::cli
