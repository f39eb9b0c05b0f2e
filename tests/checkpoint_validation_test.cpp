// checkpoint_validation_test.cpp: one test per mechanism that keeps a damaged checkpoint
// from being used (issue 18, section 3, "Checkpoints"). Every damage below is followed
// by `reseal` (all checksums recomputed, as a buggy writer or another tool would leave
// them), so each test reaches the check it is about:
// - the safetensors layout rule: overlapping, gapped, out-of-bounds tensors and trailing
//   junk refused; header lies (dtype, shape, duplicate names, metadata) refused; a
//   rewrite that keeps the meaning (another data order, padding) still loads the same;
// - the model's dtype and exact shape, and no extra or missing tensors, in every command
//   (a reversed shape refused by eval, sample and resume; an optimizer shape lie);
// - non-finite weights and moments refused, naming the tensor and index;
// - state.json: its own checksum, every field typed and ranged (the message names the
//   field), deep nesting refused, the format version;
// - FIFOs and /dev/zero (as model.safetensors, as state.json, in `files`) refused in
//   under 5 s, in-process and through the binary;
// - a NaN loss is never a success: `mhar eval` exits 1, a run ending on a NaN
//   validation loss fails naming the step.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/safetensors.h"
#include "tests/checkpoint_test_util.h"
#include "tests/wall_clock.h"

using namespace mhar;
using namespace mhar::test;

namespace {

const char* kKProj = "model.layers.0.self_attn.k_proj.weight";  // [4, 8]

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The tensors of a header sorted by where their data begins.
std::vector<std::string> by_offset(const json& header) {
  std::vector<std::pair<uint64_t, std::string>> v;
  for (auto it = header.begin(); it != header.end(); ++it)
    if (it.key() != "__metadata__") v.push_back({it.value()["data_offsets"][0].get<uint64_t>(), it.key()});
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& p : v) out.push_back(p.second);
  return out;
}

uint64_t begin_of(const json& header, const std::string& name) {
  return header[name]["data_offsets"][0].get<uint64_t>();
}

void put_f32(std::string& data, uint64_t at, float v) { std::memcpy(&data[size_t(at)], &v, 4); }

void make_fifo(const fs::path& p) {
  if (::mkfifo(p.c_str(), 0644) != 0) ADD_FAILURE() << "mkfifo " << p << ": " << std::strerror(errno);
}

class CheckpointValidation : public ::testing::Test {
 protected:
  static TinyRun* run_;
  fs::path dir, ck;

  static void SetUpTestSuite() {
    run_ = new TinyRun(make_tiny_run(fs::temp_directory_path() /
                                     ("mhar_ckpt_validation_" + std::to_string(::getpid()))));
  }
  static void TearDownTestSuite() {
    fs::remove_all(run_->root);
    delete run_;
    run_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(fs::path(run_->ckpt).filename(), "step_00000002");
    dir = run_->root / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ck = dir / "step_00000002";  // named after its step, as the reader checks
    link_checkpoint(run_->ckpt, ck);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }

  // What every command does with a checkpoint (resume does all of it): open, load the
  // weights, load the moments. "" when accepted, else the mhar::Error message. Any other
  // exception fails the test.
  std::string load_error() {
    try {
      CheckpointInfo info = open_checkpoint(ck.string());
      auto be = make_cpu_backend();
      Model m(info.config.model, info.config.residual, *be, 2, 16);
      AdamWOptimizer opt(m, info.config.train);
      load_model_weights(info, m, &opt);
      load_optimizer_moments(info, m, opt);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  }
  void expect_refused(const std::string& part, const std::string& what) {
    const std::string e = load_error();
    EXPECT_FALSE(e.empty()) << what << ": accepted";
    EXPECT_TRUE(contains(e, part)) << what << ": expected \"" << part << "\" in: " << e;
  }

  StParts parts(const char* file = "model.safetensors") { return split_safetensors(slurp(ck / file)); }
  void write(const std::string& bytes, const char* file = "model.safetensors") {
    spit(ck / file, bytes);
    reseal(ck);
  }
  void write(const StParts& p, const char* file = "model.safetensors") {
    write(join_safetensors(p.header, p.data), file);
  }
  // A state.json edit, resealed (the files' records first, so that an edit of them stays).
  void edit_state(const std::function<void(json&)>& f) {
    json st = read_state(ck);
    reseal_files(ck, st);
    f(st);
    seal_state(ck, st);
  }

  CliRun eval_cli() {
    return run_mhar(dir, "eval --device cpu --checkpoint " + ck.string() + " --data '" + run_->val_glob + "'");
  }
  CliRun sample_cli() {
    return run_mhar(dir, "sample --device cpu --checkpoint " + ck.string() + " --prompt 'ab' --max-tokens 3");
  }
  // A command refused: exit 1, the message containing `part`, in under 5 s.
  static void expect_cli_refused(const CliRun& r, const std::string& part, const std::string& what) {
    EXPECT_EQ(r.rc, 1) << what << "\nstdout: " << r.out << "\nstderr: " << r.err;
    EXPECT_TRUE(contains(r.err, part)) << what << ": expected \"" << part << "\" in: " << r.err;
    EXPECT_FALSE(contains(r.err, "internal error")) << what << ": " << r.err;
    EXPECT_LT(r.seconds, mhar::test::wall_clock_bound(5.0)) << what;
  }
  // Resuming the run from this checkpoint, in-process: the Error message, or "".
  std::string resume_error() {
    const fs::path run = dir / "run";
    fs::create_directories(run / "checkpoints");
    fs::copy_file(fs::path(run_->run_dir) / "config.json", run / "config.json",
                  fs::copy_options::overwrite_existing);
    fs::create_directory_symlink(ck, run / "checkpoints" / "step_00000002");
    TrainOptions o;
    o.run_dir = run.string();
    o.resume = true;
    o.quiet = true;
    try {
      train(Config(), o);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  }
};
TinyRun* CheckpointValidation::run_ = nullptr;

TEST_F(CheckpointValidation, TheUndamagedCheckpointLoadsEverywhere) {
  EXPECT_EQ(load_error(), "");
  const CliRun e = eval_cli();
  EXPECT_EQ(e.rc, 0) << e.err;
  EXPECT_TRUE(std::isfinite(json::parse(e.out)["loss"].get<double>())) << e.out;
  const CliRun s = sample_cli();
  EXPECT_EQ(s.rc, 0) << s.err;
}

// ---- the safetensors layout rule

TEST_F(CheckpointValidation, OverlappingTensorsAreRefused) {
  StParts p = parts();
  // Point a tensor at the bytes of an earlier one of the same size.
  const auto order = by_offset(p.header);
  std::string a, b;
  for (size_t i = 0; i < order.size() && b.empty(); ++i)
    for (size_t j = i + 1; j < order.size(); ++j)
      if (p.header[order[i]]["shape"] == p.header[order[j]]["shape"]) {
        a = order[i], b = order[j];
        break;
      }
  ASSERT_FALSE(b.empty());
  p.header[b]["data_offsets"] = p.header[a]["data_offsets"];
  write(p);
  expect_refused("overlaps", "overlap");
  expect_refused(a, "overlap names the first tensor");
  expect_refused(b, "overlap names the second tensor");
}

TEST_F(CheckpointValidation, AGapBetweenTensorsIsRefused) {
  StParts p = parts();
  const auto order = by_offset(p.header);
  const std::string& after = order[order.size() / 2];
  const uint64_t at = p.header[after]["data_offsets"][1].get<uint64_t>();
  p.data.insert(size_t(at), 4, '\0');
  for (auto it = p.header.begin(); it != p.header.end(); ++it)
    if (it.key() != "__metadata__" && it.value()["data_offsets"][0].get<uint64_t>() >= at)
      for (auto& o : it.value()["data_offsets"]) o = o.get<uint64_t>() + 4;
  write(p);
  expect_refused("belong to no tensor", "gap");
  expect_refused(after, "gap names its neighbour");
}

TEST_F(CheckpointValidation, TrailingJunkIsRefused) {
  StParts p = parts();
  p.data += "JUNKJUNK";
  write(p);
  expect_refused("8 trailing bytes belong to no tensor", "trailing junk");
}

TEST_F(CheckpointValidation, OutOfBoundsOffsetsAreRefused) {
  StParts p = parts();
  const std::string last = by_offset(p.header).back();
  for (auto& o : p.header[last]["data_offsets"]) o = o.get<uint64_t>() + 4;
  write(p);
  expect_refused("lies outside the", "out of bounds");
  expect_refused(last, "out of bounds names the tensor");
}

// The rule is the format's, not our writer's habits: data in another order, a padded
// header and no metadata still load, to the same weights.
TEST_F(CheckpointValidation, ARewriteThatKeepsTheMeaningLoadsTheSameWeights) {
  StParts p = parts();
  const auto order = by_offset(p.header);
  std::string data;
  json h = json::object();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const uint64_t b = p.header[*it]["data_offsets"][0], e = p.header[*it]["data_offsets"][1];
    h[*it] = p.header[*it];
    h[*it]["data_offsets"] = {data.size(), data.size() + (e - b)};
    data += p.data.substr(size_t(b), size_t(e - b));
  }
  write(join_safetensors(h.dump() + std::string(24, ' '), data));
  ASSERT_EQ(load_error(), "");
  auto be = make_cpu_backend();
  CheckpointInfo info = open_checkpoint(ck.string());
  Model a(info.config.model, info.config.residual, *be, 2, 16), b(info.config.model, info.config.residual, *be, 2, 16);
  load_model_weights(info, a);
  load_model_weights(open_checkpoint(run_->ckpt), b);
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_EQ(download(*be, a.parameters()[i].value), download(*be, b.parameters()[i].value))
        << a.parameters()[i].name;
}

TEST_F(CheckpointValidation, HeaderLiesAreRefusedNamingTheField) {
  const StParts orig = parts();
  const std::string norm = "model.norm.weight";  // F32 [8]
  struct Case {
    const char* what;
    std::function<std::string()> make;  // the whole file
    const char* expect;
  };
  auto with = [&](const std::function<void(json&)>& f) {
    StParts p = orig;
    f(p.header);
    return join_safetensors(p.header, p.data);
  };
  const std::vector<Case> cases = {
      {"unknown dtype", [&] { return with([&](json& h) { h[norm]["dtype"] = "F33"; }); },
       "dtype \"F33\" is not a known dtype"},
      {"another dtype, consistent sizes",
       [&] { return with([&](json& h) { h[norm]["dtype"] = "F16", h[norm]["shape"] = {16}; }); },
       "is F16; checkpoints hold F32"},
      {"negative dimension", [&] { return with([&](json& h) { h[norm]["shape"] = {-16}; }); },
       "shape[0] = -16"},
      {"overflowing shape",
       [&] { return with([&](json& h) { h[norm]["shape"] = {1ULL << 40, 1ULL << 40}; }); },
       "more elements than 2^64"},
      {"size that does not match the shape", [&] { return with([&](json& h) { h[norm]["shape"] = {7}; }); },
       "needs 28"},
      {"non-string metadata", [&] { return with([&](json& h) { h["__metadata__"]["step"] = 2; }); },
       "__metadata__.step"},
      {"unknown entry field", [&] { return with([&](json& h) { h[norm]["offsets"] = {0, 64}; }); },
       "unknown field \"offsets\""},
      {"nested shape", [&] { return with([&](json& h) { h[norm]["shape"] = {{16}}; }); }, "nesting deeper"},
      {"duplicate tensor name",
       [&] {
         std::string t = orig.header.dump();
         const std::string entry = "\"" + norm + "\":" + orig.header[norm].dump();
         t.insert(1, entry + ",");
         return join_safetensors(t, orig.data);
       },
       "duplicate key \"model.norm.weight\""},
      {"header not an object", [&] { return join_safetensors(std::string("[1]"), orig.data); },
       "does not start with '{'"},
      {"header length past the end",
       [&] {
         std::string f = join_safetensors(orig.header, orig.data);
         f[6] = 1;
         return f;
       },
       "exceeds the"},
      {"a file shorter than the length field", [&] { return std::string("abc"); }, "too short"},
  };
  for (const Case& c : cases) {
    write(c.make());
    expect_refused(c.expect, c.what);
  }
}

TEST_F(CheckpointValidation, ExtraAndMissingTensorsAreRefusedNamingTheFirst) {
  {
    StParts p = parts();
    p.header["model.extra.weight"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {p.data.size(), p.data.size() + 8}}};
    p.data += std::string(8, '\0');
    write(p);
    expect_refused("holds tensor model.extra.weight, which this model does not have", "extra tensor");
  }
  {
    link_checkpoint(run_->ckpt, ck);
    StParts p = parts();
    const std::string last = by_offset(p.header).back();
    p.data.resize(size_t(begin_of(p.header, last)));
    p.header.erase(last);
    write(p);
    expect_refused("has no tensor " + last, "missing tensor");
  }
  {  // the same in the optimizer's file
    link_checkpoint(run_->ckpt, ck);
    StParts p = parts("optimizer.rank0.safetensors");
    p.header["model.extra.exp_avg"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {p.data.size(), p.data.size() + 4}}};
    p.data += std::string(4, '\0');
    write(p, "optimizer.rank0.safetensors");
    expect_refused("holds tensor model.extra.exp_avg", "extra moment");
  }
}

// ---- the model's dtype and shape, in every command

TEST_F(CheckpointValidation, AReversedWeightShapeIsRefusedByEvalSampleAndResume) {
  StParts p = parts();
  ASSERT_EQ(p.header[kKProj]["shape"], json({4, 8}));
  p.header[kKProj]["shape"] = {8, 4};
  write(p);
  const std::string why = std::string("tensor ") + kKProj + " has shape [8, 4] but the model needs [4, 8]";
  expect_refused(why, "reversed shape");
  expect_cli_refused(eval_cli(), why, "eval");
  expect_cli_refused(sample_cli(), why, "sample");
  EXPECT_TRUE(contains(resume_error(), why));
}

TEST_F(CheckpointValidation, AnOptimizerShapeLieIsRefused) {
  StParts p = parts("optimizer.rank0.safetensors");
  const std::string name = std::string(kKProj) + ".exp_avg";
  ASSERT_EQ(p.header[name]["shape"], json({32}));
  p.header[name]["shape"] = {4, 8};  // the same bytes, another shape
  write(p, "optimizer.rank0.safetensors");
  expect_refused("tensor " + name + " has shape [4, 8] but the model needs [32]", "moment shape");
  EXPECT_TRUE(contains(resume_error(), name));
}

// ---- values

TEST_F(CheckpointValidation, NonFiniteWeightsAndMomentsAreRefusedNamingTensorAndIndex) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf}) {
    link_checkpoint(run_->ckpt, ck);
    StParts p = parts();
    put_f32(p.data, begin_of(p.header, kKProj) + 4 * 17, bad);
    write(p);
    const std::string part = std::string("tensor ") + kKProj + " holds ";
    expect_refused(part, "non-finite weight");
    expect_refused("at flat index 17", "non-finite weight index");
    expect_cli_refused(eval_cli(), "at flat index 17", "eval of non-finite weights");
    expect_cli_refused(sample_cli(), "at flat index 17", "sample of non-finite weights");
  }
  EXPECT_TRUE(contains(resume_error(), "at flat index 17"));

  link_checkpoint(run_->ckpt, ck);
  StParts o = parts("optimizer.rank0.safetensors");
  put_f32(o.data, begin_of(o.header, std::string(kKProj) + ".exp_avg") + 4 * 3, std::nanf(""));
  write(o, "optimizer.rank0.safetensors");
  expect_refused(std::string(kKProj) + ".exp_avg holds nan at flat index 3", "non-finite moment");

  link_checkpoint(run_->ckpt, ck);
  o = parts("optimizer.rank0.safetensors");
  put_f32(o.data, begin_of(o.header, std::string(kKProj) + ".exp_avg_sq") + 4 * 5, -1.0f);
  write(o, "optimizer.rank0.safetensors");
  expect_refused(std::string(kKProj) + ".exp_avg_sq holds -1 at flat index 5", "negative second moment");
}

// ---- state.json

TEST_F(CheckpointValidation, StateJsonIsCoveredByItsOwnChecksum) {
  json st = read_state(ck);
  ASSERT_TRUE(st.contains("state_fnv1a64"));
  EXPECT_EQ(load_error(), "");
  // tokens_seen changed by another tool that did not reseal: refused.
  st["trainer"]["tokens_seen"] = st["trainer"]["tokens_seen"].get<int64_t>() + 64;
  spit(ck / "state.json", st.dump(2));
  expect_refused("state.json was changed or damaged after it was written", "unsealed edit");
  st.erase("state_fnv1a64");
  spit(ck / "state.json", st.dump(2));
  expect_refused("has no state_fnv1a64", "checksum removed");
  // A format 1 checkpoint (before the checksum) is refused, saying what to do.
  st["format"] = "mhar-checkpoint-1";
  spit(ck / "state.json", st.dump(2));
  expect_refused("older checkpoint format", "format 1");
  expect_refused("with the mhar version that wrote it", "format 1 says what to do");
}

TEST_F(CheckpointValidation, WronglyTypedStateFieldsAreRefusedNamingTheField) {
  struct Case {
    const char* pointer;
    json value;
    const char* field;  // what the message must name
  };
  const std::vector<Case> cases = {
      {"/step", "2", "step = \"2\" has type string"},
      {"/step", nullptr, "step = null"},
      {"/trainer/tokens_seen", true, "trainer.tokens_seen = true"},
      {"/trainer/total_bad_steps", json::array(), "trainer.total_bad_steps = []"},
      {"/trainer/elapsed_s", "fast", "trainer.elapsed_s = \"fast\""},
      {"/trainer", 7, "trainer = 7 has type number"},
      {"/loader/epoch", "0", "loader.epoch = \"0\""},
      {"/loader/seed", -5, "loader.seed = -5"},
      {"/loader/mode", 1, "loader.mode = 1"},
      {"/loader/fingerprint", 12, "loader.fingerprint = 12"},
      {"/files/model.safetensors/bytes", "many", "files.\"model.safetensors\".bytes = \"many\""},
      {"/files/model.safetensors/fnv1a64", 3, "files.\"model.safetensors\".fnv1a64 = 3"},
      {"/files/model.safetensors", "x", "files.\"model.safetensors\" = \"x\""},
      {"/format", 2, "format = 2 has type number"},
      {"/config", "x", "config = \"x\""},
  };
  for (const Case& c : cases) {
    link_checkpoint(run_->ckpt, ck);
    edit_state([&](json& st) { st[json::json_pointer(c.pointer)] = c.value; });
    expect_refused(c.field, c.pointer);
  }
}

TEST_F(CheckpointValidation, OutOfRangeStateFieldsAreRefused) {
  struct Case {
    const char* pointer;
    json value;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"/step", 4.5, "step = 4.5 is not a whole number"},
      {"/step", -1, "step = -1 is out of range"},
      {"/step", 3, "but the directory is step_00000002"},
      {"/loader/epoch", -1, "loader.epoch = -1 is out of range"},
      {"/loader/step", 1.5, "loader.step = 1.5 is not a whole number"},
      {"/loader/B", 3, "loader.B = 3 but the checkpoint's config has train.micro_batch = 2"},
      {"/loader/seed", 6, "loader.seed = 6 but the checkpoint's config has train.seed = 5"},
      {"/loader/mode", "sequential", "loader.mode = \"sequential\""},
      {"/loader/fingerprint", "0123", "loader.fingerprint = \"0123\" is not 16 lowercase hex digits"},
      {"/trainer/tokens_seen", -5, "trainer.tokens_seen = -5 is out of range"},
      {"/trainer/total_bad_steps", 3, "trainer.total_bad_steps = 3 exceeds step = 2"},
      {"/trainer/consecutive_bad_steps", 1, "consecutive_bad_steps = 1 exceeds total_bad_steps = 0"},
      {"/trainer/elapsed_s", -0.5, "trainer.elapsed_s = -0.5 is negative"},
      // The largest double is a valid (if odd) number of seconds: accepted.
      {"/trainer/elapsed_s", std::numeric_limits<double>::max(), ""},
      {"/trainer/extra", 1, "unknown field \"extra\""},
      {"/extra", 1, "unknown field \"extra\""},
      {"/format", "mhar-checkpoint-9", "format = \"mhar-checkpoint-9\" is not mhar-checkpoint-2"},
  };
  for (const Case& c : cases) {
    link_checkpoint(run_->ckpt, ck);
    edit_state([&](json& st) { st[json::json_pointer(c.pointer)] = c.value; });
    if (std::string(c.expect).empty())
      EXPECT_EQ(load_error(), "") << c.pointer;
    else
      expect_refused(c.expect, c.pointer);
  }
  // A step past the run's end: the directory is renamed along so only that check fires.
  link_checkpoint(run_->ckpt, dir / "step_00000009");
  ck = dir / "step_00000009";
  edit_state([](json& st) { st["step"] = 9; });
  expect_refused("step = 9 is past the run's train.steps = 4", "step past the end");
}

TEST_F(CheckpointValidation, ResumingFromDamagedCountersIsRefused) {
  for (const auto& [pointer, value] : std::vector<std::pair<const char*, json>>{
           {"/step", 4.5}, {"/loader/epoch", -1}, {"/trainer/tokens_seen", -5}}) {
    link_checkpoint(run_->ckpt, ck);
    edit_state([&, p = pointer, v = value](json& st) { st[json::json_pointer(p)] = v; });
    const std::string e = resume_error();
    EXPECT_FALSE(e.empty()) << pointer << " resumed";
    fs::remove_all(dir / "run");
  }
}

TEST_F(CheckpointValidation, DeeplyNestedStateJsonIsRefusedQuickly) {
  std::string text = slurp(ck / "state.json");
  const size_t at = text.find("\"elapsed_s\":");
  ASSERT_NE(at, std::string::npos);
  const size_t value = at + std::strlen("\"elapsed_s\":");
  const size_t end = text.find_first_of(",\n}", value + 1);
  text = text.substr(0, value) + std::string(100000, '[') + std::string(100000, ']') + text.substr(end);
  spit(ck / "state.json", text);
  const auto t0 = std::chrono::steady_clock::now();
  expect_refused("nesting deeper than", "100,000 deep");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            mhar::test::wall_clock_bound(5.0));
  expect_cli_refused(eval_cli(), "nesting deeper than", "eval of a deeply nested state.json");
}

// ---- files that are not regular files

TEST_F(CheckpointValidation, FifosAndDevicesAreRefusedNotWaitedOn) {
  struct Case {
    const char* what;
    std::function<void()> make;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"FIFO as model.safetensors",
       [&] { fs::remove(ck / "model.safetensors"), make_fifo(ck / "model.safetensors"); },
       "FIFO"},
      {"symlink to /dev/zero as model.safetensors",
       [&] { fs::remove(ck / "model.safetensors"), fs::create_symlink("/dev/zero", ck / "model.safetensors"); },
       "character device"},
      {"FIFO as state.json",
       [&] { fs::remove(ck / "state.json"), make_fifo(ck / "state.json"); },
       "FIFO"},
      {"symlink to /dev/zero as state.json",
       [&] { fs::remove(ck / "state.json"), fs::create_symlink("/dev/zero", ck / "state.json"); },
       "character device"},
      {"a directory as state.json",
       [&] { fs::remove(ck / "state.json"), fs::create_directory(ck / "state.json"); }, "a directory"},
      {"/dev/zero listed in files",
       [&] { edit_state([](json& st) { st["files"]["/dev/zero"] = {{"bytes", 0}, {"fnv1a64", "cbf29ce484222325"}}; }); },
       "is not a plain file name"},
      {"a path out of the checkpoint listed in files",
       [&] { edit_state([](json& st) { st["files"]["../../x"] = {{"bytes", 0}, {"fnv1a64", "cbf29ce484222325"}}; }); },
       "is not a plain file name"},
      {"a symlink to /dev/zero listed in files",
       [&] {
         fs::create_symlink("/dev/zero", ck / "zeros");
         edit_state([](json& st) { st["files"]["zeros"] = {{"bytes", 0}, {"fnv1a64", "cbf29ce484222325"}}; });
       },
       "character device"},
      {"a FIFO listed in files",
       [&] {
         make_fifo(ck / "pipe");
         edit_state([](json& st) { st["files"]["pipe"] = {{"bytes", 0}, {"fnv1a64", "cbf29ce484222325"}}; });
       },
       "FIFO"},
  };
  for (const Case& c : cases) {
    link_checkpoint(run_->ckpt, ck);
    c.make();
    const auto t0 = std::chrono::steady_clock::now();
    expect_refused(c.expect, c.what);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              mhar::test::wall_clock_bound(5.0))
        << c.what;
    expect_cli_refused(eval_cli(), c.expect, std::string("eval: ") + c.what);
  }
  // The reader itself, whoever calls it.
  link_checkpoint(run_->ckpt, ck);
  fs::remove(ck / "model.safetensors");
  make_fifo(ck / "model.safetensors");
  EXPECT_THROW(SafetensorsFile::load((ck / "model.safetensors").string()), Error);
  EXPECT_THROW(SafetensorsFile::load("/dev/zero"), Error);
}

TEST_F(CheckpointValidation, APathThatIsNotADirectoryIsNamedAsSuch) {
  try {
    open_checkpoint((ck / "model.safetensors").string());
    FAIL() << "a file was opened as a checkpoint";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "is not a directory")) << e.what();
  }
}

// ---- a NaN loss is never a success

// Finite weights whose outputs overflow: the final norm's weight at 3e38 makes every
// logit overflow fp32, so the loss is NaN although every weight loads.
void overflowing_weights(const fs::path& ck) {
  StParts p = split_safetensors(slurp(ck / "model.safetensors"));
  const uint64_t b = begin_of(p.header, "model.norm.weight");
  for (int i = 0; i < 8; ++i) put_f32(p.data, b + 4 * i, 3e38f);
  const uint64_t e = begin_of(p.header, "model.embed_tokens.weight");
  const uint64_t n = p.header["model.embed_tokens.weight"]["data_offsets"][1].get<uint64_t>() - e;
  for (uint64_t i = 0; i < n; i += 4) put_f32(p.data, e + i, 1.0f);
  spit(ck / "model.safetensors", join_safetensors(p.header, p.data));
  reseal(ck);
}

TEST_F(CheckpointValidation, EvalOfANonFiniteLossExitsOne) {
  overflowing_weights(ck);
  ASSERT_EQ(load_error(), "");  // every weight is finite: the loss is what is not
  const CliRun r = eval_cli();
  expect_cli_refused(r, "is nan", "eval with a NaN loss");
  EXPECT_TRUE(contains(r.err, "not finite")) << r.err;
  EXPECT_EQ(r.out, "");  // no result line
}

TEST_F(CheckpointValidation, ARunEndingOnANonFiniteValidationLossFailsNamingTheStep) {
  overflowing_weights(ck);
  // Steps 3 and 4 are skipped (non-finite loss; train.max_bad_steps is 5), the run
  // reaches its end, and the final evaluation is NaN.
  const std::string e = resume_error();
  EXPECT_TRUE(contains(e, "ended at step 4 with validation loss nan")) << e;
  EXPECT_TRUE(contains(e, "evaluated at step 4")) << e;
}

TEST(SafetensorsFixtures, TheGoldenFixturesSatisfyTheLayoutRule) {
  for (const char* mode : {"standard", "attnres", "mhar"}) {
    const std::string path = std::string(MHAR_SOURCE_DIR) + "/tests/fixtures/golden/" + mode + ".safetensors";
    SafetensorsFile f = SafetensorsFile::load(path);
    EXPECT_GT(f.names().size(), 10u) << path;
    EXPECT_TRUE(f.metadata().contains("config")) << path;
  }
}

}  // namespace
