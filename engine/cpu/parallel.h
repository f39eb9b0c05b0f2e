// parallel.h: when a CPU kernel is worth splitting across OpenMP threads. Tiny problems
// (the unit-test models, the tail of a run) run faster on one thread, and on a loaded
// 2-core machine spinning OpenMP teams can slow them by orders of magnitude, so every
// parallel region carries `if(worth_parallel(work))`.
#pragma once
#include <cstdint>

namespace mhar::cpu {

inline bool worth_parallel(int64_t work) { return work >= (int64_t(1) << 16); }

}  // namespace mhar::cpu
