// allocator.cpp: lifetime-aware offset assignment and the arena allocation.
#include "engine/allocator.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace mhar {

namespace {
size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
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

namespace {

// A union of byte ranges [lo, hi), kept merged (touching or overlapping ranges become
// one) in a sorted vector: the unions stay short because live buffers pack tightly.
class RangeUnion {
 public:
  void add(size_t lo, size_t hi) {
    // The ranges that touch or overlap [lo, hi) are contiguous: [first, last).
    auto first = std::lower_bound(ranges_.begin(), ranges_.end(), lo,
                                  [](const Range& r, size_t v) { return r.hi < v; });
    auto last = first;
    while (last != ranges_.end() && last->lo <= hi) ++last;
    if (first == last) {
      ranges_.insert(first, Range{lo, hi});
      return;
    }
    first->lo = std::min(first->lo, lo);
    first->hi = std::max((last - 1)->hi, hi);
    ranges_.erase(first + 1, last);
  }
  // The lowest x' >= x with [x', x' + need) outside every range.
  size_t first_fit_from(size_t x, size_t need) const {
    // The first range ending after x; those before it cannot overlap [x, ...).
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), x,
                               [](size_t v, const Range& r) { return v < r.hi; });
    for (; it != ranges_.end() && it->lo < x + need; ++it) x = std::max(x, it->hi);
    return x;
  }
  bool empty() const { return ranges_.empty(); }

 private:
  struct Range {
    size_t lo, hi;
  };
  std::vector<Range> ranges_;  // sorted, disjoint, not touching
};

// Placed buffers indexed by lifetime: a segment tree over the (compressed) event times.
// A buffer is stored at the O(log T) nodes that partition its lifetime ("cover") and
// merged into the "below" union of those nodes and of their ancestors. The buffers live
// at some time in [a, b] are then the "cover" unions of the nodes on the paths to the
// query's partition and the "below" unions of the partition's nodes: O(log T) merged
// unions, however many buffers there are.
class LifetimeIndex {
 public:
  explicit LifetimeIndex(int times) : n_(std::max(1, times)), cover_(4 * size_t(n_)), below_(4 * size_t(n_)) {}
  void add(int a, int b, size_t lo, size_t hi) { add(1, 0, n_ - 1, a, b, lo, hi); }
  // The unions that together hold every buffer live at some time in [a, b].
  void collect(int a, int b, std::vector<const RangeUnion*>& out) const {
    collect(1, 0, n_ - 1, a, b, out);
  }

 private:
  void add(size_t node, int l, int r, int a, int b, size_t lo, size_t hi) {
    below_[node].add(lo, hi);
    if (a <= l && r <= b) {
      cover_[node].add(lo, hi);
      return;
    }
    const int m = (l + r) / 2;
    if (a <= m) add(2 * node, l, m, a, b, lo, hi);
    if (b > m) add(2 * node + 1, m + 1, r, a, b, lo, hi);
  }
  void collect(size_t node, int l, int r, int a, int b, std::vector<const RangeUnion*>& out) const {
    if (a <= l && r <= b) {
      if (!below_[node].empty()) out.push_back(&below_[node]);
      return;
    }
    if (!cover_[node].empty()) out.push_back(&cover_[node]);
    const int m = (l + r) / 2;
    if (a <= m) collect(2 * node, l, m, a, b, out);
    if (b > m) collect(2 * node + 1, m + 1, r, a, b, out);
  }

  int n_;
  std::vector<RangeUnion> cover_, below_;
};

}  // namespace

void MemoryPlan::plan() {
  MHAR_CHECK(!planned_, "plan twice");
  std::vector<int> order(buffers_.size());
  std::iota(order.begin(), order.end(), 0);
  // Whole-step buffers first in request order (a predictable layout for parameters),
  // then the rest largest first, which packs lifetimes tightly.
  auto whole_step = [](const Buffer& b) { return b.first == 0 && b.last == kForever; };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const Buffer &x = buffers_[a], &y = buffers_[b];
    bool fx = whole_step(x), fy = whole_step(y);
    if (fx != fy) return fx;
    if (fx) return false;
    return x.bytes > y.bytes;
  });
  // Each buffer goes to the lowest offset where it overlaps no placed buffer live at the
  // same time (first fit). Collecting and sorting the live placed buffers for each new
  // one made planning quadratic-times-log in the tensor count (96 s for the 31,755
  // activations of a 1024-layer model); the lifetime index finds the same offsets from
  // O(log T) merged unions. Whole-step buffers are live with every placed buffer, all of
  // them whole-step and packed from 0 (they come first), so each goes to the end of the
  // packed range; the rest must also stay above that range. A buffer of 0 bytes goes to
  // 0 and blocks nothing.
  std::vector<int> times;
  for (const Buffer& b : buffers_)
    if (!whole_step(b)) times.insert(times.end(), {b.first, b.last});
  std::sort(times.begin(), times.end());
  times.erase(std::unique(times.begin(), times.end()), times.end());
  auto time_index = [&](int t) {
    return int(std::lower_bound(times.begin(), times.end(), t) - times.begin());
  };
  LifetimeIndex index(int(times.size()));
  size_t packed_end = 0;  // end of the whole-step buffers
  std::vector<const RangeUnion*> live;
  total_ = 0;
  for (int id : order) {
    Buffer& b = buffers_[id];
    const size_t need = align_up(b.bytes, kAlignment);
    size_t offset = 0;
    if (need == 0) {
      offset = 0;
    } else if (whole_step(b)) {
      offset = packed_end;
      packed_end = offset + need;
    } else {
      const int a = time_index(b.first), z = time_index(b.last);
      live.clear();
      index.collect(a, z, live);
      offset = packed_end;
      for (;;) {  // raise the offset until every union leaves it free
        const size_t before = offset;
        for (const RangeUnion* u : live) offset = u->first_fit_from(offset, need);
        if (offset == before) break;
      }
      index.add(a, z, offset, offset + need);
    }
    b.offset = offset;
    total_ = std::max(total_, offset + need);
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
