#!/usr/bin/env bash
# gpu_extra_checks.sh: the end-to-end checks that need the GPU machine's Python (torch,
# transformers, tokenizers) or a large model, run after tools/gpu_check.sh has built
# `mhar` into $BUILD_DIR (CHECKS="..." in gpu_check.sh's environment runs them there, in
# the same device call). Each stage prints one summary line "CHECK <name> ok|FAILED ...".
#   CHECKS   space-separated stages: eval probe export nccl (default: all)
#   WORK     scratch folder (default /tmp/mhar-checks)
# Stages:
#   eval     a tiny model trained on the CPU from text in this repository (tokenizer:
#            tests/fixtures/tokenizer/trained_4096.json); `mhar eval --task` on the
#            fixtures in tests/fixtures/eval against tools/reference/eval_tasks_ref.py
#            (PyTorch float64, Hugging Face tokenizers): accuracies equal, perplexities
#            within 1e-5 relative.
#   probe    a 1B mhar checkpoint (configs/1b_mhar.json, one optimizer step of one
#            micro-batch on the GPU) probed over 20 batches on the GPU; prints the time.
#   export   tools/hf/check_export.sh (issue 9).
#   nccl     tools/dp/check_nccl.sh (issue 16): through mpirun -np 1, training against
#            the single-process step and the bench's communicator overhead at 350M/1B.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-gpu}"
MHAR="$PWD/$BUILD_DIR/mhar"
WORK="${WORK:-/tmp/mhar-checks}"
CHECKS="${CHECKS:-eval probe export nccl}"
# Stage logs stay in $WORK/logs (the device tool returns only a few files); they are
# gathered into one extra.log under $OUT (or $BUILD_DIR/logs) at the end.
OUT_DIR="${OUT:-$BUILD_DIR/logs}"
LOG_DIR="$WORK/logs"
mkdir -p "$WORK" "$LOG_DIR" "$OUT_DIR"
status=0
has() { [[ " $CHECKS " == *" $1 "* ]]; }
say() { echo "CHECK $*"; }

# Shards from this repository's own text: enough tokens for the tiny model and for 20
# probe batches of 16 x 1024 (the probe reads the training shards: only its time counts).
TOK="$PWD/tests/fixtures/tokenizer/trained_4096.json"
make_shards() {
  [ -e "$WORK/shards/prepare.json" ] && return 0
  rm -rf "$WORK/text" && mkdir -p "$WORK/text"
  local i=0
  for rep in 1 2; do  # twice over, so that the probe has its 20 batches of training data
    git ls-files | grep -E '\.(md|cpp|h|cu|py|sh)$' | while read -r f; do
      i=$((i + 1)); cp "$f" "$WORK/text/$(printf '%s_%05d' "$rep" "$i").txt"
    done
  done
  "$MHAR" data prepare --tokenizer "$TOK" --input "$WORK/text" --out "$WORK/shards" \
    --val-fraction 0.1 --no-progress >"$LOG_DIR/extra_prepare.log" 2>&1
}

if has eval || has probe; then
  if ! make_shards; then
    tail -5 "$LOG_DIR/extra_prepare.log"; say "shards FAILED"; exit 1
  fi
fi

if has eval; then
  run="$WORK/run-eval"
  rm -rf "$run"
  if "$MHAR" train configs/quickstart.json --run-dir "$run" --device cpu \
       --set "data.train=$WORK/shards/train_*.bin" --set "data.val=$WORK/shards/val_*.bin" \
       --set "data.tokenizer=$TOK" --set train.steps=40 --set train.eval_every=40 \
       --set train.eval_batches=2 --set checkpoint.every=40 >"$LOG_DIR/extra_eval.log" 2>&1; then
    ok=1
    for t in lambada hellaswag wikitext; do
      f=tests/fixtures/eval/$t.jsonl; [ "$t" = wikitext ] && f=tests/fixtures/eval/wikitext.raw
      if "$MHAR" eval --checkpoint "$run" --task "$t" "$f" --device cpu >"$WORK/$t.json" 2>>"$LOG_DIR/extra_eval.log" &&
         python3 tools/reference/eval_tasks_ref.py --checkpoint "$run" --tokenizer "$TOK" --task "$t" "$f" \
           --compare "$WORK/$t.json" >>"$LOG_DIR/extra_eval.log" 2>&1; then
        say "eval-$t ok $(cat "$WORK/$t.json")"
      else
        ok=0; say "eval-$t FAILED (see extra_eval.log)"; tail -8 "$LOG_DIR/extra_eval.log"
      fi
      # The GPU (bf16) score of the same task, for information: not held to 1e-5.
      "$MHAR" eval --checkpoint "$run" --task "$t" "$f" --device cuda 2>/dev/null | sed "s/^/INFO eval-$t cuda: /"
    done
    [ $ok = 1 ] || status=1
  else
    tail -20 "$LOG_DIR/extra_eval.log"; say "eval FAILED (training the tiny model)"; status=1
  fi
fi

if has probe; then
  run="$WORK/run-1b"
  rm -rf "$run"
  start=$(date +%s)
  if "$MHAR" train configs/1b_mhar.json --run-dir "$run" --device cuda \
       --set "data.train=$WORK/shards/train_*.bin" --set "data.val=$WORK/shards/val_*.bin" \
       --set "data.tokenizer=$TOK" --set train.steps=1 --set train.batch_tokens=0 \
       --set train.warmup_steps=0 --set train.eval_batches=1 --set checkpoint.every=1 \
       >"$LOG_DIR/extra_probe.log" 2>&1; then
    echo "1B checkpoint written in $(( $(date +%s) - start )) s"
    start=$(date +%s.%N)
    if "$MHAR" probe --checkpoint "$run" --data "$WORK/shards/train_*.bin" --batches 20 --device cuda \
         --out "$WORK/probe-1b" >"$WORK/probe.json" 2>>"$LOG_DIR/extra_probe.log"; then
      secs=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
      say "probe-1b ok ${secs} s wall for 20 batches of 16 x 1024: $(head -c 300 "$WORK/probe.json")"
      cp "$WORK/probe-1b/probe.html" "$OUT_DIR/probe_1b.html" 2>/dev/null
    else
      tail -10 "$LOG_DIR/extra_probe.log"; say "probe-1b FAILED"; status=1
    fi
  else
    tail -20 "$LOG_DIR/extra_probe.log"; say "probe-1b FAILED (training one step)"; status=1
  fi
  rm -rf "$run"  # 12 GB of checkpoint
fi

# A stage that is a script of its own: it takes the binary from $MHAR (check_nccl.sh) or
# $MHAR_BIN (check_export.sh) and exits non-zero on any failure.
script_stage() {  # NAME SCRIPT LINES_SHOWN_ON_SUCCESS
  if MHAR="$MHAR" MHAR_BIN="$MHAR" bash "$2" >"$LOG_DIR/extra_$1.log" 2>&1; then
    say "$1 ok"; tail -"$3" "$LOG_DIR/extra_$1.log"
  else
    say "$1 FAILED"; tail -40 "$LOG_DIR/extra_$1.log"; status=1
  fi
}
has export && script_stage export tools/hf/check_export.sh 30
has nccl && script_stage nccl tools/dp/check_nccl.sh 20
for f in "$LOG_DIR"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done >"$OUT_DIR/extra.log" 2>/dev/null
exit $status
