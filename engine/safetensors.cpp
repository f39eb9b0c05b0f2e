// safetensors.cpp: the safetensors reader and writer (see safetensors.h for the rules
// the reader enforces).
#include "engine/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/error.h"
#include "engine/file_io.h"
#include "engine/json_io.h"

namespace mhar {

namespace {

// The reference implementation's limit: a header larger than this is refused before it
// is parsed.
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;
constexpr const char* kKnownDtypes = "F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL";
constexpr const char* kLayoutRule =
    " (the safetensors layout: sorted by data_offsets, the tensors cover the data section "
    "exactly, the first from byte 0, each from where the previous one ends, the last to the "
    "end of the file)";

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

// The whole file is read into memory, so it cannot be larger than the machine's memory;
// a larger (or sparse, hostile) file is refused by size instead of failing an allocation.
uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return uint64_t(1) << 40;
  return uint64_t(pages) * uint64_t(page);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

SafetensorsFile SafetensorsFile::load(const std::string& path) {
  return parse(read_regular_file(path, "safetensors file", physical_memory_bytes()), path);
}

SafetensorsFile SafetensorsFile::parse(std::string bytes, const std::string& source) {
  using json = nlohmann::json;
  SafetensorsFile f;
  f.path_ = source;
  const uint64_t size = bytes.size();
  if (size < 8)
    fail(source, ": file of ", size, " bytes is too short for a safetensors header (an 8-byte "
         "length, then the JSON header)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | uint8_t(bytes[size_t(i)]);
  if (header_len > size - 8)
    fail(source, ": header length ", header_len, " exceeds the ", size - 8,
         " bytes after the length field: truncated, or not a safetensors file");
  if (header_len > kMaxHeaderBytes)
    fail(source, ": header length ", header_len, " exceeds the format's limit of ", kMaxHeaderBytes,
         " bytes");
  if (header_len < 2 || bytes[8] != '{')
    fail(source, ": the header does not start with '{': not a safetensors file");
  // Depth 3 is the format's own: the header object, a tensor's entry, its shape array.
  JsonLimits limits;
  limits.max_depth = 3;
  const json h = parse_json_strict(bytes.substr(8, size_t(header_len)), source + " (header)", limits);
  if (!h.is_object()) fail(source, ": the header is not a JSON object");
  const uint64_t data_size = size - 8 - header_len;

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        fail(source, ": __metadata__ = ", json_excerpt(v), " is not an object (the format allows "
             "a string-to-string map)");
      for (auto m = v.begin(); m != v.end(); ++m)
        if (!m.value().is_string())
          fail(source, ": __metadata__.", m.key(), " = ", json_excerpt(m.value()),
               " is not a string (the format allows a string-to-string map)");
      f.metadata_ = v;
      continue;
    }
    const std::string where = source + ": tensor \"" + name + "\"";
    if (!v.is_object())
      fail(where, " = ", json_excerpt(v), " is not an object with dtype, shape and data_offsets");
    for (auto m = v.begin(); m != v.end(); ++m)
      if (m.key() != "dtype" && m.key() != "shape" && m.key() != "data_offsets")
        fail(where, " has an unknown field \"", m.key(), "\" (valid: dtype, shape, data_offsets)");
    Entry e;
    e.dtype = json_to_string(json_member(v, "dtype", where), where + ": dtype");
    const size_t elem = dtype_bytes(e.dtype);
    if (!elem) fail(where, ": dtype \"", e.dtype, "\" is not a known dtype (known: ", kKnownDtypes, ")");
    const json& shape = json_member(v, "shape", where);
    if (!shape.is_array())
      fail(where, ": shape = ", json_excerpt(shape), " is not an array of dimensions");
    uint64_t numel = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      const uint64_t s = json_to_uint(shape[d], where + ": shape[" + std::to_string(d) + "]", 0,
                                      uint64_t(INT64_MAX));
      e.shape.push_back(int64_t(s));
      if (__builtin_mul_overflow(numel, s, &numel))
        fail(where, ": shape ", json_excerpt(shape), " has more elements than 2^64");
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, uint64_t(elem), &nbytes))
      fail(where, ": shape ", json_excerpt(shape), " of ", e.dtype, " needs more than 2^64 bytes");
    const json& off = json_member(v, "data_offsets", where);
    if (!off.is_array() || off.size() != 2)
      fail(where, ": data_offsets = ", json_excerpt(off), " is not a pair [begin, end]");
    const uint64_t begin = json_to_uint(off[0], where + ": data_offsets[0]", 0, UINT64_MAX);
    const uint64_t end = json_to_uint(off[1], where + ": data_offsets[1]", 0, UINT64_MAX);
    if (begin > end) fail(where, ": data_offsets [", begin, ", ", end, "] end before they begin");
    if (end > data_size)
      fail(where, ": data [", begin, ", ", end, ") lies outside the ", data_size,
           " data bytes: truncated or damaged file");
    if (end - begin != nbytes)
      fail(where, ": data_offsets [", begin, ", ", end, ") hold ", end - begin, " bytes but ",
           e.dtype, " ", shape_text(e.shape), " needs ", nbytes);
    e.begin = size_t(begin);
    e.end = size_t(end);
    ranges.push_back({begin, end, &name});
    f.entries_[name] = std::move(e);
  }
  // The layout rule. Empty tensors (begin == end) sort before a tensor starting at the
  // same byte and take no room.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin < pos)
      fail(source, ": tensor \"", *r.name, "\" data [", r.begin, ", ", r.end, ") overlaps tensor \"",
           *prev->name, "\" [", prev->begin, ", ", prev->end, ")", kLayoutRule);
    if (r.begin > pos)
      fail(source, ": data bytes [", pos, ", ", r.begin, ") ",
           prev ? "between tensor \"" + *prev->name + "\" and" : std::string("before"), " tensor \"",
           *r.name, "\" belong to no tensor", kLayoutRule);
    pos = r.end;
    if (r.end > r.begin) prev = &r;
  }
  if (pos != data_size)
    fail(source, ": the tensors end at data byte ", pos, " but the data section holds ", data_size,
         " bytes: ", data_size - pos, " trailing bytes belong to no tensor", kLayoutRule);
  f.bytes_ = std::move(bytes);
  f.data_start_ = size_t(8 + header_len);
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
  if (e.dtype != "F64" && e.dtype != "F32" && e.dtype != "BF16")
    fail(path_, ": tensor ", name, " is ", e.dtype, "; expected a floating dtype (F64, F32, BF16)");
  const uint8_t* p = reinterpret_cast<const uint8_t*>(bytes_.data()) + data_start_ + e.begin;
  const int64_t n = numel(name);
  std::vector<double> out(size_t(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (e.dtype == "F64") { double v; std::memcpy(&v, p + 8 * i, 8); out[i] = v; }
    else if (e.dtype == "F32") { float v; std::memcpy(&v, p + 4 * i, 4); out[i] = v; }
    else { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = bf16_to_f32(v); }
  }
  return out;
}

std::vector<int32_t> SafetensorsFile::to_i32(const std::string& name) const {
  const Entry& e = entry(name);
  if (e.dtype != "I32" && e.dtype != "I64")
    fail(path_, ": tensor ", name, " is ", e.dtype, "; expected I32 or I64");
  const uint8_t* p = reinterpret_cast<const uint8_t*>(bytes_.data()) + data_start_ + e.begin;
  const int64_t n = numel(name);
  std::vector<int32_t> out(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) {
    if (e.dtype == "I32") { std::memcpy(&out[i], p + 4 * i, 4); }
    else {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      if (v < INT32_MIN || v > INT32_MAX) fail(path_, ": tensor ", name, " value ", v, " overflows int32");
      out[i] = int32_t(v);
    }
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
