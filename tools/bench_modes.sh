#!/usr/bin/env bash
# bench_modes.sh: the residual modes of one model size side by side, in one run on one
# GPU (`mhar bench` on configs/<size>_<mode>.json, one after the other): tokens/s and
# peak memory of each mode against standard's (the ratios the issues' bars are stated
# in), and with PROFILE=N the op-family profile of each (`mhar bench --profile N`).
#   tools/bench_modes.sh SIZE [MODE ...]   e.g. tools/bench_modes.sh 1b standard mhar block_mhar
# (MODE names a config: standard attnres mhar block_mhar hyper hyper_dynamic delta)
# The first mode is the reference (default modes: standard mhar block_mhar). Writes
# bench.jsonl (one bench JSON line per mode) and profile.txt (the tables) into $OUT (or
# the current folder); prints BENCH_MODES lines.
#   MHAR (default build-gpu/mhar), STEPS (10), WARMUP (3), PROFILE (0: none)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: tools/bench_modes.sh SIZE [MODE ...]" >&2; exit 2; }
size="$1"; shift
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(standard mhar block_mhar)
MHAR="${MHAR:-build-gpu/mhar}"
dir="${OUT:-.}"
mkdir -p "$dir"
out="$dir/bench.jsonl"; prof="$dir/profile.txt"
: >"$out"; : >"$prof"
rc=0
for mode in "${modes[@]}"; do
  cfg="configs/${size}_$mode.json"
  [ -e "$cfg" ] || { echo "BENCH_MODES $size $mode: no $cfg"; rc=1; continue; }
  args=(--steps "${STEPS:-10}" --warmup "${WARMUP:-3}")
  [ "${PROFILE:-0}" -gt 0 ] && args+=(--profile "$PROFILE")
  echo "== $cfg" >>"$prof"
  if ! "$MHAR" --log-level warn bench "$cfg" "${args[@]}" >>"$out" 2>>"$prof"; then
    echo "BENCH_MODES $size $mode FAILED (see profile.txt)"; rc=1
  fi
done
python3 - "$out" <<'PY' || rc=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not rows:
    sys.exit(1)
ref = rows[0]
for r in rows:
    name = r["config"].split("/")[-1].removesuffix(".json")
    print(f"BENCH_MODES {name}: {r['tokens_per_s']:.0f} tok/s ({r['tokens_per_s'] / ref['tokens_per_s']:.3f}x "
          f"the first), {r['ms_per_step']:.1f} ms/step, peak {r['peak_mem_bytes'] / 2**30:.2f} GiB "
          f"({r['peak_mem_bytes'] / ref['peak_mem_bytes']:.3f}x), MFU {r['mfu']:.3f}")
PY
exit "$rc"
