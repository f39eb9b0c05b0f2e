// checkpoint.cpp: atomic checkpoint writing, clean-up after killed writers, validation on
// open, and loading (see checkpoint.h for the layout).
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/optimizer.h"
#include "engine/run_lock.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

constexpr const char* kFormat = "mhar-checkpoint-1";

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

std::vector<float> to_f32(Backend& be, const Tensor& t) {
  std::vector<double> d(size_t(t.numel()));
  be.download(d.data(), t);
  return std::vector<float>(d.begin(), d.end());
}

std::vector<int64_t> shape_of(const Tensor& t) {
  return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim);
}

uint64_t file_fnv1a(const fs::path& p, uint64_t* size) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> buf(1 << 20);
  uint64_t h = kFnv1aOffset, total = 0;
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    h = fnv1a64(h, buf.data(), size_t(in.gcount()));
    total += uint64_t(in.gcount());
  }
  *size = total;
  return h;
}

CheckpointInfo validate_checkpoint_dir(const fs::path& dir) {
  const fs::path state_path = dir / "state.json";
  if (!fs::exists(state_path))
    fail(dir.string(), ": not a checkpoint (no state.json; an interrupted write leaves none)");
  std::ifstream in(state_path);
  nlohmann::json st = nlohmann::json::parse(in, nullptr, false);
  if (st.is_discarded() || !st.is_object()) fail(state_path.string(), ": not valid JSON (damaged checkpoint)");
  if (st.value("format", "") != kFormat)
    fail(state_path.string(), ": format ", st.value("format", std::string("<missing>")),
         " is not ", kFormat);
  if (!st.contains("files") || !st["files"].is_object() || !st["files"].contains("model.safetensors"))
    fail(state_path.string(), ": lists no model.safetensors (damaged checkpoint)");
  for (auto it = st["files"].begin(); it != st["files"].end(); ++it) {
    const fs::path f = dir / it.key();
    if (!fs::exists(f)) fail(dir.string(), ": ", it.key(), " is missing (incomplete checkpoint)");
    uint64_t size = 0;
    const uint64_t h = file_fnv1a(f, &size);
    const uint64_t want_size = it.value().value("bytes", uint64_t(0));
    if (size != want_size)
      fail(f.string(), ": ", size, " bytes but state.json records ", want_size, " (truncated or damaged)");
    if (hex64(h) != it.value().value("fnv1a64", std::string()))
      fail(f.string(), ": checksum ", hex64(h), " does not match state.json (",
           it.value().value("fnv1a64", std::string()), "): the file is damaged");
  }
  CheckpointInfo info;
  info.dir = dir.string();
  info.step = st.value("step", int64_t(-1));
  if (info.step < 0) fail(state_path.string(), ": missing step");
  info.config = config_from_json(st.at("config"), state_path.string() + " (config)");
  info.state = st;
  return info;
}

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
  if (!fs::exists(path)) fail(path, ": no such checkpoint or run directory");
  if (fs::exists(fs::path(path) / "state.json")) return validate_checkpoint_dir(path);
  auto all = list_checkpoints(path);
  if (all.empty())
    fail(path, ": holds no checkpoints (expected ", path, "/checkpoints/step_NNNNNNNN/)");
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
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    if (!f.has(p.name)) fail(f.path(), ": has no tensor ", p.name, " (checkpoint of another model?)");
    const auto& e = f.entry(p.name);
    if (e.shape != shape_of(p.value)) {
      std::string want, got;
      for (auto s : shape_of(p.value)) want += std::to_string(s) + " ";
      for (auto s : e.shape) got += std::to_string(s) + " ";
      fail(f.path(), ": tensor ", p.name, " has shape [ ", got, "] but the model needs [ ", want, "]");
    }
    auto w = f.to_f64(p.name);
    model.backend().upload(p.value, w.data());
    if (opt && opt->has_master()) model.backend().upload(opt->master(i), w.data());
  }
}

void load_optimizer_moments(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer& opt, int rank) {
  const fs::path file = fs::path(ckpt.dir) / ("optimizer.rank" + std::to_string(rank) + ".safetensors");
  if (!fs::exists(file)) fail(file.string(), ": missing (checkpoint written with fewer ranks?)");
  SafetensorsFile f = SafetensorsFile::load(file.string());
  Backend& be = model.backend();
  auto& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    for (const char* kind : {".exp_avg", ".exp_avg_sq"}) {
      const std::string name = params[i].name + kind;
      if (!f.has(name) || f.numel(name) != params[i].value.numel())
        fail(file.string(), ": tensor ", name, " missing or of the wrong size");
      auto v = f.to_f64(name);
      be.upload(std::string(kind) == ".exp_avg" ? opt.exp_avg(i) : opt.exp_avg_sq(i), v.data());
    }
  }
}

std::string save_checkpoint(const CheckpointWrite& w, Model& model, AdamWOptimizer& opt) {
  const fs::path root = fs::path(w.run_dir) / "checkpoints";
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail(root.string(), ": cannot create the checkpoints directory (", ec.message(), ")");
  const std::string name = step_dir_name(w.step);
  const fs::path tmp = root / (".tmp-" + name + "-" + std::to_string(::getpid()));
  const fs::path final_dir = root / name;
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) && ec)
    fail(tmp.string(), ": cannot create the checkpoint's temporary directory (", ec.message(), ")");
  Backend& be = model.backend();
  auto& params = model.parameters();
  nlohmann::json files = nlohmann::json::object();
  try {
    {  // fp32 master weights under Hugging Face names
      std::vector<std::string> names;
      std::vector<std::vector<int64_t>> shapes;
      std::vector<std::vector<float>> data;
      for (size_t i = 0; i < params.size(); ++i) {
        names.push_back(params[i].name);
        shapes.push_back(shape_of(params[i].value));
        data.push_back(to_f32(be, opt.weights(i)));
      }
      CheckedFile f((tmp / "model.safetensors").string());
      write_f32_tensors(f, names, shapes, data, {{"format", "mhar"}, {"step", std::to_string(w.step)}});
      f.close();
      files["model.safetensors"] = file_record(f);
    }
    {  // AdamW moments of this rank
      std::vector<std::string> names;
      std::vector<std::vector<int64_t>> shapes;
      std::vector<std::vector<float>> data;
      for (size_t i = 0; i < params.size(); ++i) {
        names.push_back(params[i].name + ".exp_avg");
        shapes.push_back({params[i].value.numel()});
        data.push_back(to_f32(be, opt.exp_avg(i)));
        names.push_back(params[i].name + ".exp_avg_sq");
        shapes.push_back({params[i].value.numel()});
        data.push_back(to_f32(be, opt.exp_avg_sq(i)));
      }
      CheckedFile f((tmp / "optimizer.rank0.safetensors").string());
      write_f32_tensors(f, names, shapes, data, {});
      f.close();
      files["optimizer.rank0.safetensors"] = file_record(f);
    }
    nlohmann::json st = {{"format", kFormat},   {"step", w.step},       {"config", w.config->to_json()},
                         {"loader", w.loader},  {"trainer", w.trainer}, {"files", files}};
    const std::string text = st.dump(2) + "\n";
    CheckedFile f((tmp / "state.json").string());
    f.write(text.data(), text.size());
    f.close();
    fsync_dir(tmp.string());
  } catch (...) {
    fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    throw;
  }
  // Publish. A same-step checkpoint (re-saved after an interrupt) is set aside as .old-,
  // the new one renamed in, and the old one removed; a kill between the two renames
  // leaves the whole old one as .old-, which the next start renames back
  // (recover_checkpoint_writes).
  if (fs::exists(final_dir)) {
    const fs::path old = root / (".old-" + name + "-" + std::to_string(::getpid()));
    rename_or_fail(final_dir, old);
    try {
      rename_or_fail(tmp, final_dir);
    } catch (const Error&) {
      fs::rename(old, final_dir, ec);
      fs::remove_all(tmp, ec);
      throw;
    }
    fs::remove_all(old, ec);
  } else {
    try {
      rename_or_fail(tmp, final_dir);
    } catch (const Error&) {
      fs::remove_all(tmp, ec);
      throw;
    }
  }
  fsync_dir(root.string());
  if (w.keep > 0) {
    auto all = list_checkpoints(w.run_dir);
    for (size_t i = 0; i + size_t(w.keep) < all.size(); ++i) {
      fs::remove_all(all[i], ec);
      if (ec) spdlog::warn("{}: could not remove this old checkpoint (checkpoint.keep = {}): {}", all[i], w.keep, ec.message());
    }
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
