// hf_export.h: a checkpoint as a Hugging Face model directory (`mhar export`), and the
// pieces `mhar import` shares with it (DESIGN.md section 6, issue 9).
//
// An export holds model.safetensors (or model-0000i-of-0000n.safetensors shards and
// model.safetensors.index.json above --max-shard-size; header metadata {"format": "pt"}),
// config.json, generation_config.json, and the run's tokenizer (tokenizer.json copied
// byte for byte, tokenizer_config.json). `standard` models are a stock Qwen3ForCausalLM
// (model_type "qwen3"); every other residual mode (attnres and mhar, full or block
// routing; hyper, static or dynamic; delta) has model_type "mhar", an auto_map, the
// fields of its residual scheme in config.json, its scheme's tensors under the
// checkpoint's names and shapes, and the modeling files tools/hf/configuration_mhar.py
// and modeling_mhar.py, which the build compiles into the engine (engine/hf_code.cpp.in)
// so an export carries exactly the files kept in the repo. Such a model never gets
// model_type "qwen3": a stock type would load silently without its scheme's tensors.
//
// The directory is built under a hidden temporary name beside --out and renamed into
// place when complete (StagedDirectory): a failure, a full disk included, leaves nothing
// at --out.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/config.h"

namespace mhar {

// The model's tensors under their Hugging Face names, in the order Model lays them out
// (model.cpp plan_parameters); tests check the two agree.
struct HfTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<HfTensorSpec> hf_tensor_layout(const ModelConfig& model, const ResidualConfig& residual);

// The residual modes an export can describe (all five today; a mode added to the engine
// fails here, naming it, until modeling_mhar.py has its scheme).
void require_exportable(const ResidualConfig& residual, const std::string& where);

// fp32 -> bf16 with round-to-nearest-even (NaN stays NaN, overflow becomes inf), as
// PyTorch's .to(torch.bfloat16) rounds.
uint16_t f32_to_bf16_rne(float x);
// IEEE half -> float, exactly (subnormals, infinities and NaN included).
float f16_to_f32(uint16_t h);

// "5GB", "200MB", "64KiB", "1048576": a byte count > 0 (KB/MB/GB are powers of 1000 as
// in Hugging Face's max_shard_size, KiB/MiB/GiB powers of 1024). Fails naming `what`.
uint64_t parse_byte_size(const std::string& text, const std::string& what);

// One tensor ready to write.
struct HfTensorData {
  std::string name;
  std::string dtype;  // "F32" or "BF16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// Writes `tensors` into `dir` (which exists) as model.safetensors when they total at most
// `max_shard_bytes`, else as shards of at most that size (a tensor larger than the limit
// gets a shard of its own) plus model.safetensors.index.json. Every file is written
// through CheckedFile. Returns the file names written.
std::vector<std::string> write_hf_safetensors(const std::string& dir,
                                              const std::vector<HfTensorData>& tensors,
                                              uint64_t max_shard_bytes);

// Special tokens as the run's tokenizer has them; an empty string is "none" (null).
struct HfTokenizerInfo {
  std::string tokenizer_json;  // the file to copy
  int vocab_size = 0;          // ids the tokenizer can produce (<= model.vocab_size)
  std::string bos, eos, pad;
  int bos_id = -1, eos_id = -1, pad_id = -1;
};

enum class HfDType { F32, BF16 };

// config.json of the export (stock Qwen3 for standard, model_type "mhar" otherwise, with
// residual_mode and the mode's fields: routing_heads + block_size (attnres, mhar),
// hyper_n + hyper_dynamic (hyper), routing_heads + block_layers (delta)).
nlohmann::json hf_config_json(const Config& cfg, HfDType dtype, const HfTokenizerInfo& tok);
// generation_config.json: bos/eos/pad ids, and suppress_tokens for the embedding's rows
// past the tokenizer's vocabulary (never sampled by `mhar sample` either).
nlohmann::json hf_generation_config_json(const Config& cfg, const HfTokenizerInfo& tok);
// tokenizer_config.json for Hugging Face's generic fast tokenizer over tokenizer.json.
nlohmann::json hf_tokenizer_config_json(const Config& cfg, const HfTokenizerInfo& tok);

struct HfExportOptions {
  std::string out_dir;
  HfDType dtype = HfDType::F32;
  uint64_t max_shard_bytes = 5'000'000'000ULL;  // Hugging Face's customary 5GB
  bool overwrite = false;                       // replace an existing --out directory
  HfTokenizerInfo tokenizer;
};
struct HfExportResult {
  std::vector<std::string> files;  // every file of the export, by name
  uint64_t tensor_bytes = 0;
  int64_t parameters = 0;
  int shards = 1;
  std::string model_type;
};
HfExportResult export_hf(const CheckpointInfo& ckpt, const HfExportOptions& opt);

// A directory built under a hidden temporary name beside `final_dir` (created with its
// parents) and renamed to `final_dir` by publish(). Destroyed unpublished, it removes
// itself. `final_dir` must not exist unless `overwrite` (then it must be a directory, and
// is replaced only once the new one is complete).
class StagedDirectory {
 public:
  StagedDirectory(const std::string& final_dir, bool overwrite, const std::string& flag = "--out");
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;
  const std::string& path() const { return tmp_; }
  const std::string& final_path() const { return final_; }
  void publish();

 private:
  std::string final_, tmp_;
  bool published_ = false;
};

// True when `inner` is `outer` or lies inside it (symlinks resolved where the paths
// exist); an output directory must never swallow its own input.
bool path_within(const std::string& inner, const std::string& outer);

// Writes `text` as the new file `path` through CheckedFile (the staged directories are
// fresh, so no replacement is involved).
void write_new_file(const std::string& path, const std::string& text);

// The modeling files compiled in from tools/hf/ (engine/hf_code.cpp.in).
extern const char* const kHfConfigurationPy;
extern const char* const kHfModelingPy;

}  // namespace mhar
