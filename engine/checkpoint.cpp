// checkpoint.cpp: atomic checkpoint writing, validation on open, and loading (see
// checkpoint.h for the layout).
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

#include "engine/checkpoint_shards.h"
#include "engine/error.h"
#include "engine/optimizer.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

constexpr const char* kFormat = "mhar-checkpoint-1";
constexpr uint64_t kFnvOffset = 1469598103934665603ULL, kFnvPrime = 1099511628211ULL;

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Bytes written into the checkpoint being saved, for the simulated full disk: with
// MHAR_SIMULATE_DISK_FULL_AFTER_BYTES=N every checkpoint write fails with ENOSPC after N
// bytes. Tests use it to prove that a failed write leaves earlier checkpoints intact.
uint64_t g_checkpoint_bytes_written = 0;

// A file written through write(2) with every byte counted, hashed and checked; fsync'd
// on close so the rename that publishes the checkpoint happens after the data is durable.
class CheckedFile {
 public:
  explicit CheckedFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd_ < 0) fail(path, ": cannot create (", std::strerror(errno), ")");
  }
  ~CheckedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, size_t n) {
    const char* limit_env = std::getenv("MHAR_SIMULATE_DISK_FULL_AFTER_BYTES");
    const auto* p = static_cast<const char*>(data);
    hash_ = fnv1a(hash_, data, n);
    while (n) {
      size_t chunk = std::min<size_t>(n, 1 << 24);
      if (limit_env && g_checkpoint_bytes_written + chunk > std::strtoull(limit_env, nullptr, 10))
        fail(path_, ": write failed (No space left on device) [simulated by MHAR_SIMULATE_DISK_FULL_AFTER_BYTES]");
      ssize_t w = ::write(fd_, p, chunk);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(path_, ": write failed (", std::strerror(errno), ")");
      }
      p += w;
      n -= size_t(w);
      bytes_ += uint64_t(w);
      g_checkpoint_bytes_written += uint64_t(w);
    }
  }
  void close() {
    if (::fsync(fd_) != 0) fail(path_, ": fsync failed (", std::strerror(errno), ")");
    if (::close(fd_) != 0) fail(path_, ": close failed (", std::strerror(errno), ")");
    fd_ = -1;
  }
  nlohmann::json record() const { return {{"bytes", bytes_}, {"fnv1a64", hex64(hash_)}}; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t bytes_ = 0, hash_ = kFnvOffset;
};

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
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

uint64_t file_fnv1a(const fs::path& p, uint64_t* size) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> buf(1 << 20);
  uint64_t h = kFnvOffset, total = 0;
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    h = fnv1a(h, buf.data(), size_t(in.gcount()));
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
    if (opt && opt->has_master())
      for (const ShardSegment& s : opt->segments())
        if (size_t(s.param) == i) model.backend().upload(opt->weights(s), w.data() + s.begin);
  }
}

int checkpoint_world_size(const CheckpointInfo& ckpt) {
  const auto it = ckpt.state.find("world_size");
  if (it == ckpt.state.end()) return 1;  // written before data parallelism
  if (!it->is_number_integer() || it->get<long long>() < 1 || it->get<long long>() > 1000000)
    fail(ckpt.dir, "/state.json: world_size = ", it->dump(), " is not a positive rank count");
  return int(it->get<long long>());
}

void load_optimizer_moments(const CheckpointInfo& ckpt, Model& model, AdamWOptimizer& opt) {
  load_optimizer_shard(ckpt.dir, checkpoint_world_size(ckpt), model, opt);
}

std::string save_checkpoint(const CheckpointWrite& w, Model& model, AdamWOptimizer& opt) {
  std::unique_ptr<Communicator> single;
  Communicator* comm = w.comm;
  if (!comm) {
    single = make_single_communicator();
    comm = single.get();
  }
  const bool root = comm->rank() == 0;
  const fs::path root_dir = fs::path(w.run_dir) / "checkpoints";
  const std::string name = step_dir_name(w.step);
  const fs::path final_dir = root_dir / name;
  // The fp32 weights come from every rank's shard (collective, before any file).
  const std::vector<std::vector<float>> weights = gather_fp32_weights(model, opt, *comm);
  // Rank 0 makes the temporary directory; its name reaches the others with the go-ahead.
  std::string tmp_name;
  if (root) {
    tmp_name = (root_dir / (".tmp-" + name + "-" + std::to_string(::getpid()))).string();
    try {
      fs::create_directories(root_dir);
      fs::remove_all(tmp_name);
      fs::create_directories(tmp_name);
    } catch (const std::exception& e) {
      tmp_name = std::string("!") + e.what();
    }
  }
  tmp_name = comm->broadcast_string(tmp_name);
  if (!tmp_name.empty() && tmp_name[0] == '!')
    fail(root_dir.string(), ": cannot create the checkpoint's temporary directory: ", tmp_name.substr(1));
  const fs::path tmp = tmp_name;
  g_checkpoint_bytes_written = 0;
  // Every rank writes its optimizer shard and reports {"file": record} or {"error": msg}.
  nlohmann::json report;
  try {
    report = {{"file", write_optimizer_shard(tmp.string(), model, opt)}};
  } catch (const std::exception& e) {
    report = {{"error", e.what()}};
  }
  const std::vector<std::string> reports = comm->gather_strings(report.dump());
  std::string outcome;  // rank 0: "" when published, else the error
  if (root) {
    auto& params = model.parameters();
    nlohmann::json files = nlohmann::json::object();
    try {
      for (int r = 0; r < comm->world_size(); ++r) {
        const nlohmann::json rep = nlohmann::json::parse(reports[size_t(r)]);
        if (rep.contains("error")) fail("rank ", r, ": ", rep["error"].get<std::string>());
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
        files["model.safetensors"] = f.record();
      }
      nlohmann::json st = {{"format", kFormat},   {"step", w.step},
                           {"world_size", comm->world_size()},
                           {"config", w.config->to_json()},
                           {"loader", w.loader},  {"trainer", w.trainer}, {"files", files}};
      const std::string text = st.dump(2) + "\n";
      CheckedFile f((tmp / "state.json").string());
      f.write(text.data(), text.size());
      f.close();
      fsync_dir(tmp);
      // Publish: a same-step checkpoint (re-saved after an interrupt) is replaced only once
      // the new one is complete.
      if (fs::exists(final_dir)) {
        const fs::path old = root_dir / (".old-" + name + "-" + std::to_string(::getpid()));
        fs::rename(final_dir, old);
        fs::rename(tmp, final_dir);
        fs::remove_all(old);
      } else {
        fs::rename(tmp, final_dir);
      }
      fsync_dir(root_dir);
      if (w.keep > 0) {
        auto all = list_checkpoints(w.run_dir);
        for (size_t i = 0; i + size_t(w.keep) < all.size(); ++i) fs::remove_all(all[i]);
      }
    } catch (const std::exception& e) {
      outcome = e.what();
      if (outcome.empty()) outcome = "unknown error";
      std::error_code ec;
      fs::remove_all(tmp, ec);  // never leave a half-written directory behind
    }
  }
  outcome = comm->broadcast_string(outcome);
  if (!outcome.empty()) {
    if (root) fail(outcome);
    fail("checkpoint of step ", w.step, " failed on rank 0: ", outcome);
  }
  return final_dir.string();
}

}  // namespace mhar
