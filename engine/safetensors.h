// safetensors.h: reading and writing the safetensors format (the Hugging Face tensor
// file: 8-byte little-endian header length, a JSON header mapping names to dtype, shape
// and data_offsets, then the raw little-endian data). Used for checkpoints, exports and
// test fixtures. Reading validates everything (header bounds, offsets, sizes, dtypes)
// and names the file and tensor in every error: a damaged file is refused, never read
// past its end.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mhar {

class SafetensorsFile {
 public:
  static SafetensorsFile load(const std::string& path);

  struct Entry {
    std::string dtype;  // "F32", "F64", "BF16", "F16", "I32", "I64", ...
    std::vector<int64_t> shape;
    size_t begin = 0, end = 0;  // byte range in the data section
  };

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;
  std::vector<std::string> names() const;
  int64_t numel(const std::string& name) const;
  const nlohmann::json& metadata() const { return metadata_; }  // "__metadata__" or {}

  // The tensor converted to double / int32 (floating or integer dtypes respectively).
  std::vector<double> to_f64(const std::string& name) const;
  std::vector<int32_t> to_i32(const std::string& name) const;

 private:
  std::string path_;
  std::map<std::string, Entry> entries_;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::vector<uint8_t> data_;
};

struct TensorToWrite {
  std::string name;
  std::string dtype;  // "F32", "F64", "I32", "BF16"
  std::vector<int64_t> shape;
  const void* data;   // numel * dtype size bytes, little-endian
};

// Streams the file's bytes into `sink`; the caller owns the file (checkpoints write
// through a sink that counts, hashes and checks every byte, into a temporary name that is
// renamed once complete).
void write_safetensors_to(const std::function<void(const void*, size_t)>& sink,
                          const std::vector<TensorToWrite>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

}  // namespace mhar
