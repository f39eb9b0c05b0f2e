#!/usr/bin/env bash
# run_grid.sh: runs one slice of the Table 1 replication grid (issue 15, REPLICATION.md) on
# the GPU machine, one device call (<= 10 minutes) at a time, and packs what the runs wrote
# into $OUT. It owns the grid's run protocol: build, data, the learning-rate sweep, train
# (resuming a cut run), held-out evaluation, routing probe, per-run timings.
#   tools/replicate/run_grid.sh SIZE sweep                 the lr sweep of `standard` at SIZE
#   tools/replicate/run_grid.sh SIZE sSEED [MODE ...]      full runs (default: all five modes)
#   tools/replicate/run_grid.sh data                       only build + shards + task files
#   tools/replicate/run_grid.sh next                       the whole grid in order (small sweep,
#       large sweep, small s0, small s1, large s0), as far as the call's time allows; call it
#       again until it prints GRID COMPLETE (exit 3: a sweep's best rate is at its range's edge)
# SIZE: small | large (configs/replicate/SIZE_MODE.json); MODE: standard hyper attnres mhar
# block_mhar; SEED: 0, 1, ... (train.seed = 1234 + SEED, the same for every mode, so a seed
# fixes the init draw and the data order for the whole size).
# Every stage is idempotent: a finished run (its DONE file) is skipped, a cut run resumes
# from its newest checkpoint (`mhar train --resume`), a finished run missing its evaluation
# gets only that. So the same command, called again, continues where the last call stopped.
# Environment:
#   DEADLINE_S   seconds after start at which training is told to stop (SIGTERM: it finishes
#                the step, checkpoints and exits 0) so that packing fits the device call
#                (default 540; the device tool stops a command at 600)
#   LR_SMALL / LR_LARGE   the learning rate of every full run of a size; else the rate the
#                sweep wrote into $RUNS/lr_SIZE.txt; a full run refuses to start without one
#   MHAR         the binary (default: build-gpu/mhar, built here with CUDA when missing)
#   EVAL_MIN_S   a finished run's evaluation is not started with fewer seconds left (60)
#   MIN_TRAIN_S  a run is not started (or resumed) with fewer seconds than this left (30)
#   DEVICE       cuda | cpu | auto (default auto)
#   RUNS         run folders (default runs/replicate); SHARDS (default assets/shards/gpt2)
#   CUT_AFTER_FIRST_STEP=1   (tests) stop each training like a deadline after its first step
#   GRID_STAGES  the stages of `next`, ';'-separated (default
#                "small sweep;large sweep;small s0;small s1;large s0"; a stage may name modes)
#   REPLICATE_TINY=1   the same code path with tiny models, steps, data and evaluation
#                (the CPU smoke test, tools/replicate/smoke.sh)
# Data: the shards are made here when missing, from .replicate/assets.tar.xz (carry it:
# tools/replicate/pack_assets.sh makes it from $MHAR_ASSETS: the corpus and the GPT-2
# tokenizer; the GPU machine has no network) or from ${MHAR_ASSETS:-assets}/corpus/train.
# Earlier calls: carried .replicate/results/*.tar.gz (their replicate_runs.tar.gz) are unpacked
# into $RUNS first, so finished runs and the chosen rates survive a fresh machine.
# Output ($OUT or runs/replicate/out): replicate_runs.tar.gz (every run folder of $RUNS
# without checkpoints: config.json, metrics.jsonl, eval_*.json, probe/probe.json,
# timing.jsonl, DONE; lr_*.txt and sweep_*.txt) and grid.log: 2 files, within the 8.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
DEADLINE_S="${DEADLINE_S:-540}"
TINY="${REPLICATE_TINY:-0}"
RUNS="${RUNS:-runs/replicate}"
SHARDS="${SHARDS:-assets/shards/gpt2}"
DEVICE="${DEVICE:-auto}"
OUT_DIR="${OUT:-$RUNS/out}"
export MHAR_ASSETS="${MHAR_ASSETS:-$PWD/assets}"
mkdir -p "$RUNS" "$OUT_DIR" "$SHARDS"
SHARDS="$(cd "$SHARDS" && pwd)"
LOG="$OUT_DIR/grid.log"
exec > >(tee -a "$LOG") 2>&1
say() { echo "[grid $(now)s] $*"; }
[ $# -ge 1 ] || { echo "usage: tools/replicate/run_grid.sh next | SIZE sweep | SIZE sSEED [MODE ...] | data" >&2; exit 2; }

# Results of earlier calls: a fresh machine has no runs/, so the archives earlier calls returned
# (copied by the session into .replicate/results/, carried) put back every run's record, and
# finished runs (DONE) are not trained again. Files already here (a warm machine) are kept.
for f in .replicate/results/*.tar.gz; do
  [ -e "$f" ] || continue
  tar -xzf "$f" -C "$RUNS" --skip-old-files || echo "[grid] could not unpack $f"
done

pack() {
  tar -czf "$OUT_DIR/replicate_runs.tar.gz" -C "$RUNS" --exclude=checkpoints --exclude=out . \
    && say "packed $(du -h "$OUT_DIR/replicate_runs.tar.gz" | cut -f1) into $OUT_DIR/replicate_runs.tar.gz"
}
trap pack EXIT

# ---- build (the GPU machine is bare: configure and build `mhar` with CUDA, ICU carried)
if [ -z "${MHAR:-}" ]; then
  MHAR="$PWD/build-gpu/mhar"
  export PATH="/usr/local/cuda/bin:$PATH"
  if ! command -v mpicxx >/dev/null; then
    for d in /usr/local/mpi/bin /opt/hpcx/ompi/bin /opt/openmpi/bin; do
      [ -x "$d/mpicxx" ] && export PATH="$d:$PATH" && break
    done
  fi
  icu_args=()
  if [ ! -e /usr/include/unicode/utypes.h ] && [ -e .icu/icu72.tar.xz ]; then
    icu=/tmp/mhar-icu
    [ -d "$icu/lib" ] || { mkdir -p "$icu" && tar -xJf .icu/icu72.tar.xz -C "$icu"; }
    icu_args=("-DICU_ROOT=$icu")
    export LD_LIBRARY_PATH="$icu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  say "building $MHAR"
  if ! { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHAR_BUILD_TESTS=OFF \
           -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" "${icu_args[@]}" &&
         cmake --build build-gpu -j "$(nproc)" --target mhar; } >"$RUNS/build.log" 2>&1; then
    grep -E "error|FAILED" "$RUNS/build.log" | head -30; say "BUILD FAILED"; exit 1
  fi
  say "built"
fi
[ -x "$MHAR" ] || { say "no mhar binary at $MHAR"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# ---- data: GPT-2 shards (2% of the documents held out whole) and the task files made from
# the held-out documents minus any passage sharing a 13-word run with training text.
if [ ! -e "$SHARDS/prepare.json" ]; then
  if [ -e .replicate/assets.tar.xz ] && [ ! -e "$MHAR_ASSETS/corpus/train" ]; then
    say "unpacking .replicate/assets.tar.xz into $MHAR_ASSETS"
    mkdir -p "$MHAR_ASSETS" && tar -xJf .replicate/assets.tar.xz -C "$MHAR_ASSETS" || exit 1
  fi
  input="$MHAR_ASSETS/corpus/train"
  [ "$TINY" = 1 ] && input="$MHAR_ASSETS/corpus/train/brown.jsonl"
  say "preparing $SHARDS from $input"
  "$MHAR" data prepare --tokenizer gpt2 --input "$input" --out "$SHARDS" --val-fraction 0.02 \
    --no-progress || { say "DATA PREPARE FAILED"; exit 1; }
fi
EVALSETS="$SHARDS/eval-sets"
if [ ! -e "$EVALSETS/wikitext.raw" ]; then
  items=1000; [ "$TINY" = 1 ] && items=10
  "$MHAR" data make-eval --shards "$SHARDS" --out "$EVALSETS" --items "$items" ||
    say "make-eval failed: the runs get validation loss only"
fi
[ "$1" = data ] && exit 0

# Tiny: the same stages on a model the CPU trains in seconds (heads stay a divisor of d_model).
tiny_set=()
if [ "$TINY" = 1 ]; then
  tiny_set=(--set model.d_model=64 --set model.n_layers=4 --set model.n_heads=4 --set model.n_kv_heads=2
            --set model.head_dim=16 --set model.d_ff=128 --set model.context_length=64
            --set train.seq_len=64 --set train.micro_batch=4 --set train.batch_tokens=512
            --set "train.steps=${TINY_STEPS:-8}" --set train.warmup_steps=3 --set train.eval_every=4
            --set train.eval_batches=2 --set train.log_every=4 --set checkpoint.every=4)
fi
cfg_value() {  # cfg_value FILE section.field: the value in the config file (no default)
  python3 -c 'import json,sys; s,f=sys.argv[2].split("."); print(json.load(open(sys.argv[1]))[s].get(f, 0))' "$1" "$2"
}
done_step() {  # the step of the newest complete checkpoint of a run folder (0: none)
  python3 - "$1" <<'PY'
import glob, json, sys
best = 0
for p in glob.glob(sys.argv[1] + "/checkpoints/step_*/state.json"):
    try:
        best = max(best, int(json.load(open(p))["step"]))
    except Exception:
        pass
print(best)
PY
}

expected_s() {  # the longest train + evaluation time of the finished runs of NAME's size (0: none)
  python3 - "$RUNS" "$1" <<'PY'
import glob, json, os, sys
runs, name = sys.argv[1], sys.argv[2]
size = name.split("/")[-1].split("_")[0]
pattern = f"{runs}/sweep/{size}_lr*" if "/" in name else f"{runs}/{size}_*_s*"
best = 0
for d in glob.glob(pattern):
    if os.path.exists(d + "/DONE"):
        try:
            best = max(best, sum(json.loads(l).get("seconds", 0) for l in open(d + "/timing.jsonl") if l.strip()))
        except (OSError, ValueError):
            pass
print(int(best * 1.1))
PY
}

# One run: train (or resume) under the deadline, then evaluation and probe when finished.
# Returns 0 when the run is complete, 1 when it was cut or failed (the caller stops there).
one_run() {
  local name="$1" cfg="$2" steps="$3"; shift 3
  local dir="$RUNS/$name" mode; mode=$(cfg_value "$cfg" residual.mode)
  local tiny_heads=()
  [ "$TINY" = 1 ] && [ "$mode" = mhar ] && tiny_heads=(--set residual.heads=2)
  [ -e "$dir/DONE" ] && { say "$name: done already"; return 0; }
  local step; step=$(done_step "$dir")
  if [ "$step" -lt "$steps" ]; then
    local left=$(( DEADLINE_S - $(now) ))
    [ "$left" -gt "${MIN_TRAIN_S:-30}" ] || { say "$name: no time left in this call; call again to continue"; return 1; }
    # A fresh run that the finished runs of its size say will not fit is left to the next call:
    # a run cut and resumed costs a restart, and its checkpoints do not survive a fresh machine.
    local need; need=$(expected_s "$name")
    if [ "$step" = 0 ] && [ "$need" -gt 0 ] && [ "$left" -lt "$need" ]; then
      say "$name: its size's finished runs took up to ${need}s with evaluation, ${left}s left: call again to start it"
      return 1
    fi
    local args
    if [ "$step" -gt 0 ]; then
      say "$name: resuming from step $step (train stops at +${left}s)"
      args=(train --resume "$dir")
    else
      rm -rf "$dir"; mkdir -p "$(dirname "$dir")"
      say "$name: training $cfg $* (train stops at +${left}s)"
      args=(train "$cfg" --run-dir "$dir" --device "$DEVICE" --set "data.train=$SHARDS/train_*.bin"
            --set "data.val=$SHARDS/val_*.bin" "${tiny_set[@]}" "${tiny_heads[@]}" "$@")
    fi
    local t=$(date +%s)
    timeout -s TERM -k 90 "$left" "$MHAR" --log-level warn "${args[@]}" >"$RUNS/$name.train.log" 2>&1 &
    local tpid=$!
    if [ "${CUT_AFTER_FIRST_STEP:-0}" = 1 ]; then
      # Test hook (smoke.sh): a call's deadline arriving right after the first logged step, by the
      # same signal (timeout passes SIGTERM on to the trainer), whatever the machine's speed.
      while kill -0 "$tpid" 2>/dev/null; do
        grep -q '"kind":"train"' "$dir/metrics.jsonl" 2>/dev/null && { kill -TERM "$tpid"; break; }
        sleep 0.1
      done
    fi
    wait "$tpid"
    local rc=$? secs=$(( $(date +%s) - t ))
    cat "$RUNS/$name.train.log" >>"$dir/train.log" 2>/dev/null
    local end; end=$(done_step "$dir")
    echo "{\"phase\":\"train\",\"seconds\":$secs,\"exit\":$rc,\"from_step\":$step,\"to_step\":$end}" >>"$dir/timing.jsonl"
    say "$name: train exit $rc after ${secs}s, step $step -> $end of $steps"
    if [ "$end" -lt "$steps" ]; then
      tail -5 "$RUNS/$name.train.log"
      if [ "$rc" = 0 ] || [ "$rc" = 124 ] || [ "$rc" = 137 ] || [ "$rc" = 143 ]; then
        say "$name: CUT at step $end; the same command resumes it"
      else
        say "$name: FAILED (exit $rc, log $dir/train.log)"
      fi
      return 1
    fi
  fi
  # Held-out evaluation: the validation shards whole, then the task files. Not started when
  # the call is nearly over: a command killed at the device's limit would return nothing.
  if [ "$(( DEADLINE_S - $(now) ))" -lt "${EVAL_MIN_S:-60}" ]; then
    say "$name: trained; no time left in this call for its evaluation; call again"; return 1
  fi
  local ev_batches=(); [ "$TINY" = 1 ] && ev_batches=(--batches 4)
  local t=$(date +%s)
  if [ ! -s "$dir/eval_val.json" ]; then
    "$MHAR" --log-level warn eval --checkpoint "$dir" --data "$SHARDS/val_*.bin" --device "$DEVICE" \
      "${ev_batches[@]}" >"$dir/eval_val.tmp" 2>>"$dir/eval.log" && mv "$dir/eval_val.tmp" "$dir/eval_val.json" ||
      { say "$name: eval FAILED (see eval.log)"; return 1; }
  fi
  if [ -e "$EVALSETS/wikitext.raw" ] && [ "${SWEEP:-0}" = 0 ]; then
    for task in lambada:lambada.jsonl hellaswag:hellaswag.jsonl wikitext:wikitext.raw; do
      local tn="${task%%:*}"
      [ -s "$dir/eval_$tn.json" ] && continue
      "$MHAR" --log-level warn eval --checkpoint "$dir" --task "$tn" "$EVALSETS/${task#*:}" --device "$DEVICE" \
        >"$dir/eval_$tn.tmp" 2>>"$dir/eval.log" && mv "$dir/eval_$tn.tmp" "$dir/eval_$tn.json" ||
        { say "$name: task $tn FAILED (see eval.log)"; return 1; }
    done
  fi
  if [ "${SWEEP:-0}" = 0 ] && { [ "$mode" = attnres ] || [ "$mode" = mhar ]; } && [ ! -s "$dir/probe/probe.json" ]; then
    local pb=20; [ "$TINY" = 1 ] && pb=2
    "$MHAR" --log-level warn probe --checkpoint "$dir" --data "$SHARDS/val_*.bin" --batches "$pb" \
      --out "$dir/probe" --device "$DEVICE" >>"$dir/eval.log" 2>&1 ||
      { say "$name: probe FAILED (see eval.log)"; return 1; }
  fi
  echo "{\"phase\":\"eval\",\"seconds\":$(( $(date +%s) - t ))}" >>"$dir/timing.jsonl"
  date -u +%FT%TZ >"$dir/DONE"
  say "$name: DONE: $(cat "$dir/eval_val.json")"
  return 0
}

size_steps() {
  if [ "$TINY" = 1 ]; then echo "${TINY_STEPS:-8}"; else cfg_value "configs/replicate/$1_standard.json" train.steps; fi
}

# The lr sweep: `standard` at a quarter of the steps (warmup and cosine scaled with them), each
# rate once; the chosen rate is the one with the lowest final validation loss. It is written to
# lr_SIZE.txt only when it is inside the swept range (ACCEPT_EDGE_LR=1 takes an edge rate):
# exit 0 chosen, 1 cut or failed, 3 at the edge.
run_sweep() {
  local size="$1" var="SWEEP_LRS_$1" steps; steps=$(size_steps "$1")
  local default_lrs="0.001 0.002 0.003 0.005"; [ "$size" = large ] && default_lrs="0.0005 0.001 0.002 0.003"
  local lrs; read -r -a lrs <<<"${!var:-$default_lrs}"
  local sweep_steps=$(( steps / 4 )) warm
  warm=$(cfg_value "configs/replicate/${size}_standard.json" train.warmup_steps)
  [ "$TINY" = 1 ] && warm=3
  local sweep_warm=$(( warm / 4 > 1 ? warm / 4 : 1 ))
  for lr in "${lrs[@]}"; do
    SWEEP=1 one_run "sweep/${size}_lr$lr" "configs/replicate/${size}_standard.json" "$sweep_steps" \
      --set "train.lr=$lr" --set "train.steps=$sweep_steps" --set "train.warmup_steps=$sweep_warm" || return 1
  done
  ACCEPT_EDGE_LR="${ACCEPT_EDGE_LR:-0}" python3 - "$RUNS" "$size" "${lrs[@]}" <<'PY'
import json, os, sys
runs, size, lrs = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = sorted(((json.load(open(f"{runs}/sweep/{size}_lr{lr}/eval_val.json"))["loss"], lr) for lr in lrs),
              key=lambda r: float(r[1]))
best = min(rows)
with open(f"{runs}/sweep_{size}.txt", "w") as f:
    f.writelines(f"{lr} {loss:.4f}\n" for loss, lr in rows)
edge = len(lrs) > 1 and best[1] in (rows[0][1], rows[-1][1])
print(f"SWEEP {size}: " + ", ".join(f"lr {lr}: {loss:.4f}" for loss, lr in rows))
if edge and os.environ["ACCEPT_EDGE_LR"] != "1":
    print(f"LR_AT_EDGE {size} {best[1]}: the best rate is at the edge of the swept range; sweep more rates "
          f"(SWEEP_LRS_{size}=\"...\", the finished ones are kept) or set ACCEPT_EDGE_LR=1")
    sys.exit(3)
with open(f"{runs}/lr_{size}.txt", "w") as f:
    f.write(best[1] + "\n")
print(f"LR_CHOSEN {size} {best[1]}" + (" (at the edge of the swept range, accepted)" if edge else ""))
PY
}

# Full runs of one seed: exit 0 all finished, 1 one was cut or failed, 2 bad arguments.
run_seed() {
  local size="$1" seed="$2"; shift 2
  local modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=(standard hyper attnres mhar block_mhar)
  local var="LR_${size^^}" steps; steps=$(size_steps "$size")
  local lr="${!var:-}"
  [ -n "$lr" ] || lr=$(cat "$RUNS/lr_$size.txt" 2>/dev/null || true)
  [ -n "$lr" ] || { say "no learning rate for $size: run 'run_grid.sh $size sweep' first or set $var"; return 2; }
  say "$size seed $seed: lr $lr, modes ${modes[*]}"
  for mode in "${modes[@]}"; do
    local cfg="configs/replicate/${size}_$mode.json"
    [ -e "$cfg" ] || { say "no $cfg (modes: standard hyper attnres mhar block_mhar)"; return 2; }
    one_run "${size}_${mode}_s$seed" "$cfg" "$steps" --set "train.lr=$lr" --set "train.seed=$(( 1234 + seed ))" ||
      return 1
  done
}

if [ "$1" = next ]; then
  # The whole grid in its order; each call does what its time allows and the next call goes on.
  IFS=';' read -r -a stages <<<"${GRID_STAGES:-small sweep;large sweep;small s0;small s1;large s0}"
  for stage in "${stages[@]}"; do
    set -- $stage
    if [ "$2" = sweep ]; then
      [ -s "$RUNS/lr_$1.txt" ] && continue
      run_sweep "$1" || exit $?
    else
      size="$1" seed="${2#s}"; shift 2
      run_seed "$size" "$seed" "$@" || exit $?
    fi
  done
  say "GRID COMPLETE"
  exit 0
fi
size="$1"; shift
[ -e "configs/replicate/${size}_standard.json" ] || { say "unknown size '$size' (small or large)"; exit 2; }
[ $# -ge 1 ] || { say "say 'sweep' or a seed (s0, s1, ...) after the size"; exit 2; }
if [ "$1" = sweep ]; then
  run_sweep "$size"; exit $?
fi
[[ "$1" =~ ^s([0-9]+)$ ]] || { say "seed must look like s0, s1: got '$1'"; exit 2; }
seed="${BASH_REMATCH[1]}"; shift
run_seed "$size" "$seed" "$@"
exit $?
