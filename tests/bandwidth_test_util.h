// bandwidth_test_util.h: the harness of the memory-bound kernels' bandwidth tests
// (kernel_bandwidth_cudatest.cpp, delta_bandwidth_cudatest.cpp): the median device time
// of `reps` calls (CUDA events around each call, after 3 warm-ups), rotating over input
// sets so that no call reads what the previous one left in L2, and a report line with the
// bytes the op must move, TB/s and % of the H200's copy rate (and of the copy rate
// measured in the run, once a test has called measure_copy_rate).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tests/cuda_test_util.h"

namespace mhar::test {

constexpr double kCopyTBs = 4.3;           // H200 device copy, read + write (KINDS.md)
constexpr double kRotateBytes = 200e6;     // 4x the H200's 50 MB L2

class BandwidthTest : public CudaParity {
 protected:
  static int sets_for(double bytes) {
    return int(std::clamp(std::ceil(kRotateBytes / bytes), 1.0, 8.0));
  }
  // Median device time of one call; op(i) runs the call on input set i.
  double median_ms(const std::function<void(int)>& op, int sets, int reps = 25) {
    for (int i = 0; i < 3; ++i) op(i % sets);
    gpu->synchronize();
    gpu->timing_reset();
    std::vector<std::pair<int, int>> marks;
    for (int i = 0; i < reps; ++i) {
      const int a = gpu->timing_mark();
      op(i % sets);
      marks.emplace_back(a, gpu->timing_mark());
    }
    gpu->synchronize();
    std::vector<double> ms;
    for (auto [a, b] : marks) ms.push_back(gpu->timing_ms(a, b));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
  // The device copy rate of this run, into copy_tbs_ for the report lines that follow, and
  // reported itself: the same measurement (cuda::measure_copy_bytes_per_s) that `mhar bench
  // --profile` takes as its roofline, so "% of copy here" means the same in both.
  void measure_copy_rate() {
    std::string why;
    const double bytes_per_s = cuda::measure_copy_bytes_per_s(&why);
    ASSERT_TRUE(bytes_per_s > 0) << "the copy rate could not be measured: " << why;
    copy_tbs_ = bytes_per_s * 1e-12;
    const double bytes = 2.0 * double(cuda::kCopyRateBytes);  // read + written
    report("device copy (cuda::measure_copy_bytes_per_s, " +
               std::to_string(cuda::kCopyRateBytes >> 20) + " MiB)",
           bytes, bytes / bytes_per_s * 1e3);
  }
  void report(const std::string& what, double bytes, double ms) {
    const double tbs = bytes / ms * 1e-9;
    std::printf("BANDWIDTH %-60s %9.1f MB %8.4f ms %6.2f TB/s %5.1f%% of %.1f", what.c_str(),
                bytes * 1e-6, ms, tbs, 100.0 * tbs / kCopyTBs, kCopyTBs);
    if (copy_tbs_ > 0) std::printf("  %5.1f%% of copy here", 100.0 * tbs / copy_tbs_);
    std::printf("\n");
  }
  double copy_tbs_ = 0;
};

}  // namespace mhar::test
