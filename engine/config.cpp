// config.cpp: JSON <-> Config. visit_fields() per section names each field once; the
// FieldReader and FieldWriter visitors turn that list into parsing (with type checks and
// unknown-key detection) and printing. validate() holds the cross-field rules.
#include "engine/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "engine/error.h"

namespace mhar {

using nlohmann::json;

const char* residual_mode_name(ResidualMode m) {
  switch (m) {
    case ResidualMode::Standard: return "standard";
    case ResidualMode::AttnRes: return "attnres";
    case ResidualMode::Mhar: return "mhar";
  }
  return "?";
}

namespace {

template <class V> void visit_fields(ModelConfig& c, V& v) {
  v("vocab_size", c.vocab_size);
  v("d_model", c.d_model);
  v("n_layers", c.n_layers);
  v("n_heads", c.n_heads);
  v("n_kv_heads", c.n_kv_heads);
  v("head_dim", c.head_dim);
  v("d_ff", c.d_ff);
  v("context_length", c.context_length);
  v("rope_theta", c.rope_theta);
  v("rms_eps", c.rms_eps);
  v("tie_embeddings", c.tie_embeddings);
  v("init_std", c.init_std);
}
template <class V> void visit_fields(ResidualConfig& c, V& v) {
  v("mode", c.mode);
  v("heads", c.heads);
}
template <class V> void visit_fields(TrainConfig& c, V& v) {
  v("micro_batch", c.micro_batch);
  v("seq_len", c.seq_len);
  v("batch_tokens", c.batch_tokens);
  v("steps", c.steps);
  v("lr", c.lr);
  v("min_lr_ratio", c.min_lr_ratio);
  v("warmup_steps", c.warmup_steps);
  v("schedule", c.schedule);
  v("decay_fraction", c.decay_fraction);
  v("weight_decay", c.weight_decay);
  v("beta1", c.beta1);
  v("beta2", c.beta2);
  v("adam_eps", c.adam_eps);
  v("grad_clip", c.grad_clip);
  v("seed", c.seed);
  v("eval_every", c.eval_every);
  v("eval_batches", c.eval_batches);
  v("log_every", c.log_every);
  v("max_bad_steps", c.max_bad_steps);
  v("device", c.device);
}
template <class V> void visit_fields(DataConfig& c, V& v) {
  v("train", c.train);
  v("val", c.val);
  v("tokenizer", c.tokenizer);
}
template <class V> void visit_fields(CheckpointConfig& c, V& v) {
  v("every", c.every);
  v("keep", c.keep);
}

template <class V> void visit_sections(Config& c, V& v) {
  v.section("model", c.model);
  v.section("residual", c.residual);
  v.section("train", c.train);
  v.section("data", c.data);
  v.section("checkpoint", c.checkpoint);
}

std::string type_name(const json& j) { return j.type_name(); }

// Reads one section's fields from JSON, with the section path for messages.
struct FieldReader {
  const json* obj = nullptr;
  std::string path;    // "model"
  std::string source;  // file name
  std::vector<std::string> known;

  [[noreturn]] void bad_type(const std::string& key, const json& val, const char* want) {
    fail(source, ": ", path, ".", key, " = ", val.dump(), " has type ", type_name(val),
         "; expected ", want);
  }
  const json* find(const std::string& key) {
    known.push_back(key);
    auto it = obj->find(key);
    return it == obj->end() ? nullptr : &*it;
  }
  template <class Int>
  void read_integer(const std::string& key, Int& out) {
    const json* val = find(key);
    if (!val) return;
    if (val->is_number_integer() || val->is_number_unsigned()) {
      if (val->is_number_integer() && val->template get<long long>() < 0 &&
          std::is_unsigned<Int>::value)
        fail(source, ": ", path, ".", key, " = ", val->dump(), " must be >= 0");
      out = val->template get<Int>();
      return;
    }
    if (val->is_number_float()) {
      double d = val->get<double>();
      if (std::floor(d) == d && std::fabs(d) < 9e15) { out = static_cast<Int>(d); return; }
    }
    bad_type(key, *val, "an integer");
  }
  void operator()(const std::string& key, int& out) { read_integer(key, out); }
  void operator()(const std::string& key, long long& out) { read_integer(key, out); }
  void operator()(const std::string& key, unsigned long long& out) { read_integer(key, out); }
  void operator()(const std::string& key, double& out) {
    const json* val = find(key);
    if (!val) return;
    if (!val->is_number()) bad_type(key, *val, "a number");
    out = val->get<double>();
  }
  void operator()(const std::string& key, bool& out) {
    const json* val = find(key);
    if (!val) return;
    if (!val->is_boolean()) bad_type(key, *val, "true or false");
    out = val->get<bool>();
  }
  void operator()(const std::string& key, std::string& out) {
    const json* val = find(key);
    if (!val) return;
    if (!val->is_string()) bad_type(key, *val, "a string");
    out = val->get<std::string>();
  }
  void operator()(const std::string& key, ResidualMode& out) {
    const json* val = find(key);
    if (!val) return;
    std::string s = val->is_string() ? val->get<std::string>() : val->dump();
    for (ResidualMode m : {ResidualMode::Standard, ResidualMode::AttnRes, ResidualMode::Mhar})
      if (s == residual_mode_name(m)) { out = m; return; }
    fail(source, ": ", path, ".", key, " = ", val->dump(),
         " is not a residual mode; valid: \"standard\", \"attnres\", \"mhar\"");
  }
  void reject_unknown() {
    std::set<std::string> ok(known.begin(), known.end());
    for (auto it = obj->begin(); it != obj->end(); ++it) {
      if (ok.count(it.key())) continue;
      std::string valid;
      for (const auto& k : known) valid += (valid.empty() ? "" : ", ") + k;
      fail(source, ": unknown key ", path, ".", it.key(), " (valid keys of ", path, ": ", valid,
           ")");
    }
  }
};

struct ConfigReader {
  const json& root;
  std::string source;
  template <class Section> void section(const std::string& name, Section& s) {
    auto it = root.find(name);
    if (it == root.end()) return;  // every field has a default
    if (!it->is_object())
      fail(source, ": ", name, " = ", it->dump(), " must be an object of ", name, " fields");
    FieldReader r{&*it, name, source, {}};
    visit_fields(s, r);
    r.reject_unknown();
  }
};

struct FieldWriter {
  json* obj;
  template <class T> void operator()(const std::string& key, const T& v) { (*obj)[key] = v; }
  void operator()(const std::string& key, const ResidualMode& m) {
    (*obj)[key] = residual_mode_name(m);
  }
};

struct ConfigWriter {
  json root = json::object();
  template <class Section> void section(const std::string& name, Section& s) {
    json obj = json::object();
    FieldWriter w{&obj};
    visit_fields(s, w);
    root[name] = obj;
  }
};

}  // namespace

json Config::to_json() const {
  ConfigWriter w;
  visit_sections(const_cast<Config&>(*this), w);
  return w.root;
}

void Config::validate() const {
  const auto& m = model;
  auto where = [&](const std::string& field) { return source + ": " + field; };
  auto positive = [&](const char* field, double v) {
    if (!(v > 0)) fail(where(field), " = ", v, " must be > 0");
  };
  positive("model.vocab_size", m.vocab_size);
  positive("model.d_model", m.d_model);
  positive("model.n_layers", m.n_layers);
  positive("model.n_heads", m.n_heads);
  positive("model.n_kv_heads", m.n_kv_heads);
  positive("model.head_dim", m.head_dim);
  positive("model.d_ff", m.d_ff);
  positive("model.context_length", m.context_length);
  positive("model.rope_theta", m.rope_theta);
  positive("model.rms_eps", m.rms_eps);
  positive("model.init_std", m.init_std);
  if (m.head_dim % 2)
    fail(where("model.head_dim"), " = ", m.head_dim, " must be even (RoPE pairs i with i + head_dim/2)");
  if (m.n_heads % m.n_kv_heads)
    fail(where("model.n_kv_heads"), " = ", m.n_kv_heads, " does not divide model.n_heads = ",
         m.n_heads, " (grouped-query attention needs a whole number of query heads per KV head)");

  const int H = residual.heads;
  switch (residual.mode) {
    case ResidualMode::Standard:
      if (H != 0 && H != 1)
        fail(where("residual.heads"), " = ", H, " has no meaning in mode \"standard\"; leave it 0");
      break;
    case ResidualMode::AttnRes:
      if (H != 1)
        fail(where("residual.heads"), " = ", H,
             " but mode \"attnres\" is routing with 1 head; use mode \"mhar\" for more heads");
      break;
    case ResidualMode::Mhar:
      if (H <= 0) fail(where("residual.heads"), " = ", H, " must be >= 1");
      if (m.d_model % H)
        fail(where("residual.heads"), " = ", H, " does not divide model.d_model = ", m.d_model);
      break;
  }

  const auto& t = train;
  positive("train.micro_batch", t.micro_batch);
  positive("train.seq_len", t.seq_len);
  positive("train.steps", t.steps);
  positive("train.lr", t.lr);
  if (t.seq_len > m.context_length)
    fail(where("train.seq_len"), " = ", t.seq_len, " exceeds model.context_length = ",
         m.context_length);
  const long long micro_tokens = 1LL * t.micro_batch * t.seq_len;
  if (t.batch_tokens < 0 || (t.batch_tokens > 0 && t.batch_tokens % micro_tokens))
    fail(where("train.batch_tokens"), " = ", t.batch_tokens,
         " must be 0 or a multiple of train.micro_batch * train.seq_len = ", micro_tokens);
  if (t.min_lr_ratio < 0 || t.min_lr_ratio > 1)
    fail(where("train.min_lr_ratio"), " = ", t.min_lr_ratio, " must be in [0, 1]");
  if (t.warmup_steps < 0 || t.warmup_steps > t.steps)
    fail(where("train.warmup_steps"), " = ", t.warmup_steps, " must be in [0, train.steps = ",
         t.steps, "]");
  if (t.schedule != "cosine" && t.schedule != "wsd")
    fail(where("train.schedule"), " = \"", t.schedule, "\" is not a schedule; valid: \"cosine\", \"wsd\"");
  if (t.decay_fraction < 0 || t.decay_fraction > 1)
    fail(where("train.decay_fraction"), " = ", t.decay_fraction, " must be in [0, 1]");
  if (t.weight_decay < 0) fail(where("train.weight_decay"), " = ", t.weight_decay, " must be >= 0");
  if (t.beta1 < 0 || t.beta1 >= 1) fail(where("train.beta1"), " = ", t.beta1, " must be in [0, 1)");
  if (t.beta2 < 0 || t.beta2 >= 1) fail(where("train.beta2"), " = ", t.beta2, " must be in [0, 1)");
  positive("train.adam_eps", t.adam_eps);
  if (t.grad_clip < 0) fail(where("train.grad_clip"), " = ", t.grad_clip, " must be >= 0 (0 disables)");
  positive("train.eval_every", t.eval_every);
  positive("train.eval_batches", t.eval_batches);
  positive("train.log_every", t.log_every);
  positive("train.max_bad_steps", t.max_bad_steps);
  if (t.device != "auto" && t.device != "cpu" && t.device != "cuda")
    fail(where("train.device"), " = \"", t.device, "\" is not a device; valid: \"auto\", \"cpu\", \"cuda\"");
  if (data.tokenizer.empty())
    fail(where("data.tokenizer"), " is empty; valid: \"gpt2\", \"qwen3\" or a tokenizer.json path");
  if (checkpoint.every < 0) fail(where("checkpoint.every"), " = ", checkpoint.every, " must be >= 0");
  if (checkpoint.keep < 0) fail(where("checkpoint.keep"), " = ", checkpoint.keep, " must be >= 0");
}

Config config_from_json(const json& j, const std::string& source) {
  if (!j.is_object()) fail(source, ": a config must be a JSON object, got ", j.type_name());
  Config c;
  c.source = source;
  std::set<std::string> sections = {"model", "residual", "train", "data", "checkpoint"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!sections.count(it.key()))
      fail(source, ": unknown section ", it.key(),
           " (valid sections: model, residual, train, data, checkpoint)");
  ConfigReader r{j, source};
  visit_sections(c, r);
  // Resolve the default routing head count before validating, so the printed config
  // shows the value actually used.
  if (c.residual.heads == 0) {
    if (c.residual.mode == ResidualMode::AttnRes) c.residual.heads = 1;
    if (c.residual.mode == ResidualMode::Mhar) c.residual.heads = c.model.n_kv_heads;
  }
  c.validate();
  return c;
}

void apply_override(json& j, const std::string& assignment, const std::string& source) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    fail("--set ", assignment, ": expected KEY=VALUE, for example model.n_layers=4");
  std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  auto dot = key.find('.');
  if (dot == std::string::npos)
    fail("--set ", assignment, ": KEY must be SECTION.FIELD, for example train.lr=3e-4");
  std::string section = key.substr(0, dot), field = key.substr(dot + 1);
  json parsed = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) parsed = value;  // bare words are strings: residual.mode=mhar
  if (!j.is_object()) fail(source, ": a config must be a JSON object");
  if (!j.contains(section)) j[section] = json::object();
  if (!j[section].is_object()) fail(source, ": ", section, " must be an object");
  j[section][field] = parsed;  // an unknown field is rejected by the parser, with its path
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) fail(path, ": cannot open config file");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (j.is_discarded()) fail(path, ": not valid JSON");
  for (const auto& o : overrides) apply_override(j, o, path);
  Config c = config_from_json(j, path);
  c.config_dir = std::filesystem::absolute(path).parent_path().string();
  return c;
}

}  // namespace mhar
