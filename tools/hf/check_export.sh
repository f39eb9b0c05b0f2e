#!/usr/bin/env bash
# check_export.sh: the Hugging Face export/import checks of issue 9, for a machine with
# PyTorch and transformers 5 (the GPU machine; no GPU is needed). Builds a CPU-only
# `mhar` (or takes $MHAR_BIN, e.g. build-gpu/mhar from tools/gpu_check.sh), then runs
# tools/hf/check_export.py: tiny models of every residual scheme (standard, attnres, mhar,
# block mhar, static and dynamic hyper, delta) trained for 30 steps, exported and loaded
# with transformers, compared with the engine (logits, loss, greedy text, bf16,
# tokenizer), and Qwen3 models made by transformers imported and exported back. Prints a table of figures last; exits non-zero on any failure.
#   MHAR_BIN     an mhar binary to use instead of building one
#   BUILD_DIR    build directory (default build-hf)
#   JOBS         build parallelism (default nproc)
#   MHAR_ASSETS  folder with tokenizers/gpt2 and tokenizers/qwen3 (default ./assets: carry
#                assets/tokenizers to the machine)
# Logs (build, every mhar command, the table, hf_check.json) go to $OUT when set (the
# device tool's folder), else $BUILD_DIR/logs.
# ICU: as in tools/gpu_check.sh, Debian's libicu carried in .icu/ (name it in the device
# call's `carry`) is unpacked into /tmp when the machine has no ICU headers.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${BUILD_DIR:-build-hf}"
LOG_DIR="${OUT:-$BUILD_DIR/logs}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$LOG_DIR" "$BUILD_DIR"
t_start=$(date +%s)

extra_args=()
if [ -e /usr/include/unicode/utypes.h ] || [ -n "${ICU_ROOT:-}" ]; then
  :
elif [ -e .icu/icu72.tar.xz ]; then
  icu=/tmp/mhar-icu
  mkdir -p "$icu" && tar -xJf .icu/icu72.tar.xz -C "$icu"
  extra_args+=("-DICU_ROOT=$icu")
  # The carried libicuuc needs libicudata, which the binary's RUNPATH does not cover.
  export LD_LIBRARY_PATH="$icu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "ICU: Debian's libicu72 carried in .icu/, unpacked to $icu"
elif [ -z "${MHAR_BIN:-}" ]; then
  echo "check_export: no ICU headers here and no .icu/ carried (see tools/gpu_check.sh); cannot build mhar"
  exit 1
fi

if [ -z "${MHAR_BIN:-}" ]; then
  echo "== build mhar (CPU only, -j $JOBS)"
  if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHAR_WITH_CUDA=OFF \
       -DMHAR_BUILD_TESTS=OFF "${extra_args[@]}" >"$LOG_DIR/hf_build.log" 2>&1; then
    tail -40 "$LOG_DIR/hf_build.log"
    echo "check_export: CONFIGURE FAILED"
    exit 1
  fi
  if ! cmake --build "$BUILD_DIR" -j "$JOBS" --target mhar >>"$LOG_DIR/hf_build.log" 2>&1; then
    grep -E "error|FAILED" "$LOG_DIR/hf_build.log" | head -40
    echo "check_export: BUILD FAILED"
    exit 1
  fi
  MHAR_BIN="$BUILD_DIR/mhar"
  echo "built in $(( $(date +%s) - t_start )) s"
fi
export MHAR_ASSETS="${MHAR_ASSETS:-$PWD/assets}"
for t in gpt2 qwen3; do
  [ -e "$MHAR_ASSETS/tokenizers/$t/tokenizer.json" ] ||
    echo "check_export: warning: $MHAR_ASSETS/tokenizers/$t/tokenizer.json is missing (carry assets/tokenizers)"
done

echo "== tools/hf/check_export.py"
python3 tools/hf/check_export.py --mhar "$MHAR_BIN" --work "$BUILD_DIR/hf_check" --log-dir "$LOG_DIR" 2>&1 |
  tee "$LOG_DIR/hf_check.log"
rc=${PIPESTATUS[0]}
echo "check_export: exit $rc after $(( $(date +%s) - t_start )) s"
exit "$rc"
