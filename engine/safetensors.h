// safetensors.h: reading and writing the safetensors format (the Hugging Face tensor
// file: 8-byte little-endian header length, a JSON header mapping names to dtype, shape
// and data_offsets, then the raw little-endian data). Used for checkpoints, exports and
// test fixtures.
//
// Reading treats the file as hostile and enforces the format's whole rule before any
// tensor is read: only a regular file is opened (engine/file_io.h: a FIFO or /dev/zero is
// refused, never waited on); the header is strict JSON (engine/json_io.h: duplicate
// tensor names, deep nesting and bad UTF-8 refused) of at most 100 MiB starting with '{';
// every entry has exactly dtype (a known one), shape (non-negative dimensions whose
// product times the element size does not overflow) and data_offsets [begin, end) with
// end - begin equal to that size; and the layout rule: sorted by offset, the tensors'
// byte ranges cover the data section exactly (the first starts at 0, each starts where
// the previous one ends, the last ends at the end of the file), so no two overlap and no
// byte is a gap or trailing junk. `__metadata__`, if present, is a string-to-string map.
// Every error names the file, the tensor or field, the bad value and the rule.
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
  // Reads and validates `path` (see above); throws mhar::Error.
  static SafetensorsFile load(const std::string& path);
  // Validates the bytes of a whole safetensors file already in memory; `source` names
  // them in errors.
  static SafetensorsFile parse(std::string bytes, const std::string& source);

  struct Entry {
    std::string dtype;  // "F32", "F64", "BF16", "F16", "I32", "I64", ...
    std::vector<int64_t> shape;
    size_t begin = 0, end = 0;  // byte range in the data section
  };

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const Entry& entry(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted by name
  int64_t numel(const std::string& name) const;
  const nlohmann::json& metadata() const { return metadata_; }  // "__metadata__" or {}

  // The tensor converted to double / int32 (floating or integer dtypes respectively).
  std::vector<double> to_f64(const std::string& name) const;
  std::vector<int32_t> to_i32(const std::string& name) const;

 private:
  std::string path_;
  std::map<std::string, Entry> entries_;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::string bytes_;      // the whole file
  size_t data_start_ = 0;  // where the data section begins in bytes_
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
