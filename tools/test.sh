#!/usr/bin/env bash
# test.sh: the README's test command. Installs dependencies, configures and builds
# everything (CUDA sources included, sm_90), then runs every test with ctest. CUDA tests
# skip themselves when no GPU is present.
# Second stage (skip with MHAR_TEST_SANITIZE=0): the CPU suite again, built CPU-only with
# AddressSanitizer and UBSan (CMake option MHAR_SANITIZE) in $SANITIZE_BUILD_DIR, so that
# a memory error or undefined behaviour fails a test even where the result comes out right.
# Arguments go to both ctest runs (e.g. -R Shard).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR="${BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHAR_WITH_CUDA=ON -DMHAR_BUILD_TESTS=ON \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"

if [[ "${MHAR_TEST_SANITIZE:-1}" == "0" ]]; then
  exit 0
fi
SANITIZE_BUILD_DIR="${SANITIZE_BUILD_DIR:-build-sanitize}"
echo "== test.sh: the CPU suite under AddressSanitizer + UBSan ($SANITIZE_BUILD_DIR; MHAR_TEST_SANITIZE=0 skips it)"
# -O1: ASan's usual level, fast enough for the gradient checks, and it keeps stacks exact.
cmake -S . -B "$SANITIZE_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" \
      -DMHAR_WITH_CUDA=OFF -DMHAR_SANITIZE=ON -DMHAR_BUILD_TESTS=ON >/dev/null
cmake --build "$SANITIZE_BUILD_DIR" -j "$(nproc)"
# fast_unwind_on_malloc=0: Open MPI's libraries have no frame pointers, so only the slow
# unwinder reaches the frames that tools/lsan.supp names (the MPI tests' ranks).
ASAN_OPTIONS="detect_leaks=1:fast_unwind_on_malloc=0:strict_string_checks=1" \
LSAN_OPTIONS="suppressions=$PWD/tools/lsan.supp:print_suppressions=0" \
UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir "$SANITIZE_BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"
