// checkpoint_shards.cpp: optimizer shards on disk and fp32 weights from the shards (see
// checkpoint_shards.h).
#include "engine/checkpoint_shards.h"

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

}  // namespace mhar
