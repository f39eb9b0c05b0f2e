// delta_bandwidth_cudatest.cpp: achieved bandwidth of delta mode's kernels (cuda/delta.cu)
// at the 100M / 350M / 1B shapes (16384 tokens a step, bf16 rows [N, d]): the gated add,
// its backward, the fused loop steps (stream advance, residual + gate backward, source
// gradient) next to the op sequences they replace (timed as one region), and the null
// source's broadcast and token sum. Not a parity test and no pass/fail on speed
// (tests/delta_cudatest.cpp checks the results): DISABLED_ so plain runs skip it; run with
// --gtest_also_run_disabled_tests on the GPU. The harness is tests/bandwidth_test_util.h
// (kernel_bandwidth_cudatest.cpp's too): each line gives the bytes the op must move (each
// input read once, each output written once; scratch partial sums not counted), the
// median device time of `reps` calls (CUDA events around each call, after 3 warm-ups),
// TB/s and % of the 4.3 TB/s H200 copy rate (and of the copy rate measured in this run).
// Inputs are random, never zeros; calls rotate over input sets so that none reads what
// the previous one left in the 50 MB L2.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>

#include "tests/bandwidth_test_util.h"

namespace mhar::test {
namespace {

class DeltaBandwidth : public BandwidthTest {};

TEST_F(DeltaBandwidth, DISABLED_DeltaKernels) {
  measure_copy_rate();
  for (auto [name, d] : {std::pair<const char*, int64_t>{"100M", 512}, {"350M", 1024}, {"1B", 1280}}) {
    const int64_t N = 16384;
    const double row = 2.0 * N * d;  // one bf16 [N, d] row's bytes
    const int sets = sets_for(3 * row);
    // Five [N, d] tensors per set (enough for every op below), a gate and its gradient.
    std::vector<std::array<Buffer, 5>> t;
    for (int i = 0; i < sets; ++i)
      t.push_back({random_gpu(DType::BF16, {N, d}), random_gpu(DType::BF16, {N, d}),
                   random_gpu(DType::BF16, {N, d}), random_gpu(DType::BF16, {N, d}),
                   random_gpu(DType::BF16, {N, d})});
    Buffer alpha = random_gpu(DType::BF16, {1}), dalpha = random_gpu(DType::F32, {1});
    Buffer null_row = random_gpu(DType::BF16, {d}), dnull = random_gpu(DType::F32, {d});
    Buffer scratch(*gpu, DType::F32, {64, d});
    auto T = [&](int i, int k) -> Tensor { return t[size_t(i)][size_t(k)]; };
    const std::string at = " [" + std::to_string(N) + " x " + std::to_string(d) + "] " + name;
    // Forward, per site. Repeated "+=" calls grow the values by at most reps x |input|
    // (~30 after 28 calls; the advance's stream ~400): ordinary finite bf16 throughout.
    report("delta_gate x = base + alpha r" + at, 3 * row,
           median_ms([&](int i) { gpu->delta_gate(T(i, 0), T(i, 1), alpha, T(i, 2)); }, sets));
    report("delta_stream_advance, prev (fused)" + at, 5 * row,
           median_ms([&](int i) { gpu->delta_stream_advance(T(i, 0), T(i, 1), T(i, 2)); }, sets));
    report("  the sequence it replaces: 2 x add_inplace" + at, 6 * row, median_ms([&](int i) {
             gpu->add_inplace(T(i, 0), T(i, 1));
             gpu->add_inplace(T(i, 1), T(i, 2));
           }, sets));
    report("delta_stream_advance, no prev" + at, 3 * row,
           median_ms([&](int i) { gpu->delta_stream_advance(T(i, 0), T(i, 1), Tensor()); }, sets));
    // Backward, per site.
    report("delta_gate_backward dr = alpha dx, dalpha" + at, 3 * row, median_ms([&](int i) {
             gpu->delta_gate_backward(T(i, 3), dalpha, T(i, 0), T(i, 1), alpha, scratch);
           }, sets));
    report("delta_resid_gate_backward (fused)" + at, 5 * row, median_ms([&](int i) {
             gpu->delta_resid_gate_backward(T(i, 4), T(i, 3), dalpha, T(i, 0), T(i, 1), alpha,
                                            scratch);
           }, sets));
    report("  the sequence it replaces: add_inplace + gate backward" + at, 6 * row,
           median_ms([&](int i) {
             gpu->add_inplace(T(i, 4), T(i, 0));
             gpu->delta_gate_backward(T(i, 3), dalpha, T(i, 0), T(i, 1), alpha, scratch);
           }, sets));
    report("delta_source_grad, next (fused)" + at, 5 * row, median_ms([&](int i) {
             gpu->delta_source_grad(T(i, 3), T(i, 0), T(i, 1), T(i, 2));
           }, sets));
    report("  the sequence it replaces: add_inplace + add" + at, 6 * row, median_ms([&](int i) {
             gpu->add_inplace(T(i, 1), T(i, 2));
             gpu->add(T(i, 3), T(i, 0), T(i, 1));
           }, sets));
    report("delta_source_grad, no next" + at, 3 * row, median_ms([&](int i) {
             gpu->delta_source_grad(T(i, 3), T(i, 0), T(i, 1), Tensor());
           }, sets));
    // Once a step (site 0): the null's broadcast and token sum.
    report("delta_null_forward (broadcast)" + at, row + 2.0 * d,
           median_ms([&](int i) { gpu->delta_null_forward(T(i, 4), null_row); }, sets));
    report("delta_null_backward (token sum)" + at, row + 8.0 * d,
           median_ms([&](int i) { gpu->delta_null_backward(dnull, T(i, 0), scratch); }, sets));
  }
}

}  // namespace
}  // namespace mhar::test
