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
#   Where `mhar bench` reads the GPU's energy counter, each line also has the mode's median
#   joules a step against the first mode's and its mean draw against the power limit.
#   POWER (0): 1 samples nvidia-smi's power draw and SM clock every 100 ms during each run
#   (power_<round>_<mode>.csv in $OUT) and adds their medians over the timed steps to the
#   line: the last steps x ms/step before the run's exit, less 0.3 s of teardown. Use
#   STEPS >= 10 at 1B so that the window holds enough samples. Why: the steps run at the
#   card's power limit (H100: 100M, 350M and 1B; cuda/NOTES.md, lead 0), so a kernel
#   faster at a fixed clock can lose in the step by lowering the clock of everything else.
set -uo pipefail
caller_dir="$PWD"  # the default for $OUT: the folder it was called from, not the repo
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: tools/bench_modes.sh SIZE [MODE ...]" >&2; exit 2; }
size="$1"; shift
modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(standard mhar block_mhar)
MHAR="${MHAR:-build-gpu/mhar}"
rounds="${ROUNDS:-1}"
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "bench_modes.sh: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
# Refused before $OUT's files are truncated, so that they keep the last run's results.
if [ "${POWER:-0}" = 1 ] && ! command -v nvidia-smi >/dev/null; then
  echo "bench_modes.sh: POWER=1 samples with nvidia-smi, which is not on PATH" >&2; exit 2
fi
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
    sampler=""; power_csv="$dir/power_${round}_$mode.csv"
    if [ "${POWER:-0}" = 1 ]; then
      nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm --format=csv,noheader,nounits \
        -lms 100 >"$power_csv" 2>/dev/null &
      sampler=$!
    fi
    # One line per run, tagged with its round so that the summary pairs runs of a round.
    line=$("$MHAR" --log-level warn bench "$cfg" "${args[@]}" 2>>"$prof"); run_rc=$?
    tag="\"bench_round\":$round,"
    if [ -n "$sampler" ]; then
      # nvidia-smi's own timestamp format, so that the window needs no time zone.
      tag+="\"power_csv\":\"$power_csv\",\"exit_stamp\":\"$(date '+%Y/%m/%d %H:%M:%S.%N')\","
      kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    fi
    if [ $run_rc = 0 ] && [ -n "$line" ]; then
      printf '%s\n' "$line" | sed "s|^{|{$tag|" >>"$out"
    else
      echo "BENCH_MODES $size $mode (round $round) FAILED (see profile.txt)"; rc=1
    fi
  done
done
python3 - "$out" <<'PY' || rc=1
import datetime, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not rows:
    sys.exit(1)
def stamp(text):
    return datetime.datetime.strptime(text.strip()[:26], "%Y/%m/%d %H:%M:%S.%f")
def power(r):
    """Median power (W) and SM clock (MHz) over the run's timed steps, or None."""
    if "power_csv" not in r:
        return None
    end = stamp(r["exit_stamp"]) - datetime.timedelta(seconds=0.3)
    start = end - datetime.timedelta(milliseconds=r["ms_per_step"] * r["steps_timed"])
    watts, mhz = [], []
    for row in open(r["power_csv"]):
        f = [x.strip() for x in row.split(",")]
        try:
            t, w, c = stamp(f[0]), float(f[1]), float(f[2])
        except (ValueError, IndexError):
            continue  # a line cut by the sampler's kill, or "[N/A]"
        if start <= t <= end:
            watts.append(w); mhz.append(c)
    return (statistics.median(watts), statistics.median(mhz), len(watts)) if watts else None
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
    if all("energy_j_per_step" in r for r in rs + ref):
        # `mhar bench`'s own energy counter (cuda/gpu_energy.h): joules a step bound the
        # step at the power limit, so each mode's against the first's.
        j, ref_j = med(rs, "energy_j_per_step"), med(ref, "energy_j_per_step")
        line += (f"; {j:.1f} J/step ({j / ref_j:.3f}x), {med(rs, 'power_w'):.0f} W"
                 f" of {med(rs, 'power_limit_w'):.0f}")
    sampled = [p for p in map(power, rs) if p]
    if sampled:
        line += ("; power W / SM MHz (samples) per run: "
                 + " ".join(f"{w:.0f}/{c:.0f}({n})" for w, c, n in sampled))
    print(line)
PY
exit "$rc"
