// checkpoint_shards.cpp: optimizer shards on disk and fp32 weights from the shards (see
// checkpoint_shards.h).
#include "engine/checkpoint_shards.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/safetensors.h"

namespace fs = std::filesystem;

namespace mhar {

namespace {

std::vector<float> download_f32(Backend& be, const Tensor& t) {
  std::vector<double> d(size_t(t.numel()));
  be.download(d.data(), t);
  return std::vector<float>(d.begin(), d.end());
}

// "<first> <count>" of a range entry, validated against the parameter's size.
bool parse_range(const std::string& s, int64_t numel, int64_t* first, int64_t* count) {
  long long a = -1, n = -1;
  char tail = 0;
  if (std::sscanf(s.c_str(), "%lld %lld%c", &a, &n, &tail) != 2) return false;
  if (a < 0 || n < 0 || a > numel || n > numel - a) return false;
  *first = a;
  *count = n;
  return true;
}

}  // namespace

std::string optimizer_shard_file(int rank) {
  return "optimizer.rank" + std::to_string(rank) + ".safetensors";
}

nlohmann::json write_optimizer_shard(const std::string& dir, const Model& model,
                                     const AdamWOptimizer& opt) {
  Backend& be = const_cast<Model&>(model).backend();
  const auto& params = model.parameters();
  std::vector<std::vector<float>> data;
  std::vector<TensorToWrite> tensors;
  std::map<std::string, std::string> meta = {{"world_size", std::to_string(opt.world_size())},
                                             {"rank", std::to_string(opt.rank())}};
  data.reserve(2 * opt.segments().size());
  for (const ShardSegment& s : opt.segments()) {
    const std::string& name = params[size_t(s.param)].name;
    meta["range." + name] = std::to_string(s.begin) + " " + std::to_string(s.count);
    data.push_back(download_f32(be, opt.exp_avg(s)));
    tensors.push_back({name + ".exp_avg", "F32", {s.count}, data.back().data()});
    data.push_back(download_f32(be, opt.exp_avg_sq(s)));
    tensors.push_back({name + ".exp_avg_sq", "F32", {s.count}, data.back().data()});
  }
  CheckedFile f((fs::path(dir) / optimizer_shard_file(opt.rank())).string());
  write_safetensors_to([&](const void* p, size_t n) { f.write(p, n); }, tensors, meta);
  f.close();
  return {{"bytes", f.bytes()}, {"fnv1a64", hex64(f.hash())}};
}

std::vector<std::vector<float>> gather_fp32_weights(const Model& model, const AdamWOptimizer& opt,
                                                    Communicator& comm) {
  Backend& be = const_cast<Model&>(model).backend();
  std::vector<float> mine;
  for (const ShardSegment& s : opt.segments()) {
    const std::vector<float> w = download_f32(be, opt.weights(s));
    mine.insert(mine.end(), w.begin(), w.end());
  }
  const std::vector<float> all = comm.gather_floats(mine);
  if (comm.rank() != 0) return {};
  const auto& params = model.parameters();
  std::vector<std::vector<float>> out(params.size());
  std::vector<int64_t> filled(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) out[i].resize(size_t(params[i].value.numel()));
  size_t at = 0;
  for (int r = 0; r < comm.world_size(); ++r)
    for (const ShardSegment& s : AdamWOptimizer::shard_segments(model, r)) {
      MHAR_CHECK(at + size_t(s.count) <= all.size(), "gathered weights too short");
      std::copy(all.begin() + long(at), all.begin() + long(at + size_t(s.count)),
                out[size_t(s.param)].begin() + s.begin);
      filled[size_t(s.param)] += s.count;
      at += size_t(s.count);
    }
  MHAR_CHECK(at == all.size(), "gathered ", all.size(), " weights, the shards hold ", at);
  for (size_t i = 0; i < params.size(); ++i)
    MHAR_CHECK(filled[i] == params[i].value.numel(), params[i].name, ": ", filled[i], " of ",
               params[i].value.numel(), " elements gathered");
  return out;
}

void load_optimizer_shard(const std::string& dir, int ckpt_world_size, const Model& model,
                          AdamWOptimizer& opt) {
  Backend& be = const_cast<Model&>(model).backend();
  const auto& params = model.parameters();
  if (ckpt_world_size < 1) fail(dir, ": state.json world_size = ", ckpt_world_size, " must be >= 1");
  // The same world size: this rank's own file holds exactly its shard.
  std::vector<int> files;
  if (ckpt_world_size == opt.world_size()) files.push_back(opt.rank());
  else for (int r = 0; r < ckpt_world_size; ++r) files.push_back(r);
  if (ckpt_world_size != opt.world_size() && opt.rank() == 0)
    spdlog::info("re-sharding the optimizer state: checkpoint written by {} rank(s), this run has {}",
                 ckpt_world_size, opt.world_size());
  // Host copies of this rank's segments, filled from the files.
  std::vector<std::vector<double>> m(opt.segments().size()), v(opt.segments().size());
  std::vector<int64_t> covered(opt.segments().size(), 0);
  for (size_t k = 0; k < opt.segments().size(); ++k) {
    m[k].assign(size_t(opt.segments()[k].count), 0.0);
    v[k].assign(size_t(opt.segments()[k].count), 0.0);
  }
  for (int r : files) {
    const fs::path file = fs::path(dir) / optimizer_shard_file(r);
    if (!fs::exists(file))
      fail(file.string(), ": missing (the checkpoint records ", ckpt_world_size, " rank(s))");
    const SafetensorsFile f = SafetensorsFile::load(file.string());
    const nlohmann::json& meta = f.metadata();
    for (size_t k = 0; k < opt.segments().size(); ++k) {
      const ShardSegment& s = opt.segments()[k];
      const Parameter& p = params[size_t(s.param)];
      const std::string mname = p.name + ".exp_avg", vname = p.name + ".exp_avg_sq";
      if (!f.has(mname) && !f.has(vname)) continue;  // this file's shard misses the parameter
      int64_t first = 0, count = p.value.numel();
      const std::string key = "range." + p.name;
      if (meta.is_object() && meta.contains(key)) {
        if (!meta[key].is_string() || !parse_range(meta[key].get<std::string>(), p.value.numel(), &first, &count))
          fail(file.string(), ": metadata ", key, " = ", meta[key].dump(), " is not \"<first> <count>\" "
               "within the parameter's ", p.value.numel(), " elements");
      }
      for (const std::string& name : {mname, vname})
        if (!f.has(name) || f.numel(name) != count)
          fail(file.string(), ": tensor ", name, " missing or of the wrong size (expected ", count,
               " elements)");
      const int64_t a = std::max(first, s.begin), e = std::min(first + count, s.begin + s.count);
      if (a >= e) continue;
      const std::vector<double> fm = f.to_f64(mname), fv = f.to_f64(vname);
      std::copy(fm.begin() + (a - first), fm.begin() + (e - first), m[k].begin() + (a - s.begin));
      std::copy(fv.begin() + (a - first), fv.begin() + (e - first), v[k].begin() + (a - s.begin));
      covered[k] += e - a;
    }
  }
  for (size_t k = 0; k < opt.segments().size(); ++k) {
    const ShardSegment& s = opt.segments()[k];
    if (covered[k] != s.count)
      fail(dir, ": the optimizer files hold ", covered[k], " of the ", s.count, " elements [",
           s.begin, ", ", s.begin + s.count, ") of ", params[size_t(s.param)].name,
           " that rank ", opt.rank(), " needs (files overlap or miss a range: damaged checkpoint)");
    be.upload(opt.exp_avg(s), m[k].data());
    be.upload(opt.exp_avg_sq(s), v[k].data());
  }
}

}  // namespace mhar
