// allocator.cpp: lifetime-aware offset assignment and the arena allocation.
#include "engine/allocator.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace mhar {

namespace {
size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
bool lifetimes_overlap(const MemoryPlan::Buffer& a, const MemoryPlan::Buffer& b) {
  return a.first <= b.last && b.first <= a.last;
}
}  // namespace

int MemoryPlan::add(const std::string& name, DType dtype, std::initializer_list<int64_t> shape,
                    int first, int last) {
  MHAR_CHECK(!planned_, "add after plan: ", name);
  MHAR_CHECK(first <= last, name, " lifetime [", first, ", ", last, "]");
  Buffer b;
  b.name = name;
  b.dtype = dtype;
  b.shape.assign(shape.begin(), shape.end());
  size_t n = 1;
  for (int64_t s : shape) {
    MHAR_CHECK(s >= 0, name, " negative dimension");
    n *= size_t(s);
  }
  b.bytes = n * dtype_size(dtype);
  b.first = first;
  b.last = last;
  buffers_.push_back(std::move(b));
  return int(buffers_.size()) - 1;
}

int MemoryPlan::add_padded(const std::string& name, DType dtype,
                           std::initializer_list<int64_t> shape, int64_t padded_numel) {
  const int id = add(name, dtype, shape);
  Buffer& b = buffers_[size_t(id)];
  MHAR_CHECK(padded_numel >= 0 && size_t(padded_numel) * dtype_size(dtype) >= b.bytes, name,
             " padded to ", padded_numel, " elements, fewer than its shape holds");
  b.bytes = size_t(padded_numel) * dtype_size(dtype);
  return id;
}

void MemoryPlan::plan() {
  MHAR_CHECK(!planned_, "plan twice");
  std::vector<int> order(buffers_.size());
  std::iota(order.begin(), order.end(), 0);
  // Whole-step buffers first in request order (a predictable layout for parameters),
  // then the rest largest first, which packs lifetimes tightly.
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Buffer &x = buffers_[a], &y = buffers_[b];
    bool fx = x.first == 0 && x.last == kForever, fy = y.first == 0 && y.last == kForever;
    if (fx != fy) return fx;
    if (fx) return false;
    return x.bytes > y.bytes;
  });
  std::vector<int> placed;
  total_ = 0;
  for (int id : order) {
    Buffer& b = buffers_[id];
    // Candidate intervals occupied by placed buffers live at the same time.
    std::vector<std::pair<size_t, size_t>> busy;
    for (int p : placed)
      if (lifetimes_overlap(b, buffers_[p]))
        busy.push_back({buffers_[p].offset, buffers_[p].offset + align_up(buffers_[p].bytes, kAlignment)});
    std::sort(busy.begin(), busy.end());
    size_t offset = 0, need = align_up(b.bytes, kAlignment);
    for (const auto& [lo, hi] : busy) {
      if (offset + need <= lo) break;
      offset = std::max(offset, hi);
    }
    b.offset = offset;
    total_ = std::max(total_, offset + need);
    placed.push_back(id);
  }
  planned_ = true;
}

size_t MemoryPlan::requested_bytes() const {
  size_t s = 0;
  for (const auto& b : buffers_) s += align_up(b.bytes, kAlignment);
  return s;
}

Tensor MemoryPlan::tensor(int id, void* base) const {
  MHAR_CHECK(planned_, "tensor before plan");
  const Buffer& b = buffers_.at(id);
  Tensor t;
  t.data = static_cast<char*>(base) + b.offset;
  t.dtype = b.dtype;
  t.ndim = int(b.shape.size());
  MHAR_CHECK(t.ndim <= 4, b.name);
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = b.shape[i];
  return t;
}

Arena::Arena(Backend& backend, const MemoryPlan& plan) : backend_(backend), plan_(plan) {
  MHAR_CHECK(plan.planned(), "arena over an unplanned ", plan.category());
  base_ = backend_.allocate(std::max<size_t>(plan.total_bytes(), MemoryPlan::kAlignment));
}

Arena::~Arena() { backend_.release(base_); }

std::string format_bytes(size_t bytes) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", v, units[u]);
  return buf;
}

}  // namespace mhar
