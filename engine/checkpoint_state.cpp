// checkpoint_state.cpp: state.json's schema, checksum and field-by-field reading (see
// checkpoint_state.h).
#include "engine/checkpoint_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <vector>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mhar {

namespace {

constexpr uint64_t kMaxStateBytes = uint64_t(16) << 20;  // a config and a few counters

// Refuses any member of `obj` not in `known`, naming it and the valid ones.
void refuse_unknown_fields(const json& obj, const std::string& where,
                           std::initializer_list<const char*> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    if (!ok) {
      std::string valid;
      for (const char* k : known) valid += (valid.empty() ? "" : ", ") + std::string(k);
      fail(where, ": unknown field \"", it.key(), "\" (valid fields: ", valid, ")");
    }
  }
}

const json& object_member(const json& obj, const std::string& key, const std::string& where) {
  const json& v = json_member(obj, key, where);
  if (!v.is_object())
    fail(where, ": ", key, " = ", json_excerpt(v), " has type ", v.type_name(), "; expected an object");
  return v;
}

bool is_hex64(const json& v) {
  if (!v.is_string() || v.get_ref<const std::string&>().size() != 16) return false;
  for (char c : v.get_ref<const std::string&>())
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// The step a directory named step_NNNNNNNN stands for, or -1 for any other name (a
// checkpoint copied elsewhere under another name is still a checkpoint).
int64_t step_of_dir_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// A name of `files` must stay inside the checkpoint directory.
void check_plain_file_name(const std::string& name, const std::string& where) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255 ||
      name.find('/') != std::string::npos || name.find('\0') != std::string::npos)
    fail(where, ": ", json_excerpt(json(name)), " is not a plain file name (files lists the "
         "checkpoint's own files by name: no \"/\", no \"..\", at most 255 bytes)");
}

// Checks that dir/name is a regular file of `want_bytes` bytes whose FNV-1a 64 is
// `want_hash`. The file is opened non-blocking and checked with fstat before any read,
// so a FIFO or a device (a symlink to /dev/zero) is refused at once, never read.
void verify_listed_file(const fs::path& dir, const std::string& name, uint64_t want_bytes,
                        const std::string& want_hash) {
  const std::string path = (dir / name).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) fail(dir.string(), ": ", name, " is missing (incomplete checkpoint)");
    fail(path, ": cannot open checkpoint file (", std::strerror(e), ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    require_regular_file(path, "checkpoint file");  // names what it is instead
    fail(path, ": is not a regular file, but a checkpoint file must be one");
  }
  if (uint64_t(st.st_size) != want_bytes) {
    ::close(fd);
    fail(path, ": ", uint64_t(st.st_size), " bytes but state.json records ", want_bytes,
         " (truncated or damaged)");
  }
  std::vector<char> buf(size_t(1) << 20);
  uint64_t h = kFnv1aOffset, total = 0;
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int e = errno;
      ::close(fd);
      fail(path, ": read failed (", std::strerror(e), ")");
    }
    if (r == 0) break;
    h = fnv1a64(h, buf.data(), size_t(r));
    total += uint64_t(r);
    if (total > want_bytes) break;  // grew while being read: the size check below says so
  }
  ::close(fd);
  if (total != want_bytes)
    fail(path, ": read ", total, " bytes but state.json records ", want_bytes,
         " (the file changed while being read)");
  if (hex64(h) != want_hash)
    fail(path, ": checksum ", hex64(h), " does not match state.json (", want_hash,
         "): the file is damaged");
}

}  // namespace

std::string state_checksum(const json& state) {
  json copy = state;
  if (copy.is_object()) copy.erase(kStateChecksumField);
  const std::string text = copy.dump();
  return hex64(fnv1a64(kFnv1aOffset, text.data(), text.size()));
}

CheckpointInfo read_checkpoint_dir(const std::string& dir_arg) {
  const fs::path dir(dir_arg);
  const std::string state_path = (dir / "state.json").string();
  json st = read_json_file(state_path, "checkpoint state file (state.json)", JsonLimits{}, kMaxStateBytes);
  if (!st.is_object()) fail(state_path, ": is ", st.type_name(), ", not a JSON object (damaged checkpoint)");

  // The format first, so that an older checkpoint is named as such, not as damaged.
  // Format 1 (no state_fnv1a64) is refused rather than read with a warning: a checksum
  // that may be absent protects nothing (dropping the field would bypass it), and the
  // project is young enough (0.x, no checkpoints in the wild to keep) that the message
  // below costs a retrain at most.
  const std::string format = json_to_string(json_member(st, "format", state_path), state_path + ": format");
  if (format == "mhar-checkpoint-1")
    fail(state_path, ": format mhar-checkpoint-1 is an older checkpoint format, written before "
         "state.json carried its own checksum (", kStateChecksumField, "). This mhar reads ",
         kCheckpointFormat, " only, because without that checksum a damaged state.json cannot be "
         "told from a good one. Evaluate or resume it with the mhar version that wrote it, or "
         "train the run again.");
  if (format != kCheckpointFormat)
    fail(state_path, ": format = \"", format, "\" is not ", kCheckpointFormat,
         " (not an mhar checkpoint, or one from another version)");
  if (!st.contains(kStateChecksumField))
    fail(state_path, ": has no ", kStateChecksumField, " (its own checksum, which every ",
         kCheckpointFormat, " state.json has): edited by another tool or damaged");
  const json& recorded = st[kStateChecksumField];
  if (!is_hex64(recorded))
    fail(state_path, ": ", kStateChecksumField, " = ", json_excerpt(recorded),
         " is not 16 lowercase hex digits");
  const std::string actual = state_checksum(st);
  if (actual != recorded.get<std::string>())
    fail(state_path, ": checksum ", actual, " does not match its recorded ", kStateChecksumField,
         " ", recorded.get<std::string>(), ": state.json was changed or damaged after it was written");
  refuse_unknown_fields(st, state_path, {"format", "step", "world_size", "config", "loader", "trainer",
                                         "files", kStateChecksumField});

  CheckpointInfo info;
  info.dir = dir.string();
  info.step = json_to_int(json_member(st, "step", state_path), state_path + ": step", 0, INT64_MAX);
  info.config = config_from_json(object_member(st, "config", state_path), state_path + " (config)");
  const auto& tc = info.config.train;
  if (info.step > int64_t(tc.steps))
    fail(state_path, ": step = ", info.step, " is past the run's train.steps = ", tc.steps,
         " (a run stops there; valid: 0 to ", tc.steps, ")");
  {
    const std::string name = dir.filename().empty() ? dir.parent_path().filename().string()
                                                    : dir.filename().string();
    const int64_t named = step_of_dir_name(name);
    if (named >= 0 && named != info.step)
      fail(state_path, ": step = ", info.step, " but the directory is ", name,
           " (a checkpoint's directory is named after its step)");
  }

  {  // the trainer's counters
    const std::string where = state_path + ": trainer";
    const json& t = object_member(st, "trainer", state_path);
    refuse_unknown_fields(t, where, {"tokens_seen", "total_bad_steps", "consecutive_bad_steps", "elapsed_s"});
    CheckpointTrainerState& c = info.trainer;
    c.tokens_seen = json_to_int(json_member(t, "tokens_seen", where), where + ".tokens_seen", 0, INT64_MAX);
    c.total_bad_steps =
        json_to_int(json_member(t, "total_bad_steps", where), where + ".total_bad_steps", 0, INT64_MAX);
    if (c.total_bad_steps > info.step)
      fail(where, ".total_bad_steps = ", c.total_bad_steps, " exceeds step = ", info.step,
           " (a skipped step is one of the steps run)");
    c.consecutive_bad_steps = json_to_int(json_member(t, "consecutive_bad_steps", where),
                                          where + ".consecutive_bad_steps", 0, INT64_MAX);
    if (c.consecutive_bad_steps > c.total_bad_steps)
      fail(where, ".consecutive_bad_steps = ", c.consecutive_bad_steps, " exceeds total_bad_steps = ",
           c.total_bad_steps, " (the current streak is part of the total)");
    if (c.consecutive_bad_steps > int64_t(tc.max_bad_steps))
      fail(where, ".consecutive_bad_steps = ", c.consecutive_bad_steps,
           " exceeds the config's train.max_bad_steps = ", tc.max_bad_steps,
           " (a run stops, without a checkpoint, once a streak is longer)");
    c.elapsed_s = json_to_finite(json_member(t, "elapsed_s", where), where + ".elapsed_s");
    if (c.elapsed_s < 0)
      fail(where, ".elapsed_s = ", json_excerpt(t["elapsed_s"]), " is negative; valid: >= 0 seconds");
  }

  // The ranks that wrote it (data parallelism, DESIGN.md section 7; absent: one process).
  info.world_size = 1;
  if (st.contains("world_size"))
    info.world_size = int(json_to_int(st["world_size"], state_path + ": world_size", 1, 1 << 20));
  {  // the data position: typed and ranged here, matched against the shards by the loader
    const std::string where = state_path + ": loader";
    const json& l = object_member(st, "loader", state_path);
    // An empty loader object is "no data position": a step-0 checkpoint written by
    // `mhar import` without data (eval, sample and train --init-from need none).
    if (l.empty() && info.step != 0)
      fail(where, " is empty, but only a step-0 checkpoint (an import) may lack a data position");
  }
  if (!st.at("loader").empty()) {
    const std::string where = state_path + ": loader";
    const json& l = st.at("loader");
    refuse_unknown_fields(l, where, {"mode", "epoch", "step", "seed", "B", "T", "world_size", "shards",
                                     "tokens", "fingerprint"});
    const std::string mode = json_to_string(json_member(l, "mode", where), where + ".mode");
    if (mode != "shuffled")
      fail(where, ".mode = \"", mode, "\" is not \"shuffled\" (the training loader's mode)");
    const uint64_t epoch = json_to_uint(json_member(l, "epoch", where), where + ".epoch", 0, INT64_MAX);
    const uint64_t lstep = json_to_uint(json_member(l, "step", where), where + ".step", 0, INT64_MAX);
    const uint64_t seed = json_to_uint(json_member(l, "seed", where), where + ".seed", 0, UINT64_MAX);
    if (seed != uint64_t(tc.seed))
      fail(where, ".seed = ", seed, " but the checkpoint's config has train.seed = ", tc.seed);
    const int64_t B = json_to_int(json_member(l, "B", where), where + ".B", 1, INT32_MAX);
    if (B != int64_t(tc.micro_batch))
      fail(where, ".B = ", B, " but the checkpoint's config has train.micro_batch = ", tc.micro_batch);
    const int64_t T = json_to_int(json_member(l, "T", where), where + ".T", 1, INT32_MAX);
    if (T != int64_t(tc.seq_len))
      fail(where, ".T = ", T, " but the checkpoint's config has train.seq_len = ", tc.seq_len);
    const int64_t world = json_to_int(json_member(l, "world_size", where), where + ".world_size", 1, 1 << 20);
    // The loader's position counts steps of world_size x B windows: the ranks that wrote
    // the checkpoint wrote it.
    if (world != info.world_size)
      fail(where, ".world_size = ", world, " but the checkpoint's world_size = ", info.world_size,
           " (the data position is written by the ranks that write the checkpoint)");
    const uint64_t shards = json_to_uint(json_member(l, "shards", where), where + ".shards", 1, UINT32_MAX);
    const uint64_t tokens = json_to_uint(json_member(l, "tokens", where), where + ".tokens", 1, INT64_MAX);
    const json& fp = json_member(l, "fingerprint", where);
    if (!is_hex64(fp))
      fail(where, ".fingerprint = ", json_excerpt(fp), " is not 16 lowercase hex digits");
    info.loader = {{"mode", mode},   {"epoch", epoch},      {"step", lstep},
                   {"seed", seed},   {"B", B},              {"T", T},
                   {"world_size", world}, {"shards", shards}, {"tokens", tokens},
                   {"fingerprint", fp}};
  }

  {  // the files, each verified
    const std::string where = state_path + ": files";
    const json& files = object_member(st, "files", state_path);
    if (!files.contains("model.safetensors"))
      fail(where, ": lists no model.safetensors (damaged checkpoint)");
    // One optimizer shard per rank that wrote it, no more.
    for (int r = 0; r < info.world_size; ++r)
      if (!files.contains("optimizer.rank" + std::to_string(r) + ".safetensors"))
        fail(where, ": lists no optimizer.rank", r, ".safetensors, but world_size = ", info.world_size,
             " ranks wrote this checkpoint (damaged checkpoint)");
    for (auto it = files.begin(); it != files.end(); ++it) {
      long long r = -1;
      char tail = 0;
      if (std::sscanf(it.key().c_str(), "optimizer.rank%lld.safetensor%c", &r, &tail) == 2 &&
          (r < 0 || r >= info.world_size))
        fail(where, ": lists ", it.key(), ", but world_size = ", info.world_size,
             " (valid: optimizer.rank0 to optimizer.rank", info.world_size - 1, ")");
    }
    for (auto it = files.begin(); it != files.end(); ++it) {
      check_plain_file_name(it.key(), where);
      const std::string fw = where + ".\"" + it.key() + "\"";
      if (!it.value().is_object())
        fail(fw, " = ", json_excerpt(it.value()), " is not an object {\"bytes\", \"fnv1a64\"}");
      refuse_unknown_fields(it.value(), fw, {"bytes", "fnv1a64"});
      const uint64_t bytes = json_to_uint(json_member(it.value(), "bytes", fw), fw + ".bytes", 0, INT64_MAX);
      const json& h = json_member(it.value(), "fnv1a64", fw);
      if (!is_hex64(h)) fail(fw, ".fnv1a64 = ", json_excerpt(h), " is not 16 lowercase hex digits");
      verify_listed_file(dir, it.key(), bytes, h.get<std::string>());
    }
  }
  info.state = std::move(st);
  return info;
}

}  // namespace mhar
