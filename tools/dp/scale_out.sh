#!/usr/bin/env bash
# scale_out.sh: data parallelism measured on a machine of several GPUs (issue 17), after
# tools/gpu_check.sh has built `mhar` (MHAR=build-gpu/mhar bash tools/dp/scale_out.sh).
# Stages (STAGES, default "bench match long"), each ending in SCALE_* summary lines:
#   bench  `mpirun -np NP mhar bench` at 350M and 1B, standard and mhar: tokens/s per GPU
#          at NP GPUs and alone (the bench times every rank alone first, in the same
#          process), scaling efficiency, the share of the step spent on exposed
#          communication, per-GPU peak memory against one GPU's, and the memory ZeRO-1
#          saves as a share of one GPU's optimizer state (at NP >= 2 it must be at least
#          40%: the ideal is 1 - 1/NP of it).
#   match  tools/dp/check_nccl.sh at NP ranks, 20 steps, no bench: the NP-GPU losses
#          against one GPU accumulating the same global batch, bound derived there.
#   long   1B mhar from the Qwen3 shards in $SHARDS (train_*.bin, val_*.bin): a 300-step
#          run on NP GPUs with a checkpoint at step 200; rank 1 is killed (SIGKILL) once
#          step KILL_AT is logged; the job must end by itself; then the run resumes on one
#          GPU (no mpirun; the optimizer state is re-sharded) from the step-200 checkpoint
#          and finishes the 300 steps. Prints both loss curves where they overlap.
# Logs of every run go to $OUT/scale.log (or $BUILD_DIR/logs/scale.log).
#   MHAR (default $BUILD_DIR/mhar, BUILD_DIR default build-gpu), NP (default: the GPUs
#   nvidia-smi lists), SHARDS (default .scale/qwen3), KILL_AT (default 220); for a dry run
#   of this script on the CPU: DEVICE=cpu NP=2 SIZES=quickstart MODES=mhar
#   LONG_CONFIG=<a small config with a Qwen3-sized vocabulary> LONG_MICRO=2 LONG_SEQ=64
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
BUILD_DIR="${BUILD_DIR:-build-gpu}"
MHAR="${MHAR:-$REPO/$BUILD_DIR/mhar}"
NP="${NP:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}"
STAGES="${STAGES:-bench match long}"
SHARDS="${SHARDS:-$REPO/.scale/qwen3}"
KILL_AT="${KILL_AT:-220}"
DEVICE="${DEVICE:-cuda}"
SIZES="${SIZES:-350m 1b}"
MODES="${MODES:-standard mhar}"
LONG_CONFIG="${LONG_CONFIG:-configs/1b_mhar.json}"
LONG_MICRO="${LONG_MICRO:-8}"
LONG_SEQ="${LONG_SEQ:-1024}"
LOG_DIR="${OUT:-$BUILD_DIR/logs}"
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/scale.log"
work=$(mktemp -d /tmp/mhar_scale.XXXXXX)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$NP")
has() { [[ " $STAGES " == *" $1 "* ]]; }
rc=0
[ "$NP" -ge 1 ] 2>/dev/null || { echo "SCALE no GPU found (NP=$NP)"; exit 1; }
echo "== scale_out: $NP GPU(s), stages: $STAGES" | tee -a "$LOG"

if has bench; then
  for size in $SIZES; do
    for mode in $MODES; do
      out="$work/bench_${size}_$mode.json"
      cfg=(configs/"${size}_$mode.json")  # or a config of any mode, set to this one
      [ -e "${cfg[0]}" ] || cfg=("configs/$size.json" --set "residual.mode=$mode")
      echo "== bench ${cfg[*]} on $NP GPU(s)" >>"$LOG"
      if ! timeout 300 "${MPIRUN[@]}" "$MHAR" --log-level warn bench "${cfg[@]}" \
           --steps 10 --warmup 3 --device "$DEVICE" >"$out" 2>>"$LOG"; then
        echo "SCALE_BENCH $size $mode FAILED (see scale.log)"; rc=1; continue
      fi
      cat "$out" >>"$LOG"
      python3 - "$out" "$size" "$mode" <<'PY' || rc=1
import json, sys
j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
n = j["ranks"]
alone_peak, peak = j["baseline_peak_mem_bytes"], max(j["peak_mem_bytes_per_rank"])
opt1 = j["baseline_optimizer_state_bytes"]
saved_share = (alone_peak - peak) / opt1
ok = n < 2 or saved_share >= 0.40
G = 2 ** 30
print(f"SCALE_BENCH {sys.argv[2]} {sys.argv[3]} gpus {n}: {j['tokens_per_s']:.0f} tok/s per GPU "
      f"(alone {j['baseline_tokens_per_s']:.0f}), total {j['tokens_per_s_total']:.0f}, efficiency "
      f"{j['scaling_efficiency']:.4f}, exposed comm {100 * j['exposed_comm_share']:.2f}% of the step, "
      f"peak {peak / G:.2f} GiB per GPU (alone {alone_peak / G:.2f}), optimizer state {opt1 / G:.2f} GiB alone, "
      f"{j['optimizer_state_bytes'] / G:.2f} per GPU; saved {100 * saved_share:.1f}% of it"
      + (f": {'PASS' if ok else 'FAIL'} (>= 40%)" if n >= 2 else ""))
sys.exit(0 if ok else 1)
PY
    done
  done
fi

if has match; then
  echo "== match: check_nccl.sh NP=$NP STEPS=20" >>"$LOG"
  NP="$NP" STEPS=20 SIZES="" MHAR="$MHAR" DEVICE="$DEVICE" bash tools/dp/check_nccl.sh >"$work/match.log" 2>&1 || rc=1
  cat "$work/match.log" >>"$LOG"
  grep -E "^DP_TRAIN" "$work/match.log" | sed 's/^DP_TRAIN/SCALE_MATCH/' || { echo "SCALE_MATCH FAILED"; rc=1; }
fi

if has long; then
  run="$work/long"
  if ! ls "$SHARDS"/train_*.bin >/dev/null 2>&1; then
    echo "SCALE_LONG FAILED: no Qwen3 shards in $SHARDS (tools/dp/make_scale_shards.sh makes them)"; rc=1
  else
    sets=(--set "data.train=$SHARDS/train_*.bin" --set "data.val=$SHARDS/val_*.bin" --set data.tokenizer=qwen3
          --set train.micro_batch=$LONG_MICRO --set train.seq_len=$LONG_SEQ
          --set train.batch_tokens=$((LONG_MICRO * LONG_SEQ * NP)) --set train.steps=300 --set train.device=$DEVICE
          --set train.warmup_steps=30 --set train.eval_every=100 --set train.eval_batches=4
          --set train.log_every=10 --set checkpoint.every=200 --set checkpoint.keep=2)
    echo "== long: 1B mhar, 300 steps on $NP GPU(s), kill rank 1 after step $KILL_AT" >>"$LOG"
    t0=$(date +%s)
    "${MPIRUN[@]}" "$MHAR" --log-level info train "$LONG_CONFIG" --run-dir "$run" "${sets[@]}" \
      >"$work/long_np.log" 2>&1 &
    job=$!
    killed=""
    while kill -0 "$job" 2>/dev/null; do
      if [ -z "$killed" ] && [ -e "$run/metrics.jsonl" ] &&
         python3 - "$run/metrics.jsonl" "$KILL_AT" 2>/dev/null <<'PY'; then
import json, sys
steps = [j["step"] for j in map(json.loads, open(sys.argv[1])) if j.get("kind") == "train"]
sys.exit(0 if steps and max(steps) >= int(sys.argv[2]) else 1)
PY
        for p in $(pgrep -x mhar); do
          if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1"; then
            kill -KILL "$p" && killed="$p" && echo "killed rank 1 (pid $p) at $(( $(date +%s) - t0 )) s" >>"$LOG"
          fi
        done
        t_kill=$(date +%s)
      fi
      if [ -n "$killed" ] && [ $(( $(date +%s) - t_kill )) -gt 180 ]; then
        echo "the job outlived its killed rank by 180 s: stopping it" >>"$LOG"; kill -KILL "$job"; rc=1
      fi
      sleep 2
    done
    wait "$job"; job_rc=$?
    cat "$work/long_np.log" >>"$LOG"
    ended="$(( $(date +%s) - ${t_kill:-$t0} ))"
    echo "SCALE_LONG_KILL rank 1 killed: ${killed:-no}; the $NP-GPU job exited $job_rc ${ended} s later; checkpoints: $(ls -d "$run"/checkpoints/step_* 2>/dev/null | xargs -n1 basename | tr '\n' ' ')"
    [ -n "$killed" ] && [ "$job_rc" != 0 ] || rc=1
    cp "$run/metrics.jsonl" "$work/metrics_np.jsonl" 2>/dev/null
    echo "== long: resume on one GPU" >>"$LOG"
    if "$MHAR" --log-level info train --resume "$run" >"$work/long_1.log" 2>&1; then r1=0; else r1=$?; fi
    cat "$work/long_1.log" >>"$LOG"
    grep -iE "re-shard|resum" "$work/long_1.log" | head -3 | sed 's/^/SCALE_LONG_LOG /'
    python3 - "$work/metrics_np.jsonl" "$run/metrics.jsonl" "$r1" "$NP" <<'PY' || rc=1
import json, sys
def rows(path):
    out = {}
    for l in open(path):
        try: j = json.loads(l)
        except ValueError: continue
        out.setdefault(j.get("kind"), {})[j.get("step")] = j
    return out
before, after, r1, np_ = rows(sys.argv[1]), rows(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tb, ta = before.get("train", {}), after.get("train", {})
# Steps the killed job logged past the checkpoint the resume starts from (200), logged
# again by the one-GPU continuation.
common = sorted(s for s in tb if s > 200 and s in ta)
diffs = [abs(ta[s]["loss"] - tb[s]["loss"]) / abs(tb[s]["loss"]) for s in common]
last = max(ta) if ta else 0
evals = {s: round(v["val_loss"], 4) for s, v in sorted(after.get("eval", {}).items())}
curve = " ".join(f"{s}:{ta[s]['loss']:.3f}" for s in sorted(ta) if s % 50 == 0)
ok = r1 == 0 and last == 300 and all(x == x for x in diffs)
print(f"SCALE_LONG loss every 50 steps {curve}; val {evals}")
print(f"SCALE_LONG resumed on 1 GPU from the {np_}-GPU step-200 checkpoint: exit {r1}, last step {last}; "
      f"steps {common[0] if common else '-'}..{common[-1] if common else '-'} logged by both: "
      f"max rel loss diff {max(diffs) if diffs else float('nan'):.2e}, mean {sum(diffs) / max(1, len(diffs)):.2e}"
      f": {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  fi
fi
rm -rf "$work"
exit "$rc"
