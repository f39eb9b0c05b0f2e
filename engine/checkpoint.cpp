// checkpoint.cpp: atomic checkpoint writing, clean-up after killed writers, validation on
// open, and loading (see checkpoint.h for the layout).
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "engine/checkpoint_shards.h"
#include "engine/checkpoint_state.h"
#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"
#include "engine/optimizer.h"
#include "engine/run_lock.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {


// The record state.json keeps of a written file.
nlohmann::json file_record(const CheckedFile& f) {
  return {{"bytes", f.bytes()}, {"fnv1a64", hex64(f.hash())}};
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    fail(to.string(), ": cannot rename ", from.string(), " into place (", std::strerror(errno), ")");
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// Writes `tensors` (host float vectors) as an F32 safetensors file into `file`.
void write_f32_tensors(CheckedFile& file, const std::vector<std::string>& names,
                       const std::vector<std::vector<int64_t>>& shapes,
                       const std::vector<std::vector<float>>& data,
                       const std::map<std::string, std::string>& meta) {
  std::vector<TensorToWrite> t;
  for (size_t i = 0; i < names.size(); ++i) t.push_back({names[i], "F32", shapes[i], data[i].data()});
  write_safetensors_to([&](const void* p, size_t n) { file.write(p, n); }, t, meta);
}

std::vector<int64_t> shape_of(const Tensor& t) {
  return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim);
}

// The first non-finite value of `v` (an index), or -1.
int64_t first_nonfinite(const std::vector<double>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) return int64_t(i);
  return -1;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A checkpoint tensor must be F32 of exactly `want` shape with finite values (and, for
// second moments, non-negative ones: AdamW takes their square root).
void check_tensor(const SafetensorsFile& f, const std::string& name, const std::vector<int64_t>& want,
                  bool non_negative) {
  if (!f.has(name)) fail(f.path(), ": has no tensor ", name, " (checkpoint of another model?)");
  const auto& e = f.entry(name);
  if (e.dtype != "F32")
    fail(f.path(), ": tensor ", name, " is ", e.dtype, "; checkpoints hold F32 tensors");
  if (e.shape != want)
    fail(f.path(), ": tensor ", name, " has shape ", shape_text(e.shape), " but the model needs ",
         shape_text(want), " (checkpoint of another model, or a damaged header)");
  const std::vector<double> v = f.to_f64(name);
  const int64_t bad = first_nonfinite(v);
  if (bad >= 0)
    fail(f.path(), ": tensor ", name, " holds ",
         std::isnan(v[size_t(bad)]) ? "nan" : v[size_t(bad)] > 0 ? "inf" : "-inf", " at flat index ", bad,
         " (the first non-finite value): a checkpoint must hold finite values; use an earlier "
         "checkpoint of this run");
  if (non_negative)
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] < 0)
        fail(f.path(), ": tensor ", name, " holds ", v[i], " at flat index ", i,
             ": a second moment (exp_avg_sq) is never negative");
}

// Refuses a tensor of `f` that is not in `expected`, naming the first one.
void refuse_extra_tensors(const SafetensorsFile& f, const std::set<std::string>& expected) {
  for (const auto& name : f.names())
    if (!expected.count(name))
      fail(f.path(), ": holds tensor ", name, ", which this model does not have (", f.names().size(),
           " tensors in the file, ", expected.size(), " expected): checkpoint of another model?");
}

CheckpointInfo validate_checkpoint_dir(const fs::path& dir) { return read_checkpoint_dir(dir.string()); }

}  // namespace

std::vector<std::string> list_checkpoints(const std::string& run_dir) {
  std::vector<std::pair<long long, std::string>> found;
  const fs::path root = fs::path(run_dir) / "checkpoints";
  if (!fs::is_directory(root)) return {};
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    long long step = 0;
    char tail = 0;
    if (e.is_directory() && std::sscanf(name.c_str(), "step_%lld%c", &step, &tail) == 1)
      found.push_back({step, e.path().string()});
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

CheckpointInfo open_checkpoint(const std::string& path, bool newest_valid) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status))
    fail(path, ": no such checkpoint or run directory", ec && ec != std::errc::no_such_file_or_directory
                                                            ? " (" + ec.message() + ")" : std::string());
  if (!fs::is_directory(status))
    fail(path, ": is not a directory; give a checkpoint directory (RUN_DIR/checkpoints/step_NNNNNNNN) "
         "or a run directory (then its newest checkpoint)");
  // A directory with a state.json entry (of whatever kind: the reader refuses a FIFO or a
  // directory there with a message) is a checkpoint; any other is a run directory.
  if (fs::exists(fs::symlink_status(fs::path(path) / "state.json", ec))) return validate_checkpoint_dir(path);
  std::vector<std::string> all;
  try {
    all = list_checkpoints(path);
  } catch (const fs::filesystem_error& e) {
    fail(path, ": cannot list its checkpoints (", e.code().message(), ")");
  }
  if (all.empty() && (fs::exists(fs::path(path) / "model.safetensors", ec) ||
                      fs::path(path).filename().string().rfind("step_", 0) == 0))
    fail(path, ": not a checkpoint (no state.json; an interrupted write leaves none)");
  if (all.empty())
    fail(path, ": holds no checkpoints (expected ", path, "/checkpoints/step_NNNNNNNN/, or a "
         "checkpoint directory with a state.json)");
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      return validate_checkpoint_dir(*it);
    } catch (const Error& e) {
      if (!newest_valid)
        fail(e.what(), "\n  (the newest checkpoint is refused; pass --resume-latest-valid to fall back to an older valid one)");
      spdlog::warn("skipping invalid checkpoint: {}", e.what());
    }
  }
  fail(path, ": none of its ", all.size(), " checkpoints is valid");
}

void check_same_model(const Config& ours, const Config& theirs, const std::string& where) {
  const nlohmann::json a = ours.to_json(), b = theirs.to_json();
  for (const char* section : {"model", "residual"})
    for (auto it = a[section].begin(); it != a[section].end(); ++it)
      if (b[section].value(it.key(), nlohmann::json()) != it.value())
        fail(where, " was made with ", section, ".", it.key(), " = ", b[section][it.key()].dump(),
             " but this run has ", section, ".", it.key(), " = ", it.value().dump(),
             ": it belongs to a different model");
}

void load_model_weights(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer* opt) {
  SafetensorsFile f = SafetensorsFile::load((fs::path(ckpt.dir) / "model.safetensors").string());
  auto& params = model.parameters();
  std::set<std::string> expected;
  for (const Parameter& p : params) expected.insert(p.name);
  refuse_extra_tensors(f, expected);
  // Every tensor is checked before any is uploaded, so a refused file leaves the model as
  // it was; values are converted per tensor (twice) to keep the peak memory at one tensor.
  for (const Parameter& p : params) check_tensor(f, p.name, shape_of(p.value), false);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<double> w = f.to_f64(params[i].name);
    model.backend().upload(params[i].value, w.data());
    if (opt && opt->has_master())  // this rank's shard of the master copy
      for (const ShardSegment& s : opt->segments())
        if (size_t(s.param) == i) model.backend().upload(opt->weights(s), w.data() + s.begin);
  }
}

int checkpoint_world_size(const CheckpointInfo& ckpt) { return ckpt.world_size; }

void load_optimizer_moments(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer& opt) {
  const int ckpt_world = checkpoint_world_size(ckpt);
  Backend& be = model.backend();
  const auto& params = model.parameters();
  // The same world size: this rank's own file holds exactly its shard. Another: every
  // file is read, and each element of this rank's shard taken from the one that holds it.
  std::vector<int> ranks;
  if (ckpt_world == opt.world_size()) ranks.push_back(opt.rank());
  else for (int r = 0; r < ckpt_world; ++r) ranks.push_back(r);
  if (ckpt_world != opt.world_size() && opt.rank() == 0)
    spdlog::info("re-sharding the optimizer state: the checkpoint was written by {} rank(s), this run has {}",
                 ckpt_world, opt.world_size());
  std::map<std::string, int> param_index;
  for (size_t i = 0; i < params.size(); ++i) param_index[params[i].name] = int(i);
  const auto& segs = opt.segments();
  std::vector<std::vector<double>> m(segs.size()), v(segs.size());
  std::vector<int64_t> covered(segs.size(), 0);
  for (size_t k = 0; k < segs.size(); ++k) {
    m[k].assign(size_t(segs[k].count), 0.0);
    v[k].assign(size_t(segs[k].count), 0.0);
  }
  for (int r : ranks) {
    const std::string name = optimizer_shard_file(r);
    // Only files listed in state.json had their size and checksum verified on open.
    const auto files = ckpt.state.find("files");
    if (files == ckpt.state.end() || !files->is_object() || !files->contains(name))
      fail(ckpt.dir, ": state.json lists no ", name, " (it records ", ckpt_world,
           " rank(s); damaged checkpoint)");
    const SafetensorsFile f = SafetensorsFile::load((fs::path(ckpt.dir) / name).string());
    const nlohmann::json& meta = f.metadata();
    // Which elements of which parameter this file holds: "range.<name>" = "<first>
    // <count>" (a file without it, written by one process, holds whole parameters).
    std::map<int, std::pair<int64_t, int64_t>> held;
    std::set<std::string> expected;
    for (const auto& tensor : f.names()) {
      const bool sq = tensor.size() > 11 && tensor.compare(tensor.size() - 11, 11, ".exp_avg_sq") == 0;
      const bool avg = !sq && tensor.size() > 8 && tensor.compare(tensor.size() - 8, 8, ".exp_avg") == 0;
      const std::string pname = tensor.substr(0, tensor.size() - (sq ? 11 : avg ? 8 : 0));
      const auto it = param_index.find(pname);
      if ((!sq && !avg) || it == param_index.end())
        fail(f.path(), ": holds tensor ", tensor, ", which is not an AdamW moment of this model's "
             "parameters (checkpoint of another model?)");
      const Parameter& p = params[size_t(it->second)];
      int64_t first = 0, count = p.value.numel();
      const std::string key = "range." + pname;
      if (meta.is_object() && meta.contains(key)) {
        long long a0 = -1, n0 = -1;
        char tail = 0;
        const bool ok = meta[key].is_string() &&
                        std::sscanf(meta[key].get<std::string>().c_str(), "%lld %lld%c", &a0, &n0, &tail) == 2 &&
                        a0 >= 0 && n0 > 0 && a0 <= count && n0 <= count - a0;
        if (!ok)
          fail(f.path(), ": metadata ", key, " = ", json_excerpt(meta[key]), " is not \"<first> <count>\" "
               "within the parameter's ", p.value.numel(), " elements");
        first = a0;
        count = n0;
      }
      held[it->second] = {first, count};
      expected.insert(pname + ".exp_avg");
      expected.insert(pname + ".exp_avg_sq");
    }
    refuse_extra_tensors(f, expected);
    for (const auto& [i, range] : held) {
      const Parameter& p = params[size_t(i)];
      check_tensor(f, p.name + ".exp_avg", {range.second}, false);
      check_tensor(f, p.name + ".exp_avg_sq", {range.second}, true);
    }
    for (size_t k = 0; k < segs.size(); ++k) {
      const ShardSegment& s = segs[k];
      const auto h = held.find(s.param);
      if (h == held.end()) continue;
      const int64_t first = h->second.first, count = h->second.second;
      const int64_t a0 = std::max(first, s.begin), e0 = std::min(first + count, s.begin + s.count);
      if (a0 >= e0) continue;
      const std::string& pname = params[size_t(s.param)].name;
      const std::vector<double> fm = f.to_f64(pname + ".exp_avg"), fv = f.to_f64(pname + ".exp_avg_sq");
      std::copy(fm.begin() + (a0 - first), fm.begin() + (e0 - first), m[k].begin() + (a0 - s.begin));
      std::copy(fv.begin() + (a0 - first), fv.begin() + (e0 - first), v[k].begin() + (a0 - s.begin));
      covered[k] += e0 - a0;
    }
  }
  // Every element of the shard exactly once, then uploaded (a refused checkpoint leaves
  // the optimizer as it was).
  for (size_t k = 0; k < segs.size(); ++k)
    if (covered[k] != segs[k].count)
      fail(ckpt.dir, ": the optimizer files hold ", covered[k], " of the ", segs[k].count, " elements [",
           segs[k].begin, ", ", segs[k].begin + segs[k].count, ") of ", params[size_t(segs[k].param)].name,
           " that rank ", opt.rank(), " of ", opt.world_size(), " needs (ranges missing or overlapping: "
           "damaged checkpoint)");
  for (size_t k = 0; k < segs.size(); ++k) {
    be.upload(opt.exp_avg(segs[k]), m[k].data());
    be.upload(opt.exp_avg_sq(segs[k]), v[k].data());
  }
}

std::string save_checkpoint(const CheckpointWrite& w, Model& model, AdamWOptimizer& opt) {
  std::unique_ptr<Communicator> single;
  Communicator* comm = w.comm;
  if (!comm) {
    single = make_single_communicator();
    comm = single.get();
  }
  const bool is_root = comm->rank() == 0;
  const fs::path root = fs::path(w.run_dir) / "checkpoints";
  const std::string name = step_dir_name(w.step);
  const fs::path final_dir = root / name;
  std::error_code ec;
  // The fp32 weights come from every rank's shard (collective, before any file).
  const std::vector<std::vector<float>> weights = gather_fp32_weights(model, opt, *comm);
  // Rank 0 makes the temporary directory (named with its pid, the pattern
  // recover_checkpoint_writes knows); its name reaches the others with the go-ahead.
  std::string tmp_name;
  if (is_root) {
    const fs::path tmp = root / (".tmp-" + name + "-" + std::to_string(::getpid()));
    fs::create_directories(root, ec);
    if (ec) {
      tmp_name = "!" + root.string() + ": cannot create the checkpoints directory (" + ec.message() + ")";
    } else {
      fs::remove_all(tmp, ec);
      if (!fs::create_directory(tmp, ec) && ec)
        tmp_name = "!" + tmp.string() + ": cannot create the checkpoint's temporary directory (" +
                   ec.message() + ")";
      else
        tmp_name = tmp.string();
    }
  }
  tmp_name = comm->broadcast_string(tmp_name);
  if (!tmp_name.empty() && tmp_name[0] == '!') fail(tmp_name.substr(1));
  const fs::path tmp = tmp_name;
  // Every rank writes its optimizer shard and reports {"file": record} or {"error": msg}.
  nlohmann::json report;
  try {
    report = {{"file", write_optimizer_shard(tmp.string(), model, opt)}};
  } catch (const std::exception& e) {
    report = {{"error", e.what()}};
  }
  const std::vector<std::string> reports = comm->gather_strings(report.dump());
  std::string outcome;  // rank 0: empty when published, else the error
  if (is_root) {
    auto& params = model.parameters();
    nlohmann::json files = nlohmann::json::object();
    try {
      for (int r = 0; r < comm->world_size(); ++r) {
        const nlohmann::json rep = nlohmann::json::parse(reports[size_t(r)]);
        if (rep.contains("error"))
          fail(comm->world_size() > 1 ? "rank " + std::to_string(r) + ": " : std::string(),
               rep["error"].get<std::string>());
        files[optimizer_shard_file(r)] = rep["file"];
      }
      {  // fp32 master weights under Hugging Face names
        std::vector<std::string> names;
        std::vector<std::vector<int64_t>> shapes;
        for (size_t i = 0; i < params.size(); ++i) {
          names.push_back(params[i].name);
          shapes.push_back(shape_of(params[i].value));
        }
        CheckedFile f((tmp / "model.safetensors").string());
        write_f32_tensors(f, names, shapes, weights, {{"format", "mhar"}, {"step", std::to_string(w.step)}});
        f.close();
        files["model.safetensors"] = file_record(f);
      }
      // state.json last: it lists every rank's file, so the checkpoint is whole only once
      // all of them are in.
      nlohmann::json st = {{"format", kCheckpointFormat}, {"step", w.step},
                           {"world_size", comm->world_size()},
                           {"config", w.config->to_json()},
                           {"loader", w.loader},  {"trainer", w.trainer}, {"files", files}};
      st[kStateChecksumField] = state_checksum(st);  // state.json's own (engine/checkpoint_state.h)
      const std::string text = st.dump(2) + "\n";
      CheckedFile f((tmp / "state.json").string());
      f.write(text.data(), text.size());
      f.close();
      fsync_dir(tmp.string());
    } catch (const std::exception& e) {
      outcome = e.what();
      if (outcome.empty()) outcome = "unknown error";
      fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    }
    if (outcome.empty()) {
      // Publish. A same-step checkpoint (re-saved after an interrupt) is set aside as
      // .old-, the new one renamed in, and the old one removed; a kill between the two
      // renames leaves the whole old one as .old-, which the next start renames back
      // (recover_checkpoint_writes).
      try {
        if (fs::exists(final_dir)) {
          const fs::path old = root / (".old-" + name + "-" + std::to_string(::getpid()));
          rename_or_fail(final_dir, old);
          try {
            rename_or_fail(tmp, final_dir);
          } catch (const Error&) {
            fs::rename(old, final_dir, ec);
            throw;
          }
          fs::remove_all(old, ec);
        } else {
          rename_or_fail(tmp, final_dir);
        }
        fsync_dir(root.string());
      } catch (const std::exception& e) {
        outcome = e.what();
        fs::remove_all(tmp, ec);
      }
    }
    if (outcome.empty() && w.keep > 0) {
      auto all = list_checkpoints(w.run_dir);
      for (size_t i = 0; i + size_t(w.keep) < all.size(); ++i) {
        fs::remove_all(all[i], ec);
        if (ec) spdlog::warn("{}: could not remove this old checkpoint (checkpoint.keep = {}): {}", all[i], w.keep, ec.message());
      }
    }
  }
  outcome = comm->broadcast_string(outcome);
  if (!outcome.empty()) {
    if (is_root) fail(outcome);
    fail("checkpoint of step ", w.step, " failed on rank 0: ", outcome);
  }
  return final_dir.string();
}

void recover_checkpoint_writes(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<fs::path> leftovers;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) leftovers.push_back(it->path());
  if (ec) fail(root.string(), ": cannot list (", ec.message(), ")");
  std::sort(leftovers.begin(), leftovers.end());
  for (const fs::path& p : leftovers) {
    // .tmp-step_NNNNNNNN-PID or .old-step_NNNNNNNN-PID, nothing else.
    const std::string file = p.filename().string();
    long long step = 0, pid = 0;
    char kind[4] = {0}, tail = 0;
    if (std::sscanf(file.c_str(), ".%3[a-z]-step_%lld-%lld%c", kind, &step, &pid, &tail) != 3) continue;
    const std::string k = kind;
    if (k != "tmp" && k != "old") continue;
    if (!fs::is_directory(fs::symlink_status(p, ec))) continue;
    // The run lock proves that no trainer is writing this run's checkpoints now, so the
    // writer of this directory is gone whatever process its pid names today (pids are
    // reused: in a container the trainer often gets the same pid every time).
    const std::string whose =
        "of pid " + std::to_string(pid) +
        (pid == ::getpid() ? ", an earlier process with this process's pid"
         : process_alive(pid) ? ", a running process that does not hold this run's lock (a reused pid)"
                              : ", which is no longer running");
    const fs::path step_dir = root / step_dir_name(step);
    if (k == "old" && !fs::exists(fs::symlink_status(step_dir, ec))) {
      // Set aside while step `step` was re-saved, and the replacement never arrived: it is
      // the only whole copy of that step.
      fs::rename(p, step_dir, ec);
      if (ec) fail(p.string(), ": cannot rename it back to ", step_dir.string(), " (", ec.message(), ")");
      spdlog::warn("{}: put back as {} (a checkpoint set aside by an interrupted re-save {})", p.string(),
                   step_dir.string(), whose);
      continue;
    }
    fs::remove_all(p, ec);
    if (ec) fail(p.string(), ": cannot remove this leftover of an interrupted checkpoint write (", ec.message(), ")");
    spdlog::warn("removed {} ({} checkpoint write {})", p.string(),
                 k == "tmp" ? "the partial output of an interrupted" : "the replaced copy left by an interrupted",
                 whose);
  }
  fsync_dir(root.string());
}

}  // namespace mhar
