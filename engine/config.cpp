// config.cpp: JSON <-> Config. visit_fields() per section names each field once, with
// its valid range and the reason for it; the FieldReader, FieldWriter and RangeChecker
// visitors turn that list into parsing (type and range checks on the JSON value before
// narrowing, unknown-key detection), printing and validation. validate() adds the
// cross-field rules and the size caps (check_footprint).
#include "engine/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>

#include "engine/error.h"
#include "engine/json_io.h"

namespace mhar {

using nlohmann::json;

std::string residual_summary(const ResidualConfig& r) {
  std::string s = residual_mode_name(r.mode);
  if (r.routed()) s += " H=" + std::to_string(r.heads);
  if (r.routed() && r.block_size > 1) s += " block " + std::to_string(r.block_size);
  if (r.mode == ResidualMode::Hyper) s += " n=" + std::to_string(r.hyper_n);
  if (r.mode == ResidualMode::Hyper && r.hyper_dynamic) s += " dynamic";
  if (r.mode == ResidualMode::Delta)
    s += " H=" + std::to_string(r.heads) + " block_layers " + std::to_string(r.block_layers);
  return s;
}

const char* residual_mode_name(ResidualMode m) {
  switch (m) {
    case ResidualMode::Standard: return "standard";
    case ResidualMode::AttnRes: return "attnres";
    case ResidualMode::Mhar: return "mhar";
    case ResidualMode::Hyper: return "hyper";
    case ResidualMode::Delta: return "delta";
  }
  return "?";
}

namespace {

// The valid range of an integer field, inclusive, and why it is bounded there.
struct IntRange {
  long long lo, hi;
  const char* why;
};
// The valid range of a real field; each end open or closed; and why.
struct RealRange {
  double lo, hi;
  bool lo_open, hi_open;
  const char* why;
};
constexpr bool kOpen = true, kClosed = false;
constexpr long long kIntMax = 2147483647;  // counts that only cost time stop at int's range

// Caps on sizes lie far above any model one device can train (the largest open models
// have ~126 layers, d_model 16384, d_ff 53248, 128 heads, 256k vocabularies, 128k
// contexts). They exist so that a typing slip gets a message before anything is planned:
// the memory planner's cost grows with the tensor count (about 30 per layer), and at
// n_layers = 1024 it plans in well under a second.
template <class V> void visit_fields(ModelConfig& c, V& v) {
  v("vocab_size", c.vocab_size,
    IntRange{1, 1 << 24, "token ids must stay exact in fp32 (2^24); real vocabularies are <= 262144"});
  v("d_model", c.d_model, IntRange{1, 65536, "a size cap; real models use <= 16384"});
  v("n_layers", c.n_layers,
    IntRange{1, 1024, "a size cap; real models use <= 126, and planning stays under a second"});
  v("n_heads", c.n_heads, IntRange{1, 1024, "a size cap; real models use <= 128"});
  v("n_kv_heads", c.n_kv_heads, IntRange{1, 1024, "a size cap; real models use <= 128"});
  v("head_dim", c.head_dim, IntRange{2, 1024, "RoPE needs pairs; real models use 64 to 256"});
  v("d_ff", c.d_ff, IntRange{1, 262144, "a size cap; real models use <= 53248"});
  v("context_length", c.context_length,
    IntRange{1, 1 << 20, "a size cap (1M positions); real models use <= 131072"});
  v("rope_theta", c.rope_theta,
    RealRange{1, 1e12, kClosed, kClosed,
              "below 1 the rotation speeds up with the dimension index, the reverse of RoPE; "
              "real models use 1e4 to 1e7"});
  v("rms_eps", c.rms_eps,
    RealRange{1e-30, 1, kClosed, kOpen,
              "it guards the division by the RMS, so it must survive rounding to fp32 "
              "(whose normal range starts at 1.2e-38); at 1 or more it swamps unit-scale "
              "activations; real models use 1e-6 or 1e-5"});
  v("tie_embeddings", c.tie_embeddings);
  v("init_std", c.init_std,
    RealRange{0, 10, kOpen, kClosed,
              "0 would make every weight equal and symmetric; the upper end is a plausibility "
              "bound far above real use (~0.02)"});
}
template <class V> void visit_fields(ResidualConfig& c, V& v) {
  v("mode", c.mode);
  v("heads", c.heads,
    IntRange{0, 1024, "0 picks the default (n_kv_heads for mhar, 1 for attnres); it must "
                      "divide d_model"});
  v("block_size", c.block_size,
    IntRange{0, 2048, "sublayers per routing block; 0 = full routing; at most 2 * n_layers"});
  v("hyper_n", c.hyper_n,
    IntRange{1, 64, "residual streams of mode hyper (the paper uses 1 to 8); a plausibility "
                    "bound, each stream costs one more [tokens, d_model] per sublayer"});
  v("hyper_dynamic", c.hyper_dynamic);
  v("block_layers", c.block_layers,
    IntRange{1, 1 << 20, "layers per block of mode delta's routed sources; at most "
                         "model.n_layers"});
}
template <class V> void visit_fields(TrainConfig& c, V& v) {
  v("micro_batch", c.micro_batch, IntRange{1, 65536, "a size cap; one step holds micro_batch x seq_len tokens"});
  v("seq_len", c.seq_len, IntRange{1, 1 << 20, "at most model.context_length"});
  v("batch_tokens", c.batch_tokens,
    IntRange{0, 1LL << 40, "0 = one micro-batch; real runs use <= 2^24 tokens a step"});
  v("steps", c.steps, IntRange{1, 1000000000, "a count cap (10^9 optimizer steps)"});
  v("lr", c.lr,
    RealRange{0, 10, kOpen, kClosed,
              "AdamW moves each weight by about lr a step, so this is a plausibility bound "
              "far above real use (1e-4 to 1e-2)"});
  v("min_lr_ratio", c.min_lr_ratio,
    RealRange{0, 1, kClosed, kClosed, "the final learning rate as a share of train.lr"});
  v("warmup_steps", c.warmup_steps, IntRange{0, 1000000000, "at most train.steps"});
  v("schedule", c.schedule);
  v("decay_fraction", c.decay_fraction,
    RealRange{0, 1, kClosed, kClosed, "a share of the steps after warm-up"});
  v("weight_decay", c.weight_decay,
    RealRange{0, 10, kClosed, kClosed,
              "a plausibility bound far above real use (0 to 0.1); see also lr x weight_decay"});
  v("beta1", c.beta1,
    RealRange{0, 1, kClosed, kOpen, "a moving-average factor; at 1 the moment never updates"});
  v("beta2", c.beta2,
    RealRange{0, 1, kClosed, kOpen, "a moving-average factor; at 1 the bias correction divides by 0"});
  v("adam_eps", c.adam_eps,
    RealRange{1e-30, 1, kClosed, kOpen,
              "it guards the division by sqrt(v), so it must survive rounding to fp32; "
              "at 1 or more it dwarfs the gradients; real runs use 1e-8"});
  v("grad_clip", c.grad_clip,
    RealRange{0, 1e6, kClosed, kClosed,
              "0 disables clipping; the upper end is a plausibility bound (real runs clip at ~1)"});
  v("seed", c.seed);  // any 64-bit value
  v("eval_every", c.eval_every, IntRange{1, kIntMax, "steps between evaluations"});
  v("eval_batches", c.eval_batches, IntRange{1, kIntMax, "batches per evaluation"});
  v("log_every", c.log_every, IntRange{1, kIntMax, "steps between log lines"});
  v("max_bad_steps", c.max_bad_steps,
    IntRange{1, kIntMax, "consecutive non-finite steps before the run stops"});
  v("device", c.device);
  v("logits_chunk", c.logits_chunk,
    IntRange{0, 1 << 30, "tokens per chunk of the LM head; 0 = automatic (chunk logits <= "
                         "2 GiB); values above micro_batch x seq_len mean one chunk"});
}
template <class V> void visit_fields(DataConfig& c, V& v) {
  v("train", c.train);
  v("val", c.val);
  v("tokenizer", c.tokenizer);
}
template <class V> void visit_fields(CheckpointConfig& c, V& v) {
  v("every", c.every, IntRange{0, kIntMax, "steps between checkpoints; 0 = only at the end"});
  v("keep", c.keep, IntRange{0, kIntMax, "newest checkpoints kept; 0 = all"});
}

template <class V> void visit_sections(Config& c, V& v) {
  v.section("model", c.model);
  v.section("residual", c.residual);
  v.section("train", c.train);
  v.section("data", c.data);
  v.section("checkpoint", c.checkpoint);
}

// A key for a message: a hostile file's key may be megabytes long.
std::string clip(const std::string& key) {
  return key.size() > 80 ? key.substr(0, 80) + "..." : key;
}

std::string field_path(const std::string& source, const std::string& section,
                       const std::string& key) {
  return source + ": " + section + "." + key;
}

std::string describe(const IntRange& r) {
  return std::to_string(r.lo) + " to " + std::to_string(r.hi) + " (" + r.why + ")";
}
// A bound as written in the field list: whole numbers without ".0", others in the
// shortest text that reads back as the same double (json's dump).
std::string bound_text(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string((long long)v);
  return json(v).dump();
}
std::string describe(const RealRange& r) {
  return std::string(r.lo_open ? "(" : "[") + bound_text(r.lo) + ", " + bound_text(r.hi) +
         (r.hi_open ? ")" : "]") + " (" + r.why + ")";
}
bool in_range(double v, const RealRange& r) {
  return (r.lo_open ? v > r.lo : v >= r.lo) && (r.hi_open ? v < r.hi : v <= r.hi);
}

// Reads one section's fields from JSON, with the section path for messages. Every number
// is range-checked on the JSON value itself (json_io's getters), before it is narrowed to
// its field's type, so the message shows the value the user wrote.
struct FieldReader {
  const json* obj = nullptr;
  std::string path;    // "model"
  std::string source;  // file name
  std::vector<std::string> known;

  std::string where(const std::string& key) const { return field_path(source, path, key); }
  const json* find(const std::string& key) {
    known.push_back(key);
    auto it = obj->find(key);
    return it == obj->end() ? nullptr : &*it;
  }
  template <class Int>
  void read_int(const std::string& key, Int& out, const IntRange& r) {
    const json* val = find(key);
    if (!val) return;
    try {
      out = static_cast<Int>(json_to_int(*val, where(key), r.lo, r.hi));
    } catch (const Error& e) {
      fail(e.what(), " (", r.why, ")");
    }
  }
  void operator()(const std::string& key, int& out, const IntRange& r) { read_int(key, out, r); }
  void operator()(const std::string& key, long long& out, const IntRange& r) { read_int(key, out, r); }
  void operator()(const std::string& key, unsigned long long& out) {
    const json* val = find(key);
    if (!val) return;
    // A non-negative integer built in code ({"seed", 5}) is signed, one parsed from text
    // unsigned; both are valid.
    if (val->is_number_integer() && !val->is_number_unsigned() && val->get<int64_t>() >= 0) {
      out = uint64_t(val->get<int64_t>());
      return;
    }
    // Whole numbers beyond 2^64-1 reach here as doubles (the JSON reader's fallback).
    if (val->is_number_float() && std::floor(val->get<double>()) == val->get<double>() &&
        std::fabs(val->get<double>()) >= 0x1p64)
      fail(where(key), " = ", json_excerpt(*val), " is out of range; valid: 0 to ", UINT64_MAX);
    out = json_to_uint(*val, where(key), 0, UINT64_MAX);
  }
  void operator()(const std::string& key, double& out, const RealRange& r) {
    const json* val = find(key);
    if (!val) return;
    const double d = json_to_finite(*val, where(key));
    if (!in_range(d, r))
      fail(where(key), " = ", json_excerpt(*val), " is out of range; valid: ", describe(r));
    out = d;
  }
  void operator()(const std::string& key, bool& out) {
    const json* val = find(key);
    if (!val) return;
    out = json_to_bool(*val, where(key));
  }
  void operator()(const std::string& key, std::string& out) {
    const json* val = find(key);
    if (!val) return;
    out = json_to_string(*val, where(key));
  }
  void operator()(const std::string& key, ResidualMode& out) {
    const json* val = find(key);
    if (!val) return;
    if (val->is_string())
      for (ResidualMode m : {ResidualMode::Standard, ResidualMode::AttnRes, ResidualMode::Mhar,
                             ResidualMode::Hyper, ResidualMode::Delta})
        if (val->get_ref<const std::string&>() == residual_mode_name(m)) {
          out = m;
          return;
        }
    fail(where(key), " = ", json_excerpt(*val),
         " is not a residual mode; valid: \"standard\", \"attnres\", \"mhar\", \"hyper\", "
         "\"delta\"");
  }
  void reject_unknown() {
    std::set<std::string> ok(known.begin(), known.end());
    for (auto it = obj->begin(); it != obj->end(); ++it) {
      if (ok.count(it.key())) continue;
      std::string valid;
      for (const auto& k : known) valid += (valid.empty() ? "" : ", ") + k;
      fail(source, ": unknown key ", path, ".", clip(it.key()), " (valid keys of ", path, ": ", valid,
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
      fail(source, ": ", name, " = ", json_excerpt(*it), " must be an object of ", name, " fields");
    FieldReader r{&*it, name, source, {}};
    visit_fields(s, r);
    r.reject_unknown();
  }
};

// The same bounds for a Config built or changed in code (and re-validated after
// --device or a resume), with the same messages as the reader's.
struct RangeChecker {
  std::string path, source;
  void operator()(const std::string& key, const int& v, const IntRange& r) { check(key, v, r); }
  void operator()(const std::string& key, const long long& v, const IntRange& r) { check(key, v, r); }
  void operator()(const std::string& key, const double& v, const RealRange& r) {
    if (!in_range(v, r))
      fail(field_path(source, path, key), " = ", json(v).dump(), " is out of range; valid: ",
           describe(r));
  }
  void operator()(const std::string& key, const std::string& v) {
    // Strings end up in paths, file names and messages.
    if (v.find('\0') != std::string::npos)
      fail(field_path(source, path, key), " contains a NUL byte");
    if (v.size() > 4096)
      fail(field_path(source, path, key), " is ", v.size(), " bytes long; at most 4096 (PATH_MAX)");
  }
  template <class T> void operator()(const std::string&, const T&) {}
  void check(const std::string& key, long long v, const IntRange& r) {
    if (v < r.lo || v > r.hi)
      fail(field_path(source, path, key), " = ", v, " is out of range; valid: ", describe(r));
  }
};

struct ConfigChecker {
  std::string source;
  template <class Section> void section(const std::string& name, Section& s) {
    RangeChecker c{name, source};
    visit_fields(s, c);
  }
};

struct FieldWriter {
  json* obj;
  template <class T> void operator()(const std::string& key, const T& v) { (*obj)[key] = v; }
  template <class T, class Range>
  void operator()(const std::string& key, const T& v, const Range&) { (*obj)[key] = v; }
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
  ConfigChecker ranges{source};
  visit_sections(const_cast<Config&>(*this), ranges);

  const auto& m = model;
  auto where = [&](const std::string& field) { return source + ": " + field; };
  if (m.head_dim % 2)
    fail(where("model.head_dim"), " = ", m.head_dim, " must be even (RoPE pairs i with i + head_dim/2)");
  if (m.n_heads % m.n_kv_heads)
    fail(where("model.n_kv_heads"), " = ", m.n_kv_heads, " does not divide model.n_heads = ",
         m.n_heads, " (grouped-query attention needs a whole number of query heads per KV head)");

  const int H = residual.heads, s = residual.block_size;
  const std::string mode_name = residual_mode_name(residual.mode);
  if (!residual.routed() && s != 0)
    fail(where("residual.block_size"), " = ", s, " has no meaning in mode \"", mode_name,
         "\" (block routing groups the sources of attnres and mhar); leave it 0");
  if (residual.mode != ResidualMode::Hyper) {
    if (residual.hyper_n != ResidualConfig{}.hyper_n)
      fail(where("residual.hyper_n"), " = ", residual.hyper_n, " has no meaning in mode \"",
           mode_name, "\" (it is the stream count of mode \"hyper\"); leave it out");
    if (residual.hyper_dynamic)
      fail(where("residual.hyper_dynamic"), " = true has no meaning in mode \"", mode_name,
           "\" (it selects dynamic Hyper-Connections in mode \"hyper\"); leave it out");
  }
  if (residual.mode != ResidualMode::Delta) {
    if (residual.block_layers != ResidualConfig{}.block_layers)
      fail(where("residual.block_layers"), " = ", residual.block_layers,
           " has no meaning in mode \"", mode_name,
           "\" (it is the block of mode \"delta\"'s routed sources; block routing in attnres "
           "and mhar is residual.block_size); leave it out");
  } else if (residual.block_layers > m.n_layers) {
    fail(where("residual.block_layers"), " = ", residual.block_layers,
         " is more than model.n_layers = ", m.n_layers, "; valid: 1..", m.n_layers,
         " layers per block");
  }
  if (residual.routed() && s > 2 * m.n_layers)
    fail(where("residual.block_size"), " = ", s, " is more than the 2 * model.n_layers = ",
         2 * m.n_layers, " sublayers; valid: 0 (full routing) or 1..", 2 * m.n_layers,
         " sublayers per block");
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
    case ResidualMode::Delta:
      if (H <= 0) fail(where("residual.heads"), " = ", H, " must be >= 1");
      if (m.d_model % H)
        fail(where("residual.heads"), " = ", H, " does not divide model.d_model = ", m.d_model);
      break;
    case ResidualMode::Hyper:
      if (H != 0)
        fail(where("residual.heads"), " = ", H,
             " has no meaning in mode \"hyper\" (it mixes residual.hyper_n streams, it does "
             "not route); leave it 0");
      // The CUDA kernels (cuda/hyper.cu, static and dynamic) take 1 to 8 streams: a config that asks for the
      // GPU outright is refused here; "auto" on a GPU machine meets the same check when
      // the model is built (Backend::check_hyper).
      if (train.device == "cuda" && residual.hyper_n > 8)
        fail(where("residual.hyper_n"), " = ", residual.hyper_n, " with train.device = "
             "\"cuda\": the CUDA kernels of residual.mode hyper take 1 to 8 streams; use "
             "fewer or run it with --device cpu (train.device = \"cpu\")");
      break;
  }

  const auto& t = train;
  if (t.seq_len > m.context_length)
    fail(where("train.seq_len"), " = ", t.seq_len, " exceeds model.context_length = ",
         m.context_length);
  const long long micro_tokens = 1LL * t.micro_batch * t.seq_len;
  if (t.batch_tokens > 0 && t.batch_tokens % micro_tokens)
    fail(where("train.batch_tokens"), " = ", t.batch_tokens,
         " must be 0 or a multiple of train.micro_batch * train.seq_len = ", micro_tokens);
  if (t.warmup_steps > t.steps)
    fail(where("train.warmup_steps"), " = ", t.warmup_steps, " must be in [0, train.steps = ",
         t.steps, "]");
  if (t.schedule != "cosine" && t.schedule != "wsd")
    fail(where("train.schedule"), " = ", json_excerpt(t.schedule),
         " is not a schedule; valid: \"cosine\", \"wsd\"");
  // Decoupled weight decay multiplies every weight by (1 - lr * weight_decay) each step.
  if (t.lr * t.weight_decay >= 1)
    fail(where("train.weight_decay"), " = ", json(t.weight_decay).dump(), " with train.lr = ",
         json(t.lr).dump(), ": their product must be < 1 (AdamW multiplies every weight by "
         "1 - lr x weight_decay a step, so at 1 or more the decay alone zeroes or flips them)");
  if (t.device != "auto" && t.device != "cpu" && t.device != "cuda")
    fail(where("train.device"), " = ", json_excerpt(t.device),
         " is not a device; valid: \"auto\", \"cpu\", \"cuda\"");
  if (data.tokenizer.empty())
    fail(where("data.tokenizer"), " is empty; valid: \"gpt2\", \"qwen3\" or a tokenizer.json path");
  check_footprint(m, residual, t.micro_batch, t.seq_len, source);
}

int64_t logits_chunk_tokens(int64_t tokens, int64_t vocab, size_t value_bytes, int64_t requested) {
  MHAR_CHECK(tokens > 0 && vocab > 0 && value_bytes > 0 && requested >= 0, "logits chunk of ",
             tokens, " tokens, vocab ", vocab, ", ", value_bytes, " bytes, requested ", requested);
  if (requested > 0) return std::min(requested, tokens);
  const double row = double(vocab) * double(value_bytes);
  const int64_t fit = std::max<int64_t>(1, int64_t(kLogitsChunkBytes / row));
  if (fit >= tokens) return tokens;
  const int64_t chunks = (tokens + fit - 1) / fit, even = (tokens + chunks - 1) / chunks;
  const int64_t tiled = (even + 63) / 64 * 64;
  return tiled <= fit ? tiled : even;
}

StepFootprint estimate_footprint(const ModelConfig& m, const ResidualConfig& r, int64_t batch,
                                 int64_t seq_len) {
  // In doubles: the point is to refuse sizes whose byte counts overflow 64-bit integers.
  const double d = m.d_model, L = m.n_layers, V = m.vocab_size, F = m.d_ff, hd = m.head_dim;
  const double qd = double(m.n_heads) * hd, kvd = double(m.n_kv_heads) * hd;
  const double S = 2 * L + 1, H = r.routed() ? std::max(1, r.heads) : 0;
  const double N = double(batch) * double(seq_len);
  StepFootprint f;
  const double per_layer = 2 * d + 2 * hd + 2 * d * qd + 2 * d * kvd + 3 * d * F;
  const bool hyper = r.mode == ResidualMode::Hyper;
  const double n = hyper ? r.hyper_n : 0;
  const bool delta = r.mode == ResidualMode::Delta;
  f.parameters = V * d * (m.tie_embeddings ? 1 : 2) + L * per_layer + d + (r.routed() ? 2 * S * d : 0) +
                 (hyper ? 2 * L * (2 * n + n * n + (r.hyper_dynamic ? d * (n + 2) + 2 : 0)) : 0) +
                 (delta ? S * (2 * d + 1) + d : 0);
  f.parameter_bytes = 16 * f.parameters;  // value, gradient, two AdamW moments
  // Values per token kept from the forward pass for the backward one (model.cpp's plan).
  double per_token = S * d /* history */ + S * d /* site inputs */ + 2 * d /* head */;
  per_token += L * (d + 1 + 3 * qd + 3 * kvd + 2 * m.n_heads + m.n_kv_heads);  // attention
  per_token += L * (d + 1 + 3 * F);                                            // MLP
  // Routing: the per-pair statistics (backend.h's RoutingLayout::pairs, in closed form:
  // c = ceil(S/s) closed slots, S - c partial ones), site input gradients, ubar, inv_rms.
  const double s = delta ? r.delta_block() : r.routing_block(), c = std::ceil(S / s);
  const double pairs = c * S - s * c * (c - 1) / 2 + (S - c);
  if (r.routed()) per_token += pairs * H + S * d + S * H + S;
  // Delta: the same routing statistics, plus each site's routed term and its gradient
  // and the running standard stream (residual_delta.cpp's plan).
  if (delta) per_token += (pairs + S) * std::max(1, r.heads) + 3 * S * d + S + d;
  // Hyper: the n streams after every sublayer (and before the first), kept for the
  // backward (residual_hyper.cpp's plan).
  if (hyper) per_token += S * n * d;
  // Dynamic: per sublayer the coefficients, their gradient and tanh [n, n+2], and rstd [n].
  if (hyper && r.hyper_dynamic) per_token += 2 * L * (3 * n * (n + 2) + n);
  // The LM head holds the logits of one chunk of tokens (logits_chunk_tokens, automatic).
  const double chunk = N <= double(int64_t(1) << 62) && V >= 1
                           ? double(logits_chunk_tokens(int64_t(N), int64_t(V), 4, 0))
                           : N;
  f.activation_bytes = 4 * N * per_token + 4 * chunk * V;
  f.kv_cache_bytes = 4 * 2 * L * double(m.context_length) * kvd;
  return f;
}

void check_footprint(const ModelConfig& m, const ResidualConfig& r, int64_t batch, int64_t seq_len,
                     const std::string& where) {
  const StepFootprint f = estimate_footprint(m, r, batch, seq_len);
  auto gib = [](double b) {
    std::ostringstream os;
    os.precision(3);
    os << b / double(1 << 30) << " GiB";
    return os.str();
  };
  auto count = [](double n) {
    std::ostringstream os;
    os.precision(3);
    os << n;
    return os.str();
  };
  if (f.parameters > kMaxParameters)
    fail(where, ": the model has about ", count(f.parameters), " parameters, more than the cap of ",
         count(kMaxParameters),
         " (far above what one device can train); reduce model.n_layers, d_model, d_ff or "
         "vocab_size");
  if (f.parameter_bytes + f.activation_bytes > kMaxStepBytes)
    fail(where, ": one training step needs about ", gib(f.parameter_bytes + f.activation_bytes),
         " (", gib(f.parameter_bytes), " for parameters, gradients and optimizer state, ",
         gib(f.activation_bytes), " for the activations of ", batch, " x ", seq_len,
         " tokens), more than the cap of ", gib(kMaxStepBytes),
         "; reduce train.micro_batch, train.seq_len or the model's size");
  if (f.kv_cache_bytes > kMaxStepBytes)
    fail(where, ": a decoding cache over model.context_length = ", m.context_length,
         " positions needs about ", gib(f.kv_cache_bytes), ", more than the cap of ",
         gib(kMaxStepBytes), "; reduce model.context_length, n_layers or n_kv_heads");
}

Config config_from_json(const json& j, const std::string& source) {
  if (!j.is_object()) fail(source, ": a config must be a JSON object, got ", j.type_name());
  Config c;
  c.source = source;
  std::set<std::string> sections = {"model", "residual", "train", "data", "checkpoint"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!sections.count(it.key()))
      fail(source, ": unknown section ", clip(it.key()),
           " (valid sections: model, residual, train, data, checkpoint)");
  ConfigReader r{j, source};
  visit_sections(c, r);
  // Resolve the default routing head count before validating, so the printed config
  // shows the value actually used.
  if (c.residual.heads == 0) {
    if (c.residual.mode == ResidualMode::AttnRes) c.residual.heads = 1;
    if (c.residual.mode == ResidualMode::Mhar || c.residual.mode == ResidualMode::Delta)
      c.residual.heads = c.model.n_kv_heads;
  }
  c.validate();
  return c;
}

namespace {

// Whether `v` is spelled as a JSON number (RFC 8259's grammar), so that an out-of-range
// one (1e400) is reported as a number rather than taken as a word.
bool looks_like_json_number(const std::string& v) {
  size_t i = 0;
  auto digits = [&] {
    const size_t s = i;
    while (i < v.size() && v[i] >= '0' && v[i] <= '9') ++i;
    return i > s;
  };
  if (i < v.size() && v[i] == '-') ++i;
  if (!digits()) return false;
  if (i < v.size() && v[i] == '.') {
    ++i;
    if (!digits()) return false;
  }
  if (i < v.size() && (v[i] == 'e' || v[i] == 'E')) {
    ++i;
    if (i < v.size() && (v[i] == '+' || v[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == v.size();
}

// A bare word as a JSON string literal, so that parse_json_strict checks its UTF-8.
std::string quote(const std::string& v) {
  std::string out = "\"";
  for (const char c : v) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(static_cast<unsigned char>(c)));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

void apply_override(json& j, const std::string& assignment, const std::string& source) {
  auto eq = assignment.find('=');
  const std::string shown = json_excerpt(assignment.substr(0, 160), 120);  // quoted, valid UTF-8
  if (eq == std::string::npos || eq == 0)
    fail("--set ", shown, ": expected KEY=VALUE, for example model.n_layers=4");
  std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  auto dot = key.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == key.size())
    fail("--set ", shown, ": KEY must be SECTION.FIELD, for example train.lr=3e-4");
  std::string section = key.substr(0, dot), field = key.substr(dot + 1);
  parse_json_strict(quote(key), "--set " + shown + ": the key");  // refuses invalid UTF-8
  const std::string what = "--set " + clip(key);
  // JSON-looking values are parsed strictly (numbers, objects, arrays, quoted strings,
  // literals), so 1e400, nesting or a duplicate key is refused with the JSON reader's
  // reason; any other text is a bare word: residual.mode=mhar, data.train=x/*.bin.
  json parsed;
  if (looks_like_json_number(value) && !std::isfinite(std::strtod(value.c_str(), nullptr)))
    fail(what, "=", value.size() > 40 ? value.substr(0, 40) + "..." : value,
         ": the number is out of the range of a double (magnitude at most "
         "about 1.8e308)");
  const char c0 = value.empty() ? '\0' : value[0];
  if (looks_like_json_number(value) || c0 == '{' || c0 == '[' || c0 == '"' || value == "true" ||
      value == "false" || value == "null")
    parsed = parse_json_strict(value, what);
  else
    parsed = parse_json_strict(quote(value), what);
  if (!j.is_object()) fail(source, ": a config must be a JSON object");
  if (!j.contains(section)) j[section] = json::object();
  if (!j[section].is_object()) fail(source, ": ", json_excerpt(section), " must be an object");
  j[section][field] = std::move(parsed);  // an unknown field is rejected by the parser, with its path
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  JsonLimits limits;
  limits.allow_comments = true;
  json j = read_json_file(path, "config file", limits, uint64_t(16) << 20);
  for (const auto& o : overrides) apply_override(j, o, path);
  Config c = config_from_json(j, path);
  c.config_dir = std::filesystem::absolute(path).parent_path().string();
  return c;
}

}  // namespace mhar
