// hf_import.cpp: `mhar import` (see hf_import.h): Hugging Face config.json -> run config,
// the weight files (single or sharded) -> a step-0 run directory (run_dir.h).
#include "engine/hf_import.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>

#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/hf_export.h"
#include "engine/json_io.h"
#include "engine/model.h"
#include "engine/run_dir.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

using nlohmann::json;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Old checkpoints may carry a cached RoPE table; it is computed, not learned.
bool ignorable_tensor(const std::string& name) { return ends_with(name, "rotary_emb.inv_freq"); }

// Why a tensor the model does not have may be there, for the message.
std::string extra_tensor_hint(const std::string& name, const Config& cfg) {
  if (ends_with(name, ".bias")) return "; biases are not supported";
  if (name.find(".experts.") != std::string::npos || name.find(".gate.weight") != std::string::npos)
    return "; mixture-of-experts weights are not supported";
  if (name.rfind("model.routing.", 0) == 0 && !cfg.residual.routed())
    return "; routing tensors belong to an attnres or mhar model (model_type \"mhar\")";
  if (name.rfind("model.hyper.", 0) == 0 && cfg.residual.mode != ResidualMode::Hyper)
    return "; model.hyper.* tensors belong to a hyper model (model_type \"mhar\", residual_mode \"hyper\")";
  if (name.rfind("model.delta.", 0) == 0 && cfg.residual.mode != ResidualMode::Delta)
    return "; model.delta.* tensors belong to a delta model (model_type \"mhar\", residual_mode \"delta\")";
  return "";
}

// The values of one tensor as doubles: F32 and BF16 through the reader, F16 decoded here
// from the file's bytes (the reader converts F64, F32 and BF16 only).
std::vector<double> tensor_values(const SafetensorsFile& f, const std::string& path,
                                  const std::string& name) {
  const SafetensorsFile::Entry& e = f.entry(name);
  if (e.dtype != "F16") return f.to_f64(name);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open (", std::strerror(errno), ")");
  auto read_at = [&](void* dst, size_t n, uint64_t off) {
    auto* p = static_cast<char*>(dst);
    while (n) {
      const ssize_t r = ::pread(fd, p, n, off_t(off));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ::close(fd);
        fail(path, ": tensor ", name, ": short read (the file is truncated or changed while reading)");
      }
      p += r, n -= size_t(r), off += uint64_t(r);
    }
  };
  uint64_t header_len = 0;
  read_at(&header_len, 8, 0);
  std::vector<uint16_t> raw((e.end - e.begin) / 2);
  read_at(raw.data(), raw.size() * 2, 8 + header_len + e.begin);
  ::close(fd);
  std::vector<double> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) out[i] = f16_to_f32(raw[i]);
  return out;
}

}  // namespace

json engine_model_from_hf_config(const json& hf, const std::string& where) {
  if (!hf.is_object()) fail(where, ": expected a JSON object, got ", hf.type_name());
  auto has = [&](const char* k) {
    auto it = hf.find(k);
    return it != hf.end() && !it->is_null();
  };
  auto field = [&](const std::string& k) { return where + ": " + k; };
  auto get_int = [&](const char* k, int64_t lo, int64_t hi) {
    return json_to_int(json_member(hf, k, where), field(k), lo, hi);
  };
  auto unsupported = [&](const char* k, const char* why) {
    fail(field(k), " = ", json_excerpt(hf.at(k)), ": ", why);
  };

  if (!has("model_type"))
    fail(where, ": missing field \"model_type\" (mhar imports \"qwen3\" models and its own \"mhar\" exports)");
  const std::string type = json_to_string(hf.at("model_type"), field("model_type"));
  if (type == "qwen3_moe" || type == "qwen2_moe") unsupported("model_type", "mixture-of-experts models are not supported");
  if (type != "qwen3" && type != "mhar")
    unsupported("model_type", "not supported; mhar imports \"qwen3\" (Qwen3ForCausalLM) and \"mhar\" (its own exports)");

  // What the engine's model does not have, refused by name.
  for (const char* k : {"num_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size"})
    if (has(k) && !(hf.at(k).is_number() && hf.at(k).get<double>() == 0))
      unsupported(k, "mixture-of-experts layers are not supported");
  if (has("quantization_config")) unsupported("quantization_config", "quantized weights are not supported");
  if (has("hidden_act") && json_to_string(hf.at("hidden_act"), field("hidden_act")) != "silu")
    unsupported("hidden_act", "only \"silu\" (the SwiGLU MLP) is supported");
  for (const char* k : {"attention_bias", "mlp_bias"})
    if (has(k) && json_to_bool(hf.at(k), field(k))) unsupported(k, "biases are not supported");
  if (has("use_sliding_window") && json_to_bool(hf.at("use_sliding_window"), field("use_sliding_window")))
    unsupported("use_sliding_window", "sliding-window attention is not supported");
  if (has("layer_types")) {
    const json& lt = hf.at("layer_types");
    if (!lt.is_array()) unsupported("layer_types", "expected a list of layer types");
    for (const json& t : lt)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        unsupported("layer_types", "only \"full_attention\" layers are supported (no sliding-window layers)");
  }
  if (has("partial_rotary_factor") && json_to_finite(hf.at("partial_rotary_factor"), field("partial_rotary_factor")) != 1.0)
    unsupported("partial_rotary_factor", "partial rotary embeddings are not supported");

  // RoPE: transformers 4 writes a top-level rope_theta (and rope_scaling), transformers 5
  // rope_parameters {"rope_type", "rope_theta"}. Only plain RoPE is supported.
  std::optional<double> theta;
  auto read_rope_dict = [&](const char* k) {
    const json& rp = hf.at(k);
    if (!rp.is_object()) unsupported(k, "expected an object");
    for (const char* type_key : {"rope_type", "type"}) {  // the kind first: it names the scaling
      auto it = rp.find(type_key);
      if (it != rp.end() && (!it->is_string() || it->get<std::string>() != "default"))
        fail(field(std::string(k) + "." + type_key), " = ", json_excerpt(*it),
             ": RoPE scaling is not supported (only \"default\")");
    }
    for (auto it = rp.begin(); it != rp.end(); ++it) {
      const std::string key = it.key();
      if (key == "rope_type" || key == "type") {
        continue;
      } else if (key == "rope_theta") {
        theta = json_to_finite(*it, field(std::string(k) + ".rope_theta"));
      } else if (key == "partial_rotary_factor") {
        if (json_to_finite(*it, field(std::string(k) + "." + key)) != 1.0)
          fail(field(std::string(k) + "." + key), " = ", json_excerpt(*it),
               ": partial rotary embeddings are not supported");
      } else {
        fail(field(std::string(k) + "." + key), " = ", json_excerpt(*it),
             ": RoPE scaling is not supported (only plain RoPE with rope_theta)");
      }
    }
  };
  if (has("rope_scaling")) read_rope_dict("rope_scaling");
  if (has("rope_parameters")) read_rope_dict("rope_parameters");
  if (has("rope_theta")) {
    const double top = json_to_finite(hf.at("rope_theta"), field("rope_theta"));
    if (theta && *theta != top)
      fail(where, ": rope_theta = ", top, " but rope_parameters.rope_theta = ", *theta,
           "; the file contradicts itself");
    theta = top;
  }

  // A key left out means the config class's default, as transformers reads the file
  // (Qwen3Config, or MharConfig for mhar exports); the five that fix the model's size are
  // required, since transformers always writes them. null head counts mean "derived".
  const bool qwen = type == "qwen3";
  const int64_t heads = get_int("num_attention_heads", 1, 4096);
  const int64_t hidden = get_int("hidden_size", 1, int64_t(1) << 20);
  auto present = [&](const char* k) { return hf.find(k) != hf.end(); };
  int64_t kv_heads = qwen ? 32 : 4;
  if (present("num_key_value_heads"))
    kv_heads = hf.at("num_key_value_heads").is_null() ? heads : get_int("num_key_value_heads", 1, 4096);
  int64_t head_dim = qwen ? 128 : 64;
  if (present("head_dim")) head_dim = hf.at("head_dim").is_null() ? hidden / heads : get_int("head_dim", 1, 1 << 16);
  if (head_dim < 1)
    fail(where, ": head_dim is null and hidden_size / num_attention_heads = ", hidden, " / ", heads,
         " is 0; give head_dim");
  json model = {
      {"vocab_size", get_int("vocab_size", 1, int64_t(1) << 26)},
      {"d_model", hidden},
      {"n_layers", get_int("num_hidden_layers", 1, 4096)},
      {"n_heads", heads},
      {"n_kv_heads", kv_heads},
      {"head_dim", head_dim},
      {"d_ff", get_int("intermediate_size", 1, int64_t(1) << 24)},
      {"context_length", has("max_position_embeddings") ? get_int("max_position_embeddings", 1, int64_t(1) << 30)
                                                         : (qwen ? 32768 : 2048)},
      {"rope_theta", theta.value_or(qwen ? 10000.0 : 1e6)},
      {"rms_eps", has("rms_norm_eps") ? json_to_finite(hf.at("rms_norm_eps"), field("rms_norm_eps")) : 1e-6},
      {"init_std", has("initializer_range") ? json_to_finite(hf.at("initializer_range"), field("initializer_range")) : 0.02},
      {"tie_embeddings", has("tie_word_embeddings") ? json_to_bool(hf.at("tie_word_embeddings"), field("tie_word_embeddings"))
                                                    : !qwen},
  };
  json residual = {{"mode", "standard"}};
  if (type == "mhar") {
    if (!has("residual_mode")) fail(where, ": missing field \"residual_mode\" (an mhar export names its residual mode)");
    residual["mode"] = json_to_string(hf.at("residual_mode"), field("residual_mode"));
    // The residual scheme's fields as hf_config_json writes them (engine names); a field
    // left out takes configuration_mhar.py's default, which is the engine's, and the
    // engine's config validation below judges the combination.
    if (has("routing_heads")) residual["heads"] = get_int("routing_heads", 0, 1 << 20);
    if (has("block_size")) residual["block_size"] = get_int("block_size", 0, 1 << 20);
    if (has("hyper_n")) residual["hyper_n"] = get_int("hyper_n", 1, 1 << 20);
    if (has("hyper_dynamic")) residual["hyper_dynamic"] = json_to_bool(hf.at("hyper_dynamic"), field("hyper_dynamic"));
    if (has("block_layers")) residual["block_layers"] = get_int("block_layers", 1, 1 << 20);
  }
  return {{"model", model}, {"residual", residual}};
}

HfImportPlan plan_hf_import(const std::string& hf_dir, const std::string& out_dir,
                            const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!fs::is_directory(hf_dir, ec))
    fail("--hf ", hf_dir, ": not a directory (give a Hugging Face model directory with config.json and "
         "model.safetensors)");
  HfImportPlan plan;
  plan.hf_dir = hf_dir;
  plan.out_dir = fs::absolute(fs::path(out_dir)).lexically_normal().string();
  if (!plan.out_dir.empty() && plan.out_dir.back() == '/') plan.out_dir.pop_back();
  const std::string config_path = (fs::path(hf_dir) / "config.json").string();
  if (!fs::exists(config_path, ec))
    fail(config_path, ": missing; a Hugging Face model directory holds config.json");
  const json hf = read_json_file(config_path, "Hugging Face config.json", {}, uint64_t(16) << 20);
  json j = engine_model_from_hf_config(hf, config_path);
  plan.model_type = hf.at("model_type").get<std::string>();
  // Defaults of an imported run; --set changes any of them.
  j["train"] = {{"seq_len", std::min<int64_t>(1024, j["model"]["context_length"].get<int64_t>())}};
  bool tokenizer_named = false;
  for (const std::string& o : overrides) {
    apply_override(j, o, config_path);
    tokenizer_named |= o.rfind("data.tokenizer=", 0) == 0;
  }
  plan.config = config_from_json(j, config_path + " (imported, with --set)");

  const std::string tok = (fs::path(hf_dir) / "tokenizer.json").string();
  if (!tokenizer_named) {
    if (!fs::exists(tok, ec))
      fail(hf_dir, ": has no tokenizer.json; name the tokenizer this model was trained with: "
           "--set data.tokenizer=gpt2|qwen3|PATH");
    plan.tokenizer_source = tok;
    plan.config.data.tokenizer = (fs::path(plan.out_dir) / "tokenizer.json").string();
  }

  // Weights: model.safetensors first, then the index (the order transformers looks in).
  const std::string single = (fs::path(hf_dir) / "model.safetensors").string();
  const std::string index = (fs::path(hf_dir) / "model.safetensors.index.json").string();
  if (fs::exists(single, ec)) {
    require_regular_file(single, "safetensors file");
    plan.weight_files = {fs::absolute(single).string()};
  } else if (fs::exists(index, ec)) {
    plan.index_file = index;
    const json idx = read_json_file(index, "safetensors index", {}, uint64_t(256) << 20);
    const json& wm = json_member(idx, "weight_map", index);
    if (!wm.is_object() || wm.empty())
      fail(index, ": weight_map = ", json_excerpt(wm), " must be a non-empty object {tensor: file}");
    std::set<std::string> seen;
    for (auto it = wm.begin(); it != wm.end(); ++it) {
      const std::string file = json_to_string(*it, index + ": weight_map." + it.key());
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
          file.find('\\') != std::string::npos)
        fail(index, ": weight_map.", it.key(), " = \"", file, "\" is not a file name inside ", hf_dir);
      plan.weight_map[it.key()] = file;
      if (seen.insert(file).second) {
        const std::string path = (fs::path(hf_dir) / file).string();
        require_regular_file(path, "safetensors shard (listed in model.safetensors.index.json)");
        plan.weight_files.push_back(fs::absolute(path).string());
      }
    }
    std::sort(plan.weight_files.begin(), plan.weight_files.end());
  } else if (fs::exists(fs::path(hf_dir) / "pytorch_model.bin", ec)) {
    fail(hf_dir, ": holds pytorch_model.bin; only safetensors weights are read (convert with "
         "transformers' save_pretrained(safe_serialization=True))");
  } else {
    fail(hf_dir, ": has no model.safetensors or model.safetensors.index.json");
  }
  return plan;
}

HfImportResult write_hf_import(const HfImportPlan& plan, const Config& cfg,
                               const json& loader_state, bool overwrite) {
  require_exportable(cfg.residual, plan.hf_dir);
  const std::vector<HfTensorSpec> layout = hf_tensor_layout(cfg.model, cfg.residual);
  std::map<std::string, std::vector<int64_t>> expected;
  for (const auto& s : layout) expected[s.name] = s.shape;
  const bool tied = cfg.model.tie_embeddings;
  const std::string described = std::string("a ") + residual_mode_name(cfg.residual.mode) +
                                " model with this config (hidden_size " + std::to_string(cfg.model.d_model) +
                                ", " + std::to_string(cfg.model.n_layers) + " layers, tie_word_embeddings " +
                                (tied ? "true" : "false") + ")";

  // Pass 1: names, shapes and dtypes of every file. Nothing sized by config.json is
  // allocated before the files agree with it.
  std::map<std::string, std::string> found;  // tensor -> file name
  std::optional<SafetensorsFile> kept;       // a single file is read once
  for (const std::string& path : plan.weight_files) {
    SafetensorsFile f = SafetensorsFile::load(path);
    const std::string fname = fs::path(path).filename().string();
    for (const std::string& name : f.names()) {
      if (ignorable_tensor(name)) continue;
      if (!plan.weight_map.empty()) {
        auto it = plan.weight_map.find(name);
        if (it == plan.weight_map.end())
          fail(path, ": holds tensor ", name, ", which ", plan.index_file, " does not list");
        if (it->second != fname)
          fail(path, ": holds tensor ", name, ", but ", plan.index_file, " maps it to ", it->second);
      }
      if (found.count(name)) fail(path, ": tensor ", name, " also appears in ", found[name]);
      const bool tied_head = tied && name == "lm_head.weight";
      auto ex = expected.find(tied_head ? "model.embed_tokens.weight" : name);
      if (ex == expected.end())
        fail(path, ": tensor ", name, " is not part of ", described, extra_tensor_hint(name, cfg));
      const SafetensorsFile::Entry& e = f.entry(name);
      if (e.shape != ex->second)
        fail(path, ": tensor ", name, " has shape ", shape_text(e.shape), " but ", described, " needs ",
             shape_text(ex->second));
      if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16")
        fail(path, ": tensor ", name, " has dtype ", e.dtype, "; supported: F32, BF16, F16");
      found[name] = fname;
    }
    if (plan.weight_files.size() == 1) kept.emplace(std::move(f));
  }
  for (const auto& s : layout)
    if (!found.count(s.name))
      fail(plan.index_file.empty() ? plan.weight_files.front() : plan.index_file, ": tensor ", s.name,
           " is missing; ", described, " needs it");
  for (const auto& [name, file] : plan.weight_map)
    if (!found.count(name) && !ignorable_tensor(name))
      fail(plan.index_file, ": lists ", name, " in ", file, ", but that file has no such tensor");

  // Pass 2: the values, into a CPU model (fp32, batch 1 x 1 token of activations).
  auto backend = make_cpu_backend(DType::F32);
  Model model(cfg.model, cfg.residual, *backend, 1, 1);
  HfImportResult result;
  std::vector<double> head;  // lm_head.weight of a tied model, which must equal the embedding
  std::string head_file;
  auto load = [&](const SafetensorsFile& f, const std::string& path) {
    for (const std::string& name : f.names()) {
      if (ignorable_tensor(name)) continue;
      std::vector<double> v = tensor_values(f, path, name);
      for (size_t i = 0; i < v.size(); ++i)
        if (!std::isfinite(v[i]))
          fail(path, ": tensor ", name, " holds a non-finite value (", v[i], ") at element ", i);
      result.dtypes[f.entry(name).dtype] += 1;
      if (tied && name == "lm_head.weight") {
        head = std::move(v);
        head_file = path;
        continue;
      }
      result.parameters += int64_t(v.size());
      backend->upload(model.parameter(name).value, v.data());
    }
  };
  if (kept) {
    load(*kept, plan.weight_files.front());
    kept.reset();
  } else {
    for (const std::string& path : plan.weight_files) load(SafetensorsFile::load(path), path);
  }
  if (!head.empty()) {
    std::vector<double> emb(head.size());
    backend->download(emb.data(), model.parameter("model.embed_tokens.weight").value);
    if (emb != head)
      fail(head_file, ": lm_head.weight differs from model.embed_tokens.weight, but config.json says "
           "tie_word_embeddings: true; set it to false for a model with its own output layer");
  }
  const std::string tokenizer_text =
      plan.tokenizer_source.empty()
          ? std::string()
          : read_regular_file(plan.tokenizer_source, "tokenizer.json", uint64_t(256) << 20);

  // Everything checks out: write the run directory.
  std::vector<std::pair<std::string, std::string>> files;
  if (!plan.tokenizer_source.empty()) files.emplace_back("tokenizer.json", tokenizer_text);
  const Step0Run run = write_step0_run(plan.out_dir, overwrite, cfg, model, loader_state, files);
  result.run_dir = run.run_dir;
  result.checkpoint_dir = run.checkpoint_dir;
  return result;
}

}  // namespace mhar
