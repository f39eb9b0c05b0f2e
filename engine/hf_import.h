// hf_import.h: `mhar import`: a Hugging Face Qwen3 model directory (or an mhar export)
// as a run directory whose checkpoint `mhar train --resume`, `train --init-from`, `eval`
// and `sample` accept (issue 9).
//
// Input: config.json (model_type "qwen3", or "mhar" from `mhar export` of any residual
// mode: residual_mode and the mode's fields become the run's residual section) and the weights
// as model.safetensors or shards listed by model.safetensors.index.json (F32, BF16 or
// F16; tied or untied embeddings). What the engine cannot run is refused naming the
// field: sliding-window attention, RoPE scaling, biases, MoE, activations other than
// SiLU, quantized weights. Every tensor must be present once, with its shape; an extra
// one, a wrong dtype, a malformed index or a truncated file fails naming the file and
// the tensor.
//
// Output (a run directory, so `train --resume` finds what it needs):
//   OUT/config.json                        the run config (model from config.json, the
//                                          rest defaults plus --set overrides)
//   OUT/checkpoints/step_00000000/         written by save_checkpoint: fp32 weights,
//                                          zero AdamW moments (a fresh optimizer)
//   OUT/tokenizer.json                     HF_DIR's tokenizer, when it has one and no
//                                          --set data.tokenizer names another
// The whole directory is staged under a temporary name and renamed when complete, and
// everything is read and checked before anything is written.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"

namespace mhar {

// The engine's {"model": {...}, "residual": {...}} for a Hugging Face config.json
// (`where` names the file in messages). Refuses unsupported configurations naming the
// field and its value.
nlohmann::json engine_model_from_hf_config(const nlohmann::json& hf, const std::string& where);

struct HfImportPlan {
  std::string hf_dir;   // as given
  std::string out_dir;  // absolute
  std::string model_type;           // "qwen3" or "mhar"
  Config config;                    // data paths as given (not yet resolved)
  std::string tokenizer_source;     // HF_DIR/tokenizer.json to copy into OUT, or empty
  std::vector<std::string> weight_files;           // absolute paths, in load order
  std::map<std::string, std::string> weight_map;   // tensor -> file name (sharded only)
  std::string index_file;                          // empty when single-file
};

// Reads config.json and the index, applies `overrides` ("train.steps=100"), and decides
// where the tokenizer comes from. Nothing is written.
HfImportPlan plan_hf_import(const std::string& hf_dir, const std::string& out_dir,
                            const std::vector<std::string>& overrides);

struct HfImportResult {
  std::string run_dir, checkpoint_dir;
  int64_t parameters = 0;
  std::map<std::string, int> dtypes;  // source dtype -> tensors
};

// Reads and checks every tensor, then writes the run directory. `cfg` is plan.config with
// data paths resolved; `loader_state` the training loader's state() at its start (or an
// empty object when the config names no data: the checkpoint then serves eval, sample and
// --init-from, and --resume asks for data).
HfImportResult write_hf_import(const HfImportPlan& plan, const Config& cfg,
                               const nlohmann::json& loader_state, bool overwrite);

}  // namespace mhar
