#!/usr/bin/env bash
# kernel_times.sh: every kernel of one training step, timed apart by Nsight Compute, summed
# by kernel: where a step's GPU time goes one level below `mhar bench --profile`'s op
# families (which time ops by events, each op's kernels together).
#   tools/kernel_times.sh CONFIG [CONFIG ...]    e.g. tools/kernel_times.sh configs/100m_mhar.json
# For each config: `mhar bench CONFIG --warmup 1 --steps 1` under ncu (one metric,
# gpu__time_duration.sum, clocks and caches left alone), the step taken as the kernels from
# the last embedding forward on (the last micro-step and the optimizer), written as
# $OUT/kernels_<config>.csv (ncu's rows) and summarised on stdout: kernels grouped by name
# (template arguments kept), total ms, share of the step, launches (KERNELS lines); then
# the same by family, from the names (FAMILY lines).
# ncu serialises the launches, so the sum is the step's kernels back to back without launch
# gaps or overlap; read shares and differences, not the step time.
#   MHAR (default build-gpu/mhar), OUT (default the current folder), TOP (default 40 rows)
set -uo pipefail
caller_dir="$PWD"
cd "$(dirname "$0")/.."
usage="usage: tools/kernel_times.sh CONFIG [CONFIG ...]   (see the header of this file)"
case "${1:-}" in
  -h|--help) echo "$usage"; exit 0 ;;
  "") echo "$usage" >&2; exit 2 ;;
esac
MHAR="${MHAR:-build-gpu/mhar}"
dir="${OUT:-$caller_dir}"; [[ "$dir" = /* ]] || dir="$caller_dir/$dir"
mkdir -p "$dir"
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu_bin" ] || { echo "kernel_times.sh: no ncu on this machine" >&2; exit 1; }
rc=0
for cfg in "$@"; do
  # A path relative to the caller's folder, else to the repo root (configs/...).
  [[ "$cfg" = /* ]] || [ ! -e "$caller_dir/$cfg" ] || cfg="$caller_dir/$cfg"
  [ -e "$cfg" ] || { echo "kernel_times.sh: no config $cfg" >&2; rc=1; continue; }
  name=$(basename "$cfg" .json)
  csv="$dir/kernels_$name.csv"
  if ! "$ncu_bin" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
       --csv --print-units base --kernel-name-base demangled \
       "$MHAR" --log-level warn bench "$cfg" --warmup 1 --steps 1 \
       >"$csv" 2>"$dir/kernels_$name.err"; then
    echo "kernel_times.sh: ncu on $cfg failed; see kernels_$name.err" >&2; rc=1; continue
  fi
  python3 - "$csv" "$name" "${TOP:-40}" <<'EOF' || rc=1
import csv, sys, collections
path, name, top = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
kn, mu, mv = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
ms = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}
rows = [(r[kn], float(r[mv].replace(",", "")) * ms[r[mu]]) for r in rows]  # ms
starts = [i for i, (k, _) in enumerate(rows) if "embedding_forward" in k]
if not starts:
    sys.exit(f"{name}: no embedding_forward kernel among {len(rows)} launches")
step = rows[starts[-1]:]
total = sum(t for _, t in step)

def short(k):  # the kernel with its template arguments, without return type and parameters
    if k.endswith(")"):
        depth = 0
        for i in range(len(k) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(k[i], 0)
            if depth == 0:
                k = k[:i]
                break
    k = k[5:] if k.startswith("void ") else k
    return k.replace("(anonymous namespace)::", "").replace("mhar::cuda::", "")

by = collections.defaultdict(lambda: [0.0, 0])
for k, t in step:
    by[short(k)][0] += t
    by[short(k)][1] += 1
print(f"KERNELS {name}: {len(step)} launches, {total:.3f} ms of kernels back to back")
for k, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"KERNELS {name} {t:9.3f} ms {100 * t / total:5.1f}% {c:5d}x  {k[:150]}")

# The same by family, from the kernels' names (cuBLAS's carry tile shapes, not callers: the
# routing's own GEMMs count as matmul here; tell them apart by name in the table above).
families = [("matmul", ("nvjet", "gemm", "cublas", "cutlass", "splitK")),
            ("attention", ("hopper::", "tc::", "attention", "flash")),
            ("routing", ("source_", "mix_", "key_grad", "qg_tables", "inv_rms", "split_bf16",
                         "scale_by_token", "param_grads", "routing", "delta_", "logits_mma")),
            ("norm", ("rmsnorm", "qk_norm")),
            ("mlp", ("swiglu",)),
            ("classifier", ("cross_entropy", "logsumexp", "classifier")),
            ("optimizer", ("adamw", "sum_squares", "clip"))]
fam = collections.defaultdict(lambda: [0.0, 0])
for k, (t, c) in by.items():
    f = next((f for f, keys in families if any(x in k for x in keys)), "other")
    fam[f][0] += t
    fam[f][1] += c
for f, (t, c) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
    print(f"FAMILY {name} {t:9.3f} ms {100 * t / total:5.1f}% {c:5d}x  {f}")
EOF
done
exit $rc
