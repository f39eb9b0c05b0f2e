// hf_export.cpp: `mhar export` (see hf_export.h): tensor layout, dtype conversion, the
// sharded safetensors writer, the Hugging Face JSON files and the staged output directory.
#include "engine/hf_export.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

using nlohmann::json;

namespace {

// The version of the Hugging Face config conventions written here (rope_parameters and
// "dtype" are transformers 5's; the older top-level rope_theta and torch_dtype are
// written too, so transformers 4 reads the same files).
constexpr const char* kTransformersVersion = "5.0.0";

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

json token_or_null(const std::string& t) { return t.empty() ? json(nullptr) : json(t); }
json id_or_null(int id) { return id < 0 ? json(nullptr) : json(id); }

}  // namespace

std::vector<HfTensorSpec> hf_tensor_layout(const ModelConfig& m, const ResidualConfig& r) {
  const int64_t d = m.d_model, V = m.vocab_size, F = m.d_ff, hd = m.head_dim;
  std::vector<HfTensorSpec> out;
  out.push_back({"model.embed_tokens.weight", {V, d}});
  for (int l = 0; l < m.n_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    out.push_back({pre + "input_layernorm.weight", {d}});
    out.push_back({pre + "self_attn.q_proj.weight", {m.q_dim(), d}});
    out.push_back({pre + "self_attn.k_proj.weight", {m.kv_dim(), d}});
    out.push_back({pre + "self_attn.v_proj.weight", {m.kv_dim(), d}});
    out.push_back({pre + "self_attn.o_proj.weight", {d, m.q_dim()}});
    out.push_back({pre + "self_attn.q_norm.weight", {hd}});
    out.push_back({pre + "self_attn.k_norm.weight", {hd}});
    out.push_back({pre + "post_attention_layernorm.weight", {d}});
    out.push_back({pre + "mlp.gate_proj.weight", {F, d}});
    out.push_back({pre + "mlp.up_proj.weight", {F, d}});
    out.push_back({pre + "mlp.down_proj.weight", {d, F}});
  }
  out.push_back({"model.norm.weight", {d}});
  if (!m.tie_embeddings) out.push_back({"lm_head.weight", {V, d}});
  // The residual scheme's own parameters, 1-D as the scheme declares them (engine/residual_*.cpp).
  auto site_params = [&](const std::string& prefix, bool gate) {
    for (int j = 0; j < m.n_sites(); ++j) {
      const std::string pre = prefix + std::to_string(j);
      if (gate) out.push_back({pre + ".alpha", {1}});
      out.push_back({pre + ".query", {d}});
      out.push_back({pre + ".gain", {d}});
    }
  };
  switch (r.mode) {
    case ResidualMode::Standard:
      break;
    case ResidualMode::AttnRes:
    case ResidualMode::Mhar:
      site_params("model.routing.", false);
      break;
    case ResidualMode::Hyper: {
      const int64_t n = r.hyper_n;
      for (int k = 0; k < 2 * m.n_layers; ++k) {
        const std::string pre = "model.hyper." + std::to_string(k);
        out.push_back({pre + ".a_m", {n}});
        out.push_back({pre + ".a_r", {n * n}});  // row-major [n, n]
        out.push_back({pre + ".b", {n}});
        if (r.hyper_dynamic) {
          out.push_back({pre + ".w", {d * (n + 2)}});  // row-major [d, n + 2]
          out.push_back({pre + ".s_a", {1}});
          out.push_back({pre + ".s_b", {1}});
        }
      }
      break;
    }
    case ResidualMode::Delta:
      site_params("model.delta.", true);
      out.push_back({"model.delta.null", {d}});
      break;
  }
  return out;
}

void require_exportable(const ResidualConfig& r, const std::string& where) {
  // modeling_mhar.py has one function per residual scheme; a mode added to the engine
  // without one must not export as something else.
  switch (r.mode) {
    case ResidualMode::Standard:
    case ResidualMode::AttnRes:
    case ResidualMode::Mhar:
    case ResidualMode::Hyper:
    case ResidualMode::Delta:
      return;
  }
  fail(where, ": residual.mode \"", residual_mode_name(r.mode),
       "\" has no Hugging Face export (exportable: standard, attnres, mhar, hyper, delta)");
}

uint16_t f32_to_bf16_rne(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as PyTorch writes it
  u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even bf16 mantissa
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v;
  if (exp == 0) v = std::ldexp(double(mant), -24);  // zero and subnormals
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(double(mant | 0x400), exp - 25);
  return float(sign ? -v : v);
}

uint64_t parse_byte_size(const std::string& text, const std::string& what) {
  auto bad = [&]() -> uint64_t {
    fail(what, " = \"", text, "\" is not a size; give a positive byte count such as 5GB, 200MB, ",
         "64KiB or 1048576");
  };
  size_t i = 0;
  uint64_t n = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t digit = uint64_t(text[i] - '0');
    if (n > (UINT64_MAX - digit) / 10) return bad();
    n = n * 10 + digit;
    ++i;
  }
  if (i == 0) return bad();
  std::string unit;
  for (; i < text.size(); ++i) unit += char(std::tolower(static_cast<unsigned char>(text[i])));
  uint64_t mul = 0;
  if (unit.empty() || unit == "b") mul = 1;
  else if (unit == "kb") mul = 1000ULL;
  else if (unit == "mb") mul = 1000ULL * 1000;
  else if (unit == "gb") mul = 1000ULL * 1000 * 1000;
  else if (unit == "tb") mul = 1000ULL * 1000 * 1000 * 1000;
  else if (unit == "kib") mul = 1ULL << 10;
  else if (unit == "mib") mul = 1ULL << 20;
  else if (unit == "gib") mul = 1ULL << 30;
  else if (unit == "tib") mul = 1ULL << 40;
  else return bad();
  if (n == 0 || n > UINT64_MAX / mul) return bad();
  return n * mul;
}

bool path_within(const std::string& inner, const std::string& outer) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(fs::absolute(inner), ec).lexically_normal();
  const fs::path b = fs::weakly_canonical(fs::absolute(outer), ec).lexically_normal();
  auto ai = a.begin();
  for (auto bi = b.begin(); bi != b.end(); ++bi, ++ai) {
    if (bi->empty()) break;  // a trailing separator
    if (ai == a.end() || *ai != *bi) return false;
  }
  return true;
}

void write_new_file(const std::string& path, const std::string& text) {
  CheckedFile f(path);
  f.write(text);
  f.close();
}

std::vector<std::string> write_hf_safetensors(const std::string& dir,
                                              const std::vector<HfTensorData>& tensors,
                                              uint64_t max_shard_bytes) {
  MHAR_CHECK(max_shard_bytes > 0, "shard size");
  uint64_t total = 0;
  int64_t total_params = 0;
  for (const auto& t : tensors) {
    total += t.bytes.size();
    int64_t n = 1;
    for (int64_t s : t.shape) n *= s;
    total_params += n;
  }
  // Consecutive tensors fill a shard until the next would pass the limit (Hugging Face's
  // rule); a tensor larger than the limit sits alone in its shard.
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t b = tensors[i].bytes.size();
    if (shards.empty() || (in_shard > 0 && in_shard + b > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
  }
  // (So everything fits one file exactly when the total is within the limit.)
  const bool sharded = shards.size() > 1;
  std::vector<std::string> names;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    if (sharded)
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    else
      std::snprintf(name, sizeof name, "model.safetensors");
    std::vector<TensorToWrite> part;
    for (size_t i : shards[s]) {
      const HfTensorData& t = tensors[i];
      part.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
      weight_map[t.name] = name;
    }
    CheckedFile f((fs::path(dir) / name).string());
    write_safetensors_to([&](const void* p, size_t n) { f.write(p, n); }, part, {{"format", "pt"}});
    f.close();
    names.push_back(name);
  }
  if (sharded) {
    const json index = {{"metadata", {{"total_size", total}, {"total_parameters", total_params}}},
                        {"weight_map", weight_map}};
    write_new_file((fs::path(dir) / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    names.push_back("model.safetensors.index.json");
  }
  return names;
}

json hf_config_json(const Config& cfg, HfDType dtype, const HfTokenizerInfo& tok) {
  const ModelConfig& m = cfg.model;
  const char* torch_dtype = dtype == HfDType::F32 ? "float32" : "bfloat16";
  json j = {
      {"vocab_size", m.vocab_size},
      {"hidden_size", m.d_model},
      {"intermediate_size", m.d_ff},
      {"num_hidden_layers", m.n_layers},
      {"num_attention_heads", m.n_heads},
      {"num_key_value_heads", m.n_kv_heads},
      {"head_dim", m.head_dim},
      {"hidden_act", "silu"},
      {"max_position_embeddings", m.context_length},
      {"initializer_range", m.init_std},
      {"rms_norm_eps", m.rms_eps},
      {"rope_theta", m.rope_theta},
      {"tie_word_embeddings", m.tie_embeddings},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"use_cache", true},
      {"bos_token_id", id_or_null(tok.bos_id)},
      {"eos_token_id", id_or_null(tok.eos_id)},
      {"pad_token_id", id_or_null(tok.pad_id)},
      {"dtype", torch_dtype},
      {"torch_dtype", torch_dtype},
      {"transformers_version", kTransformersVersion},
  };
  const ResidualConfig& r = cfg.residual;
  if (r.mode == ResidualMode::Standard) {
    j["architectures"] = {"Qwen3ForCausalLM"};
    j["model_type"] = "qwen3";
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rope_theta}};
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = m.n_layers;  // layer_types is left to Qwen3Config: all full attention
  } else {
    j["architectures"] = {"MharForCausalLM"};
    j["model_type"] = "mhar";
    j["auto_map"] = {{"AutoConfig", "configuration_mhar.MharConfig"},
                     {"AutoModel", "modeling_mhar.MharModel"},
                     {"AutoModelForCausalLM", "modeling_mhar.MharForCausalLM"}};
    // Every field modeling_mhar.py reads, under the engine's residual.* names (only the
    // mode's own: configuration_mhar.py gives the others their defaults and refuses a
    // field that contradicts the mode, as the engine's config does).
    j["residual_mode"] = residual_mode_name(r.mode);
    switch (r.mode) {
      case ResidualMode::AttnRes:
      case ResidualMode::Mhar:
        j["routing_heads"] = r.heads;
        j["block_size"] = r.block_size;
        break;
      case ResidualMode::Hyper:
        j["hyper_n"] = r.hyper_n;
        j["hyper_dynamic"] = r.hyper_dynamic;
        break;
      case ResidualMode::Delta:
        j["routing_heads"] = r.heads;
        j["block_layers"] = r.block_layers;
        break;
      case ResidualMode::Standard:
        break;
    }
  }
  return j;
}

json hf_generation_config_json(const Config& cfg, const HfTokenizerInfo& tok) {
  json j = {{"bos_token_id", id_or_null(tok.bos_id)},
            {"eos_token_id", id_or_null(tok.eos_id)},
            {"transformers_version", kTransformersVersion}};
  if (tok.pad_id >= 0) j["pad_token_id"] = tok.pad_id;
  if (tok.vocab_size > 0 && tok.vocab_size < cfg.model.vocab_size) {
    std::vector<int> rows;
    for (int id = tok.vocab_size; id < cfg.model.vocab_size; ++id) rows.push_back(id);
    j["suppress_tokens"] = rows;
  }
  return j;
}

json hf_tokenizer_config_json(const Config& cfg, const HfTokenizerInfo& tok) {
  // PreTrainedTokenizerFast loads tokenizer.json as it is (its pre-tokenizer, normalizer
  // and post-processor), so ids equal `mhar data encode`'s. No add_bos_token /
  // add_eos_token keys: their presence alone makes transformers 5 rebuild the
  // post-processor.
  return {{"tokenizer_class", "PreTrainedTokenizerFast"},
          {"model_max_length", cfg.model.context_length},
          {"clean_up_tokenization_spaces", false},
          {"bos_token", token_or_null(tok.bos)},
          {"eos_token", token_or_null(tok.eos)},
          {"pad_token", token_or_null(tok.pad)},
          {"unk_token", nullptr}};
}

HfExportResult export_hf(const CheckpointInfo& ckpt, const HfExportOptions& opt) {
  const Config& cfg = ckpt.config;
  require_exportable(cfg.residual, ckpt.dir);
  const std::string file = (fs::path(ckpt.dir) / "model.safetensors").string();
  const SafetensorsFile f = SafetensorsFile::load(file);
  const std::vector<HfTensorSpec> layout = hf_tensor_layout(cfg.model, cfg.residual);

  HfExportResult result;
  result.model_type = cfg.residual.mode == ResidualMode::Standard ? "qwen3" : "mhar";
  std::set<std::string> expected;
  std::vector<HfTensorData> tensors;
  for (const HfTensorSpec& spec : layout) {
    expected.insert(spec.name);
    if (!f.has(spec.name))
      fail(file, ": has no tensor ", spec.name, ", which this checkpoint's config (",
           residual_mode_name(cfg.residual.mode), ", tie_embeddings=",
           cfg.model.tie_embeddings ? "true" : "false", ") needs");
    const auto& e = f.entry(spec.name);
    if (e.shape != spec.shape)
      fail(file, ": tensor ", spec.name, " has shape ", shape_text(e.shape),
           " but the checkpoint's config needs ", shape_text(spec.shape));
    if (e.dtype != "F32")
      fail(file, ": tensor ", spec.name, " is ", e.dtype, "; checkpoints hold F32 master weights");
    const std::vector<double> v = f.to_f64(spec.name);
    HfTensorData t{spec.name, opt.dtype == HfDType::F32 ? "F32" : "BF16", spec.shape, {}};
    if (opt.dtype == HfDType::F32) {
      t.bytes.resize(v.size() * 4);
      for (size_t i = 0; i < v.size(); ++i) {
        const float x = float(v[i]);  // exact: the values were F32
        std::memcpy(t.bytes.data() + 4 * i, &x, 4);
      }
    } else {
      t.bytes.resize(v.size() * 2);
      for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t b = f32_to_bf16_rne(float(v[i]));
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      }
    }
    result.tensor_bytes += t.bytes.size();
    result.parameters += int64_t(v.size());
    tensors.push_back(std::move(t));
  }
  for (const std::string& name : f.names())
    if (!expected.count(name))
      fail(file, ": tensor ", name, " is not part of the model its config describes (",
           residual_mode_name(cfg.residual.mode), ", tie_embeddings=",
           cfg.model.tie_embeddings ? "true" : "false", ")");
  const std::string tokenizer_text =
      read_regular_file(opt.tokenizer.tokenizer_json, "tokenizer.json", uint64_t(256) << 20);

  StagedDirectory out(opt.out_dir, opt.overwrite);
  const fs::path dir(out.path());
  result.files = write_hf_safetensors(out.path(), tensors, opt.max_shard_bytes);
  result.shards = 0;
  for (const auto& n : result.files) result.shards += n != "model.safetensors.index.json";
  tensors.clear();
  auto put = [&](const std::string& name, const std::string& text) {
    write_new_file((dir / name).string(), text);
    result.files.push_back(name);
  };
  put("config.json", hf_config_json(cfg, opt.dtype, opt.tokenizer).dump(2) + "\n");
  put("generation_config.json", hf_generation_config_json(cfg, opt.tokenizer).dump(2) + "\n");
  put("tokenizer.json", tokenizer_text);
  put("tokenizer_config.json", hf_tokenizer_config_json(cfg, opt.tokenizer).dump(2) + "\n");
  if (result.model_type == "mhar") {
    put("configuration_mhar.py", kHfConfigurationPy);
    put("modeling_mhar.py", kHfModelingPy);
  }
  out.publish();
  return result;
}

// ---------------------------------------------------------------- StagedDirectory

StagedDirectory::StagedDirectory(const std::string& final_dir, bool overwrite, const std::string& flag) {
  if (final_dir.empty()) fail(flag, " is empty; give a directory");
  fs::path f = fs::absolute(fs::path(final_dir)).lexically_normal();
  if (f.filename().empty()) f = f.parent_path();  // "dir/" -> "dir"
  if (f == f.root_path()) fail(flag, " ", final_dir, ": cannot be the filesystem root");
  std::error_code ec;
  const fs::file_status st = fs::status(f, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st))
      fail(final_dir, ": exists and is not a directory; ", flag, " must name a directory");
    if (!overwrite)
      fail(final_dir, ": already exists; choose a new ", flag,
           " directory, or pass --overwrite to replace it");
  }
  fs::create_directories(f.parent_path(), ec);
  if (ec) fail(f.parent_path().string(), ": cannot create (", ec.message(), ")");
  final_ = f.string();
  tmp_ = (f.parent_path() / ("." + f.filename().string() + ".tmp-" + std::to_string(::getpid()))).string();
  fs::remove_all(tmp_, ec);  // a stale one of this very process id
  if (!fs::create_directory(tmp_, ec) || ec)
    fail(tmp_, ": cannot create (", ec ? ec.message() : std::string("exists"), ")");
}

StagedDirectory::~StagedDirectory() {
  if (published_) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);  // never leave a half-written directory behind
}

void StagedDirectory::publish() {
  MHAR_CHECK(!published_, "published twice");
  const fs::path f(final_), parent = fs::path(final_).parent_path();
  fsync_dir(tmp_);
  std::error_code ec;
  if (fs::exists(f, ec)) {  // --overwrite: the old one goes only once the new one is whole
    const fs::path old = parent / ("." + f.filename().string() + ".old-" + std::to_string(::getpid()));
    fs::remove_all(old, ec);
    fs::rename(f, old, ec);
    if (ec) fail(final_, ": cannot move the existing directory aside (", ec.message(), ")");
    fs::rename(tmp_, f, ec);
    if (ec) {
      std::error_code back;
      fs::rename(old, f, back);
      fail(final_, ": cannot rename ", tmp_, " into place (", ec.message(), ")");
    }
    published_ = true;
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_, f, ec);
    if (ec) fail(final_, ": cannot rename ", tmp_, " into place (", ec.message(), ")");
    published_ = true;
  }
  fsync_dir(parent.string());
}

}  // namespace mhar
