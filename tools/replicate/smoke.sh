#!/usr/bin/env bash
# smoke.sh: the replication pipeline end to end on the CPU at a tiny scale (REPLICATE_TINY=1:
# the same run_grid.sh stages with a 4-layer d=64 model, 8 steps, shards from one corpus
# file): a 2-rate sweep (refused at the range's edge, then accepted), seed 0 of all five modes
# with the first run cut by a call's deadline and resumed by `next`, seed 1 of two modes, then
# make_table.py on the packed archive.
# Checks what each stage must leave behind and prints SMOKE ok / SMOKE FAILED.
#   MHAR=build-cpu/mhar MHAR_ASSETS=/work/main/assets tools/replicate/smoke.sh [WORK]
# (WORK default /tmp/mhar-replicate-smoke; about 3-5 minutes on 2 shared cores)
set -uo pipefail
cd "$(dirname "$0")/../.."
W="${1:-/tmp/mhar-replicate-smoke}"
[ -n "${MHAR:-}" ] && [ -x "$MHAR" ] || { echo "smoke: set MHAR to a built mhar (e.g. build-cpu/mhar)" >&2; exit 2; }
MHAR="$(cd "$(dirname "$MHAR")" && pwd)/$(basename "$MHAR")"
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
rm -rf "$W"; mkdir -p "$W"
export MHAR DEVICE=cpu REPLICATE_TINY=1 RUNS="$W/runs" SHARDS="$W/shards" OUT="$W/out"
fail() { echo "SMOKE FAILED: $*"; exit 1; }
G=tools/replicate/run_grid.sh
t0=$(date +%s)

# Two rates: the better is always at the range's edge, so the sweep must refuse to choose
# (exit 3) until told to accept it; accepting retrains nothing.
SWEEP_LRS_small="0.002 0.005" $G small sweep >"$W/sweep.log" 2>&1
rc=$?; [ "$rc" = 3 ] || { tail -20 "$W/sweep.log"; fail "sweep at the edge: exit $rc, not 3"; }
grep -q "^LR_AT_EDGE small" "$W/sweep.log" || fail "sweep printed no LR_AT_EDGE"
[ -e "$RUNS/lr_small.txt" ] && fail "an edge rate was written without ACCEPT_EDGE_LR"
ACCEPT_EDGE_LR=1 SWEEP_LRS_small="0.002 0.005" $G small sweep >"$W/sweep2.log" 2>&1 || fail "accepted sweep"
grep -q "^LR_CHOSEN small" "$W/sweep2.log" || fail "sweep printed no LR_CHOSEN"
[ "$(grep -c 'done already' "$W/sweep2.log")" = 2 ] || fail "the accepted sweep trained again"
[ -s "$RUNS/lr_small.txt" ] || fail "no lr_small.txt"
echo "sweep: $(grep '^SWEEP' "$W/sweep2.log"); $(grep '^LR_CHOSEN' "$W/sweep2.log")"

# A call whose deadline cuts the first run (SIGTERM after its first step: the step finishes, a
# checkpoint is written, and the next call resumes it).
CUT_AFTER_FIRST_STEP=1 $G small s0 standard >"$W/cut.log" 2>&1 && fail "the call was not cut"
grep -q "CUT at step" "$W/cut.log" || { tail -20 "$W/cut.log"; fail "no CUT line"; }
echo "cut: $(grep 'CUT at step' "$W/cut.log")"
# The rest through `next` (the next session's command), on a shortened stage list.
export GRID_STAGES="small sweep;small s0;small s1 standard mhar"
$G next >"$W/next.log" 2>&1 || { tail -30 "$W/next.log"; fail "next"; }
grep -q "GRID COMPLETE" "$W/next.log" || fail "next did not complete the grid"
grep -q "small_standard_s0: resuming from step" "$W/next.log" || fail "the cut run was not resumed"
[ "$(grep -c '"phase":"train"' "$RUNS/small_standard_s0/timing.jsonl")" = 2 ] || fail "timing.jsonl lacks the two train phases"
$G next >"$W/again.log" 2>&1 || fail "a finished grid called again"
[ "$(grep -c 'done already' "$W/again.log")" = 7 ] || fail "finished runs were not skipped"
# A fresh run that the finished runs say will not fit the time left is not started.
DEADLINE_S=8 MIN_TRAIN_S=1 $G small s2 standard >"$W/nofit.log" 2>&1 && fail "a run that cannot fit was started"
grep -q "small_standard_s2: its size's finished runs took up to" "$W/nofit.log" || { tail "$W/nofit.log"; fail "no fit message"; }
[ -e "$RUNS/small_standard_s2" ] && fail "the run that cannot fit left a folder"

for m in standard hyper attnres mhar block_mhar; do
  d="$RUNS/small_${m}_s0"
  for f in DONE eval_val.json eval_lambada.json eval_hellaswag.json eval_wikitext.json metrics.jsonl; do
    [ -s "$d/$f" ] || fail "$d/$f missing"
  done
done
for m in attnres mhar block_mhar; do [ -s "$RUNS/small_${m}_s0/probe/probe.json" ] || fail "no probe for $m"; done
[ -e "$RUNS/small_hyper_s0/probe" ] && fail "probe ran for hyper (not a routed mode)"
n_out=$(ls "$OUT" | wc -l)
[ "$n_out" -le 8 ] || fail "$n_out files in OUT (at most 8 come back)"
tar -tzf "$OUT/replicate_runs.tar.gz" | grep -q checkpoints && fail "checkpoints packed"

python3 tools/replicate/make_table.py --out "$W/report" "$OUT/replicate_runs.tar.gz" >"$W/table.log" 2>&1 ||
  { cat "$W/table.log"; fail "make_table"; }
grep -q '| small | standard | [0-9.]* ± [0-9.]* (n=2)' "$W/report/table.md" || fail "no two-seed row for standard"
ls "$W/report/depth_small_block_mhar_s0.svg" "$W/report/val_loss_small.svg" >/dev/null || fail "plots missing"
cat "$W/report/table.md" | sed -n '1,16p'
echo "SMOKE ok in $(( $(date +%s) - t0 )) s (work folder $W)"
