#!/usr/bin/env bash
# gpu_check.sh: the one command for the GPU machine (fresh and bare on every call):
# configures with CMake + Ninja, builds the CUDA test binary, runs the parity tests and the
# op timings (tests/op_timing_cudatest.cpp), and prints a short summary last. Logs go to
# $OUT (when set, e.g. by the device tool) or $BUILD_DIR/logs.
# Also builds (and skips the GPU tests) on a machine without a GPU.
#   BUILD_DIR   build directory (default build-gpu)
#   GTEST_FILTER  passed through to the test binary (default: every test)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-gpu}"
LOG_DIR="${OUT:-$BUILD_DIR/logs}"
mkdir -p "$LOG_DIR"
export PATH="/usr/local/cuda/bin:$PATH"

{
  echo "== host: $(uname -srm), $(nproc) cores"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader || echo "no nvidia-smi"
  nvcc --version | tail -2
  cmake --version | head -1
} 2>&1 | tee "$LOG_DIR/env.log"

echo "== configure"
extra_args=()
# The GPU image has no ICU headers (libicu-dev), which only mhar_data needs, and nothing
# can be installed there. This script never builds mhar_data, so an empty stand-in lets
# the project configure; the real ICU is used wherever it is installed.
if [ ! -e /usr/include/unicode/utypes.h ] && [ -z "${ICU_ROOT:-}" ]; then
  stub="$PWD/$BUILD_DIR/icu-standin"
  mkdir -p "$stub/include/unicode" "$stub/lib"
  echo "/* empty stand-in: see tools/gpu_check.sh */" >"$stub/include/unicode/utypes.h"
  [ -e "$stub/lib/libicuuc.a" ] || ar rc "$stub/lib/libicuuc.a"
  extra_args+=("-DICU_ROOT=$stub")
  echo "note: no ICU headers here; configuring with an empty ICU stand-in (mhar_data is not built)"
fi
if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" "${extra_args[@]}" >"$LOG_DIR/configure.log" 2>&1; then
  tail -40 "$LOG_DIR/configure.log"
  echo "gpu_check: CONFIGURE FAILED"
  exit 1
fi

echo "== build mhar_cuda_tests"
start=$(date +%s)
if ! cmake --build "$BUILD_DIR" -j "$(nproc)" --target mhar_cuda_tests >"$LOG_DIR/build.log" 2>&1; then
  grep -E "error|FAILED" "$LOG_DIR/build.log" | head -40
  echo "gpu_check: BUILD FAILED"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

echo "== mhar_cuda_tests"
start=$(date +%s)
"$BUILD_DIR/mhar_cuda_tests" --gtest_filter="${GTEST_FILTER:-*}" 2>&1 | tee "$LOG_DIR/cuda_tests.log"
rc=${PIPESTATUS[0]}
echo "tests ran in $(( $(date +%s) - start )) s, exit $rc"

echo "== op timings (model-sized shapes)"
"$BUILD_DIR/mhar_cuda_tests" --gtest_also_run_disabled_tests --gtest_filter='OpTiming.*' \
  >"$LOG_DIR/op_timing.log" 2>&1 || echo "op timing run failed (exit $?)"
grep -E "^TIMING|FAILED|Failure|exception" "$LOG_DIR/op_timing.log" || true

echo "== summary"
grep -E "^PARITY" "$LOG_DIR/cuda_tests.log" | sort -k7 -g -r | head -15 || true
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? ran" "$LOG_DIR/cuda_tests.log" | tail -30
exit "$rc"
