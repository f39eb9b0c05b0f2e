// allocator.h: one allocation per memory category (parameters, gradients, optimizer
// state, activations), tensors as views into it.
//
// A MemoryPlan collects buffer requests, each with a lifetime [first, last] in the step's
// timeline (forward events, then backward events in reverse; see model.cpp), and places
// them at offsets so that buffers whose lifetimes overlap never share bytes while
// buffers that are never live together may. Requests without a lifetime live for the
// whole step, which gives a plain sequential layout (parameters, gradients).
// An Arena owns the single backend allocation the plan is materialised into.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/tensor.h"

namespace mhar {

class MemoryPlan {
 public:
  static constexpr int kForever = 1 << 30;
  static constexpr size_t kAlignment = 256;  // cuBLAS and vector loads like this

  struct Buffer {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t bytes = 0;
    int first = 0, last = kForever;  // inclusive lifetime
    size_t offset = 0;
  };

  explicit MemoryPlan(std::string category) : category_(std::move(category)) {}

  // Returns the buffer's id. Lifetimes are inclusive; an unset lifetime is the whole step.
  int add(const std::string& name, DType dtype, std::initializer_list<int64_t> shape,
          int first = 0, int last = kForever);
  // A whole-step buffer that occupies `padded_numel` elements (>= the shape's element
  // count) of `dtype`: the model's parameter and gradient layouts use it to give every
  // tensor the same element offset in both allocations (sharded optimizer, optimizer.h).
  int add_padded(const std::string& name, DType dtype, std::initializer_list<int64_t> shape,
                 int64_t padded_numel);
  // Assigns offsets (greedy: largest first, lowest offset that fits among placed
  // buffers with overlapping lifetimes). Call once, after every add. Placed buffers are
  // indexed by lifetime, so a 1024-layer model's ~32k activations plan in a fraction of
  // a second.
  void plan();

  const std::string& category() const { return category_; }
  const std::vector<Buffer>& buffers() const { return buffers_; }
  size_t total_bytes() const { return total_; }        // size of the one allocation
  size_t requested_bytes() const;                       // sum of all buffers, unshared
  bool planned() const { return planned_; }
  // The tensor view of buffer `id` inside an allocation starting at `base`.
  Tensor tensor(int id, void* base) const;

 private:
  std::string category_;
  std::vector<Buffer> buffers_;
  size_t total_ = 0;
  bool planned_ = false;
};

// The single allocation backing one MemoryPlan.
class Arena {
 public:
  Arena(Backend& backend, const MemoryPlan& plan);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  Tensor tensor(int id) const { return plan_.tensor(id, base_); }
  void* base() const { return base_; }
  size_t bytes() const { return plan_.total_bytes(); }

 private:
  Backend& backend_;
  const MemoryPlan& plan_;
  void* base_ = nullptr;
};

std::string format_bytes(size_t bytes);

}  // namespace mhar
