#!/usr/bin/env bash
# test.sh: the README's test command. Installs dependencies, configures and builds
# everything (CUDA sources included, sm_90), then runs every test with ctest. CUDA tests
# skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export PATH="/usr/local/cuda/bin:$PATH"
BUILD_DIR="${BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHAR_WITH_CUDA=ON -DMHAR_BUILD_TESTS=ON \
      -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"
