#!/usr/bin/env bash
# bench_modes.sh: the residual modes of one model size side by side, in one run on one
# GPU (`mhar bench` on configs/<size>_<mode>.json, one after the other): tokens/s and
# peak memory of each mode against standard's (the ratios the issues' bars are stated
# in), and with PROFILE=N the op-family profile of each (`mhar bench --profile N`).
#   tools/bench_modes.sh SIZE [MODE ...]   e.g. tools/bench_modes.sh 1b standard mhar block_mhar
# (MODE names a config: standard attnres mhar block_mhar hyper hyper_dynamic delta)
# The first mode is the reference (default modes: standard mhar block_mhar). Writes
# bench.jsonl (one bench JSON line per mode and round) and profile.txt (the tables) into
# $OUT (relative to the current folder; default: the current folder); prints BENCH_MODES
# lines.
#   MHAR (default build-gpu/mhar), STEPS (10), WARMUP (3), PROFILE (0: none; first round)
#   ROUNDS (1): run the modes in turn that many times (A B A B ...) and report each mode's
#   median tokens/s and step time over the rounds, and the ratio of each round's pair:
#   the GPU's clock drifts between runs (the 1B step runs at the power cap), so
#   alternating rounds bound a ratio better than one run of each.
set -uo pipefail
caller_dir="$PWD"  # the default for $OUT: the folder it was called from, not the repo
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: tools/bench_modes.sh SIZE [MODE ...]" >&2; exit 2; }
size="$1"; shift
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(standard mhar block_mhar)
MHAR="${MHAR:-build-gpu/mhar}"
rounds="${ROUNDS:-1}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "bench_modes.sh: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
dir="${OUT:-$caller_dir}"; [[ "$dir" = /* ]] || dir="$caller_dir/$dir"
mkdir -p "$dir"
out="$dir/bench.jsonl"; prof="$dir/profile.txt"
: >"$out"; : >"$prof"
rc=0
for ((round = 1; round <= rounds; ++round)); do
  for mode in "${modes[@]}"; do
    cfg="configs/${size}_$mode.json"
    [ -e "$cfg" ] || { echo "BENCH_MODES $size $mode: no $cfg"; rc=1; continue; }
    args=(--steps "${STEPS:-10}" --warmup "${WARMUP:-3}")
    [ "${PROFILE:-0}" -gt 0 ] && [ "$round" = 1 ] && args+=(--profile "$PROFILE")
    echo "== $cfg (round $round)" >>"$prof"
    # One line per run, tagged with its round so that the summary pairs runs of a round.
    if line=$("$MHAR" --log-level warn bench "$cfg" "${args[@]}" 2>>"$prof") && [ -n "$line" ]; then
      printf '%s\n' "$line" | sed "s/^{/{\"bench_round\":$round,/" >>"$out"
    else
      echo "BENCH_MODES $size $mode (round $round) FAILED (see profile.txt)"; rc=1
    fi
  done
done
python3 - "$out" <<'PY' || rc=1
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not rows:
    sys.exit(1)
def name(r):
    return r["config"].split("/")[-1].removesuffix(".json")
by_mode = {}
for r in rows:
    by_mode.setdefault(name(r), []).append(r)
ref_name = name(rows[0])
ref = by_mode[ref_name]
med = lambda rs, k: statistics.median(r[k] for r in rs)
ref_tok, ref_peak = med(ref, "tokens_per_s"), max(r["peak_mem_bytes"] for r in ref)
ref_round = {r["bench_round"]: r["tokens_per_s"] for r in ref}  # each round's reference run
for mode, rs in by_mode.items():
    tok, peak = med(rs, "tokens_per_s"), max(r["peak_mem_bytes"] for r in rs)
    line = (f"BENCH_MODES {mode}: {tok:.0f} tok/s ({tok / ref_tok:.3f}x the first), "
            f"{med(rs, 'ms_per_step'):.1f} ms/step, peak {peak / 2**30:.2f} GiB "
            f"({peak / ref_peak:.3f}x), MFU {med(rs, 'mfu'):.3f}")
    if len(rs) > 1:
        # Each round's ratio against the reference's run of the same round.
        pairs = [r["tokens_per_s"] / ref_round[r["bench_round"]] for r in rs
                 if r["bench_round"] in ref_round]
        line += (f"; median of {len(rs)} rounds, the rounds' ratios "
                 + " ".join(f"{p:.3f}" for p in pairs))
    print(line)
PY
exit "$rc"
