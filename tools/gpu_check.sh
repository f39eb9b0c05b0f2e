#!/usr/bin/env bash
# gpu_check.sh: the one command for the GPU machine (fresh and bare on every call):
# configures with CMake + Ninja, builds the CUDA test binary and `mhar`, runs the parity
# tests (every op, the whole model, GPU training) and the op timings
# (tests/op_timing_cudatest.cpp; the attention against PyTorch's at the same shapes:
# tests/attention_timing_cudatest.cpp, tools/reference/attention_bench.py), optionally
# the benchmark table against PyTorch (tools/bench_compare.sh), and prints a short
# summary last. Logs go to $OUT (when set, e.g. by the device tool) or
# $BUILD_DIR/logs; 3-7 files by the options (the device tool returns 7 at most: NCU_SOURCE,
# LAB, AB and KERNEL_TIMES each add one).
# Also builds (and skips the GPU tests) on a machine without a GPU.
#   BUILD_DIR       build directory (default build-gpu)
#   GTEST_FILTER    passed through to the test binary (default: every test)
#   TEST_TIMEOUT    s, bounding that run (default 300, which the whole suite fits in): shorter
#                   for a first run of a kernel that could hang
#   JOBS            build parallelism (default: nproc)
#   OP_TIMING=0     skip the op timings
#   CHECKS="..."    then run tools/gpu_extra_checks.sh with these stages (eval probe
#                   export nccl: end-to-end checks against PyTorch/transformers, NCCL)
#   NCU_KERNELS=RE  also profile kernels with Nsight Compute: the first NCU_COUNT (default
#                   1) kernels whose demangled name matches the regex RE (template
#                   arguments read "(int)32, (bool)1"), launched by the GPU tests of
#                   NCU_FILTER (a gtest filter, disabled tests included; default
#                   'KernelBandwidth.DISABLED_NormKernelVersions'): speed of light,
#                   occupancy, warp states, scheduler, instruction and memory statistics
#                   into ncu.txt, their key lines in the summary (what says why a
#                   memory-bound kernel runs under the copy rate: cuda/NOTES.md).
#                   NCU_SKIP=N skips the first N matching launches (the lab times a
#                   version with 28 launches: 3 warm-up, 25 timed); NCU_SOURCE=1 adds
#                   the sampled stall reasons per SASS instruction (ncu_sass.csv) and
#                   every section's details
#   LAB=FILTER      then run the kernel lab's disabled tests of this gtest filter (e.g.
#                   'OpTiming.DISABLED_RoutingBackwardVersions') into lab.txt, LAB_TIMEOUT
#                   (s, default 240) bounding them; their TIMING, BANDWIDTH and SCALING
#                   lines in the summary
#   AB=VERSIONS     then time the step at these lab versions against the defaults:
#                   tools/bench_modes.sh AB_SIZE (default 100m; several sizes in turn,
#                   e.g. "100m 1b") AB_MODES (default
#                   "standard mhar"), AB_ROUNDS (default 2) rounds, each the defaults then
#                   MHAR_KERNEL_VERSIONS=VERSIONS (e.g. AB=key_grad=4; README, "Kernel
#                   lab"); STEPS (default 8) and WARMUP (2) as bench_modes takes them
#   KERNEL_TIMES="CONFIG ..."  then time every kernel of one step of each config apart
#                   (tools/kernel_times.sh, under ncu; e.g. "configs/100m_mhar.json
#                   configs/100m_standard.json") into kernel_times.txt, its FAMILY lines in
#                   the summary (TOP rows a config, default 40)
#   BENCH=1         also run tools/bench_compare.sh; it starts first, so the PyTorch jobs
#                   compile while this script builds and tests, and our runs wait for
#                   the tests to finish. BENCH_DEADLINE (s, default 420) bounds it;
#                   BENCH_SIZES (default "100m 350m 1b") picks the model sizes,
#                   BENCH_MODES (default "standard mhar") the residual modes.
#
# ICU: the project's data library needs ICU (find_package(ICU COMPONENTS uc)) and the GPU
# image has no ICU headers and no network. Debian 12's libicu72 + libicu-dev (headers,
# libicuuc, libicudata; 8.4 MiB as .tar.xz) travel in the git-ignored folder .icu/ (name
# it in the device call's `carry`); this script unpacks them into /tmp and points CMake
# (ICU_ROOT) and the loader (LD_LIBRARY_PATH) there. They need only an old glibc. Made
# with, in the repo root:
#   mkdir -p .icu && echo /.icu/ >> .git/info/exclude && cd .icu &&
#   apt-get download libicu-dev libicu72 && for f in *.deb; do dpkg-deb -x $f root; done &&
#   (cd root && L=usr/lib/x86_64-linux-gnu && tar -cJf ../icu72.tar.xz \
#     --transform 's,^usr/lib/x86_64-linux-gnu,lib,;s,^usr/include,include,' \
#     usr/include/unicode $L/libicuuc.so* $L/libicudata.so*) && rm -rf root *.deb
# (the tar runs inside root/ so that the library globs expand there)
set -uo pipefail
# Settings come from the environment only: `--help` prints the header above, and any other
# argument is refused before anything is built (an argument used to be ignored, so the
# whole check ran: minutes of a GPU machine's time).
if [ $# -gt 0 ]; then
  if [ "$1" = --help ] || [ "$1" = -h ]; then
    sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
  fi
  echo "gpu_check.sh: takes no arguments (got '$1'); settings are environment variables, see --help" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-gpu}"
LOG_DIR="${OUT:-$BUILD_DIR/logs}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$LOG_DIR" "$BUILD_DIR"
export PATH="/usr/local/cuda/bin:$PATH"
# MPI (required by the build: data parallelism): images often keep Open MPI outside PATH.
if ! command -v mpicxx >/dev/null; then
  for d in /usr/local/mpi/bin /opt/hpcx/ompi/bin /opt/openmpi/bin; do
    [ -x "$d/mpicxx" ] && export PATH="$d:$PATH" && break
  done
fi
t_start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t_start )) s"; }

{
  echo "== host: $(uname -srm), $(nproc) cores"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader || echo "no nvidia-smi"
  nvcc --version | tail -2
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo "no torch"
  echo "mpi: $(command -v mpicxx || echo 'no mpicxx') $(mpirun --version 2>/dev/null | head -1)"
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-<unset>}"
} 2>&1 | tee "$LOG_DIR/env.log"

echo "== configure"
extra_args=()
targets=(mhar_cuda_tests)
if [ -e /usr/include/unicode/utypes.h ] || [ -n "${ICU_ROOT:-}" ]; then
  targets+=(mhar)
elif [ -e .icu/icu72.tar.xz ]; then
  icu=/tmp/mhar-icu
  mkdir -p "$icu" && tar -xJf .icu/icu72.tar.xz -C "$icu"
  extra_args+=("-DICU_ROOT=$icu")
  export LD_LIBRARY_PATH="$icu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  targets+=(mhar)
  echo "ICU: Debian's libicu72 carried in .icu/, unpacked to $icu"
else
  # No ICU at all: an empty stand-in lets the project configure; mhar_data (and so
  # `mhar`) is not built.
  stub="$PWD/$BUILD_DIR/icu-standin"
  mkdir -p "$stub/include/unicode" "$stub/lib"
  echo "/* empty stand-in: see tools/gpu_check.sh */" >"$stub/include/unicode/utypes.h"
  [ -e "$stub/lib/libicuuc.a" ] || ar rc "$stub/lib/libicuuc.a"
  extra_args+=("-DICU_ROOT=$stub")
  echo "note: no ICU here and no .icu/ carried; empty ICU stand-in, \`mhar\` is not built"
fi
# Started only now, so that its runs of `mhar` inherit LD_LIBRARY_PATH: the carried
# libicuuc needs libicudata, which the binary's RUNPATH does not cover (RUNPATH serves
# direct dependencies only). Started before the export, in this script's first device
# run, every run of ours failed: "libicudata.so.72: cannot open shared object file".
bench_pid=""
tests_done="$PWD/$BUILD_DIR/.tests_done"
rm -f "$tests_done"
if [ "${BENCH:-0}" = 1 ]; then
  echo "== bench_compare.sh started in the background (PyTorch compiles while we build)"
  tools/bench_compare.sh --mhar "$BUILD_DIR/mhar" --after "$tests_done" \
    --deadline "${BENCH_DEADLINE:-420}" --sizes "${BENCH_SIZES:-100m 350m 1b}" \
    --modes "${BENCH_MODES:-standard mhar}" \
    >"$BUILD_DIR/bench_compare.out" 2>&1 &
  bench_pid=$!
fi
if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" "${extra_args[@]}" >"$LOG_DIR/build.log" 2>&1; then
  tail -40 "$LOG_DIR/build.log"
  echo "gpu_check: CONFIGURE FAILED"
  touch "$tests_done"
  exit 1
fi

echo "== build ${targets[*]} (-j $JOBS)"
start=$(date +%s)
if ! cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}" >>"$LOG_DIR/build.log" 2>&1; then
  grep -E "error|FAILED" "$LOG_DIR/build.log" | head -40
  echo "gpu_check: BUILD FAILED"
  touch "$tests_done"
  [ -n "$bench_pid" ] && wait "$bench_pid"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s (at $(elapsed))"
if command -v cuobjdump >/dev/null; then
  {
    echo "== SASS of cuda/attention.cu (tensor-core path: HMMA, LDSM, LDGSTS; spills: LDL/STL)"
    obj=$(find "$BUILD_DIR" -name 'attention.cu.o' | head -1)
    cuobjdump --dump-sass "$obj" | grep -oE "HMMA\.[0-9A-Z.]+|LDSM[.A-Z0-9]*|LDGSTS[.A-Z0-9]*|\bLDL\b|\bSTL\b" \
      | sort | uniq -c
  } 2>&1 | tee -a "$LOG_DIR/env.log"
fi

echo "== mhar_cuda_tests"
start=$(date +%s)
timeout "${TEST_TIMEOUT:-300}" "$BUILD_DIR/mhar_cuda_tests" --gtest_filter="${GTEST_FILTER:-*}" \
  >"$LOG_DIR/cuda_tests.log" 2>&1
rc=$?
echo "tests ran in $(( $(date +%s) - start )) s, exit $rc (at $(elapsed))"

if [ "${OP_TIMING:-1}" != 0 ]; then
  echo "== op timings (model-sized shapes)"
  # The routing sweeps fill [S, N, d] blocks on the host at three model sizes: minutes.
  timeout 300 "$BUILD_DIR/mhar_cuda_tests" --gtest_also_run_disabled_tests --gtest_filter='OpTiming.*' \
    >"$LOG_DIR/op_timing.log" 2>&1 || echo "op timing run failed (exit $?)"
  grep -E "^TIMING|FAILED|Failure|exception" "$LOG_DIR/op_timing.log" || true
  echo "== attention against PyTorch's cuDNN and FA2 (issue 13's shapes)"
  timeout 90 "$BUILD_DIR/mhar_cuda_tests" --gtest_also_run_disabled_tests \
    --gtest_filter='AttentionTiming.*' >>"$LOG_DIR/op_timing.log" 2>&1 ||
    echo "attention timing failed (exit $?)"
  timeout 150 python3 tools/reference/attention_bench.py >>"$LOG_DIR/op_timing.log" 2>&1 ||
    echo "tools/reference/attention_bench.py failed (exit $?; PyTorch with CUDA needed)"
  grep -E "^ATTENTION|^PYTORCH" "$LOG_DIR/op_timing.log" || true
fi
touch "$tests_done"

if [ -n "${LAB:-}" ]; then
  echo "== kernel lab: $LAB (at $(elapsed))"
  timeout "${LAB_TIMEOUT:-240}" "$BUILD_DIR/mhar_cuda_tests" --gtest_also_run_disabled_tests \
    --gtest_filter="$LAB" >"$LOG_DIR/lab.txt" 2>&1 || echo "lab run failed (exit $?)"
fi

if [ -n "${AB:-}" ]; then
  echo "== step A/B: MHAR_KERNEL_VERSIONS=$AB against the defaults (at $(elapsed))"
  ab_dir="$PWD/$BUILD_DIR/ab"
  mkdir -p "$ab_dir"
  for size in ${AB_SIZE:-100m}; do
    for ((round = 1; round <= ${AB_ROUNDS:-2}; ++round)); do
      for versions in "" "$AB"; do
        # bench_modes.sh writes its files into $OUT: a folder of its own, not the logs'.
        MHAR_KERNEL_VERSIONS="$versions" OUT="$ab_dir" STEPS="${STEPS:-8}" WARMUP="${WARMUP:-2}" \
          MHAR="$PWD/$BUILD_DIR/mhar" timeout 200 bash tools/bench_modes.sh "$size" \
          ${AB_MODES:-standard mhar} 2>&1 | grep BENCH_MODES |
          sed "s/^/[round $round, ${versions:-defaults}] /" | tee -a "$LOG_DIR/ab.txt"
      done
    done
  done
fi

if [ -n "${NCU_KERNELS:-}" ]; then
  echo "== ncu: kernels matching '$NCU_KERNELS' (at $(elapsed))"
  ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  if [ -z "$ncu_bin" ]; then
    echo "no ncu on this machine: skipped"
  else
    ncu_args=(--clock-control none --kernel-name-base demangled -k "regex:$NCU_KERNELS"
      --launch-skip "${NCU_SKIP:-0}" -c "${NCU_COUNT:-1}" --section SpeedOfLight
      --section Occupancy --section WarpStateStats --section SchedulerStats
      --section InstructionStats --section MemoryWorkloadAnalysis)
    ncu_test=("$BUILD_DIR/mhar_cuda_tests" --gtest_also_run_disabled_tests
      --gtest_filter="${NCU_FILTER:-KernelBandwidth.DISABLED_NormKernelVersions}")
    if [ "${NCU_SOURCE:-0}" = 1 ]; then
      # Sampled warp stalls per SASS instruction: the report is saved, then read back as
      # the details page (every section's tables, stall reasons included) and the source
      # page (one CSV row per instruction), and deleted (it does not come back).
      rep="$LOG_DIR/ncu_report"
      timeout 300 "$ncu_bin" "${ncu_args[@]}" --section SourceCounters --import-source no \
        -f -o "$rep" "${ncu_test[@]}" >"$LOG_DIR/ncu.txt" 2>&1 || echo "ncu run failed (exit $?)"
      if [ -f "$rep.ncu-rep" ]; then
        "$ncu_bin" -i "$rep.ncu-rep" --page details --print-details all >>"$LOG_DIR/ncu.txt" 2>&1
        "$ncu_bin" -i "$rep.ncu-rep" --page source --print-source sass --csv \
          >"$LOG_DIR/ncu_sass.csv" 2>&1 || echo "ncu source page failed (exit $?)"
        rm -f "$rep.ncu-rep"
      fi
    else
      timeout 300 "$ncu_bin" "${ncu_args[@]}" "${ncu_test[@]}" >"$LOG_DIR/ncu.txt" 2>&1 ||
        echo "ncu run failed (exit $?)"
    fi
    if grep -q "No kernels were profiled" "$LOG_DIR/ncu.txt"; then
      echo "ncu: no kernel matched; ncu.txt lists the launched ones"
    fi
  fi
fi

if [ -n "${KERNEL_TIMES:-}" ]; then
  echo "== kernel times: $KERNEL_TIMES (at $(elapsed))"
  # Run from here so that `mhar` finds the carried ICU (LD_LIBRARY_PATH above); its CSVs
  # and ncu's messages go to a folder of their own, only the summary to the logs.
  kt_dir="$PWD/$BUILD_DIR/kernel_times"
  mkdir -p "$kt_dir"
  rm -f "$kt_dir"/*.err  # a warm machine's earlier run: only this run's messages below
  # shellcheck disable=SC2086  # a list of configs
  if ! OUT="$kt_dir" TOP="${TOP:-40}" MHAR="$PWD/$BUILD_DIR/mhar" timeout 300 \
    bash tools/kernel_times.sh $KERNEL_TIMES >"$LOG_DIR/kernel_times.txt" 2>&1; then
    echo "kernel_times.sh failed; the end of ncu's messages is in kernel_times.txt"
    for f in "$kt_dir"/*.err; do
      [ -s "$f" ] && { echo "== $f"; tail -20 "$f"; } >>"$LOG_DIR/kernel_times.txt"
    done
  fi
fi

extra_rc=0
if [ -n "${CHECKS:-}" ]; then
  echo "== extra checks: $CHECKS (at $(elapsed))"
  BUILD_DIR="$BUILD_DIR" CHECKS="$CHECKS" bash tools/gpu_extra_checks.sh
  extra_rc=$?
fi

if [ -n "$bench_pid" ]; then
  echo "== waiting for bench_compare.sh (at $(elapsed))"
  wait "$bench_pid"
  grep -E "^\[bench_compare" "$BUILD_DIR/bench_compare.out" | tail -40
fi

echo "== summary (at $(elapsed))"
grep -E "^MODEL_PARITY .*worst|^TRAIN .*mean|^NCCL_1RANK" "$LOG_DIR/cuda_tests.log" || true
grep -E "^PARITY" "$LOG_DIR/cuda_tests.log" | sort -k7 -g -r | head -8 || true
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? ran|Failure" "$LOG_DIR/cuda_tests.log" | tail -30
[ -e "$LOG_DIR/bench_table.md" ] && cat "$LOG_DIR/bench_table.md"
[ -e "$LOG_DIR/lab.txt" ] && grep -E "^TIMING|^BANDWIDTH|^SCALING|FAILED|Failure" "$LOG_DIR/lab.txt"
[ -e "$LOG_DIR/ab.txt" ] && cat "$LOG_DIR/ab.txt"
[ -e "$LOG_DIR/kernel_times.txt" ] && grep -E "^FAMILY|^KERNELS [^ ]*:|failed" "$LOG_DIR/kernel_times.txt"
if [ -e "$LOG_DIR/ncu.txt" ]; then
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Warp|Eligible Warps|Executed Instructions  |Stall" \
    "$LOG_DIR/ncu.txt" | cut -c1-160 | head -40
fi
[ "$rc" = 0 ] && rc=$extra_rc
exit "$rc"
