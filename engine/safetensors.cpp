// safetensors.cpp: the safetensors reader and writer (see safetensors.h).
#include "engine/safetensors.h"

#include <cstring>
#include <fstream>

#include "engine/error.h"

namespace mhar {

namespace {

size_t dtype_bytes(const std::string& t) {
  if (t == "F64" || t == "I64" || t == "U64") return 8;
  if (t == "F32" || t == "I32" || t == "U32") return 4;
  if (t == "BF16" || t == "F16" || t == "I16" || t == "U16") return 2;
  if (t == "I8" || t == "U8" || t == "BOOL") return 1;
  return 0;
}

float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

SafetensorsFile SafetensorsFile::load(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail(path, ": cannot open safetensors file");
  const uint64_t size = uint64_t(in.tellg());
  in.seekg(0);
  if (size < 8) fail(path, ": file of ", size, " bytes is too short for a safetensors header");
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  if (header_len > size - 8 || header_len > (100u << 20))
    fail(path, ": header length ", header_len, " exceeds the file (", size, " bytes): truncated or not safetensors");
  std::string header(header_len, '\0');
  in.read(header.data(), std::streamsize(header_len));
  nlohmann::json j = nlohmann::json::parse(header, nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail(path, ": header is not a JSON object");
  const uint64_t data_size = size - 8 - header_len;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      f.metadata_ = it.value();
      continue;
    }
    const auto& v = it.value();
    Entry e;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      fail(path, ": tensor ", it.key(), " has a malformed header entry");
    e.dtype = v["dtype"].get<std::string>();
    const size_t elem = dtype_bytes(e.dtype);
    if (!elem) fail(path, ": tensor ", it.key(), " has unknown dtype ", e.dtype);
    uint64_t numel = 1;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) fail(path, ": tensor ", it.key(), " has a bad shape");
      e.shape.push_back(s.get<int64_t>());
      numel *= s.get<uint64_t>();
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, ": tensor ", it.key(), " has bad data_offsets");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      fail(path, ": tensor ", it.key(), " data [", e.begin, ", ", e.end, ") lies outside the ",
           data_size, " data bytes: truncated file?");
    if (e.end - e.begin != numel * elem)
      fail(path, ": tensor ", it.key(), " has ", e.end - e.begin, " bytes but its shape needs ",
           numel * elem);
    f.entries_[it.key()] = e;
  }
  f.data_.resize(data_size);
  in.read(reinterpret_cast<char*>(f.data_.data()), std::streamsize(data_size));
  if (uint64_t(in.gcount()) != data_size) fail(path, ": short read");
  return f;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) fail(path_, ": no tensor named ", name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : entries_) n.push_back(k);
  return n;
}

int64_t SafetensorsFile::numel(const std::string& name) const {
  const Entry& e = entry(name);
  return int64_t((e.end - e.begin) / dtype_bytes(e.dtype));
}

std::vector<double> SafetensorsFile::to_f64(const std::string& name) const {
  const Entry& e = entry(name);
  const uint8_t* p = data_.data() + e.begin;
  const int64_t n = numel(name);
  std::vector<double> out(size_t(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (e.dtype == "F64") { double v; std::memcpy(&v, p + 8 * i, 8); out[i] = v; }
    else if (e.dtype == "F32") { float v; std::memcpy(&v, p + 4 * i, 4); out[i] = v; }
    else if (e.dtype == "BF16") { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = bf16_to_f32(v); }
    else fail(path_, ": tensor ", name, " is ", e.dtype, "; expected a floating dtype (F64, F32, BF16)");
  }
  return out;
}

std::vector<int32_t> SafetensorsFile::to_i32(const std::string& name) const {
  const Entry& e = entry(name);
  const uint8_t* p = data_.data() + e.begin;
  const int64_t n = numel(name);
  std::vector<int32_t> out(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (e.dtype == "I32") { std::memcpy(&out[i], p + 4 * i, 4); }
    else if (e.dtype == "I64") {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      if (v < INT32_MIN || v > INT32_MAX) fail(path_, ": tensor ", name, " value ", v, " overflows int32");
      out[i] = int32_t(v);
    } else fail(path_, ": tensor ", name, " is ", e.dtype, "; expected I32 or I64");
  }
  return out;
}

void write_safetensors_to(const std::function<void(const void*, size_t)>& sink,
                          const std::vector<TensorToWrite>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const size_t elem = dtype_bytes(t.dtype);
    MHAR_CHECK(elem, "dtype ", t.dtype);
    uint64_t n = 1;
    for (int64_t s : t.shape) n *= uint64_t(s);
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + n * elem}}};
    offset += n * elem;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes
  uint64_t len = h.size();
  sink(&len, 8);
  sink(h.data(), h.size());
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t s : t.shape) n *= uint64_t(s);
    sink(t.data, n * dtype_bytes(t.dtype));
  }
}

}  // namespace mhar
