// tensor.h: dtypes and Tensor, a non-owning view (pointer, dtype, shape) into memory
// owned by an Arena (allocator.h). Shapes are row-major with at most 4 dimensions; a
// Tensor never owns or frees its data. Device memory and host memory look the same
// here: which one a pointer lives in is the backend's business.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "engine/error.h"

namespace mhar {

enum class DType : uint8_t { F32, F64, BF16, I32 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::I32: return 4;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
  }
  return "?";
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  int ndim = 0;
  std::array<int64_t, 4> shape{0, 0, 0, 0};

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> dims) : data(d), dtype(t) {
    MHAR_CHECK(dims.size() <= 4, "at most 4 dimensions");
    for (int64_t s : dims) shape[ndim++] = s;
  }

  int64_t numel() const {
    int64_t n = ndim ? 1 : 0;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  bool empty() const { return data == nullptr; }

  template <class T> T* ptr() const {
    MHAR_CHECK(dtype_of<T>() == dtype, "tensor is ", dtype_name(dtype));
    return static_cast<T*>(data);
  }

  // Row i of the leading dimension, as a tensor of one dimension fewer.
  Tensor operator[](int64_t i) const {
    MHAR_CHECK(ndim >= 2 && i >= 0 && i < shape[0], "index ", i, " of ", shape[0]);
    Tensor t;
    t.dtype = dtype;
    t.ndim = ndim - 1;
    for (int k = 1; k < ndim; ++k) t.shape[k - 1] = shape[k];
    t.data = static_cast<char*>(data) + size_t(i) * t.bytes();
    return t;
  }

  // Same memory, another shape of the same element count.
  Tensor view(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, dims);
    MHAR_CHECK(t.numel() == numel(), "view changes element count");
    return t;
  }

  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

}  // namespace mhar
