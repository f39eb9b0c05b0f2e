#!/usr/bin/env bash
# check_nccl.sh: data parallelism on the GPU machine (issue 16), after tools/gpu_check.sh
# has built `mhar` (CHECKS="nccl" there runs it through tools/gpu_extra_checks.sh; alone:
# MHAR=build-gpu/mhar bash tools/dp/check_nccl.sh). On one GPU, through mpirun -np 1 (the NCCL
# communicator, bucketed reduce-scatter on its stream during the backward, sharded AdamW,
# all-gather), against the same work without mpirun (the single-process step):
# 1. training: a small model on synthetic shards, twice without mpirun (the run-to-run
#    spread of the bf16 engine: its norm and embedding backward add with atomics), once
#    without mpirun in micro-batches of half the size (the same tokens and global batch,
#    the same computation in another rounding order: this spread never collapses to 0,
#    as two plain runs can), and once under mpirun -np NP, which is again the same
#    computation in another order (the gradient sums split over ranks); its losses must
#    stay within 4x the larger of the two spreads (max over steps of the relative loss
#    difference);
# 2. `mhar bench` at 350M and 1B under mpirun -np 1: every rank first times the
#    single-process step (baseline), then the NCCL step, in the same process;
#    comm_overhead = NCCL ms / baseline ms - 1 must stay below 2%.
# Also works with more GPUs: NP=2 (or more) runs the training comparison and the bench
# on NP ranks (the scaling efficiency is then tokens/s per GPU over one GPU alone).
# Prints DP_* summary lines (last), and everything the runs log, on stdout; exit 1 when a
# check fails.
#   MHAR   the binary (default $BUILD_DIR/mhar, BUILD_DIR default build-gpu)
#   NP     ranks (default 1)
#   SIZES  bench sizes (default "350m 1b"; empty: no bench), MODE (default mhar)
#   DEVICE cuda (default; cpu for a dry run of this script), STEPS training steps (60)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${BUILD_DIR:-build-gpu}"
MHAR="${MHAR:-$BUILD_DIR/mhar}"
NP="${NP:-1}"
SIZES="${SIZES-350m 1b}"
MODE="${MODE:-mhar}"
DEVICE="${DEVICE:-cuda}"
STEPS="${STEPS:-60}"
work=$(mktemp -d /tmp/mhar_dp_check.XXXXXX)
# Open MPI as root; NVLink multicast stays as the machine sets it (NCCL_NVLS_ENABLE=0).
# (ranks on this node inherit mpirun's environment).
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$NP")
rc=0

if ! command -v mpirun >/dev/null; then
  echo "DP_CHECK no mpirun on this machine: nothing to run"
  exit 1
fi

echo "== dp: synthetic shards"
python3 - "$work" <<'EOF'
import struct, random, sys
d = sys.argv[1]
def shard(path, n, seed, vocab=512):
    rng = random.Random(seed)
    t = [1]
    for _ in range(n - 1):  # a Markov chain: each token has two successors
        t.append((5 * t[-1] + 1 + 7 * rng.randrange(2)) % vocab)
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = 20240520, 1, n
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr))
        f.write(struct.pack("<%dH" % n, *t))
shard(f"{d}/train_000.bin", 2000000, 1)
shard(f"{d}/train_001.bin", 2000000, 2)
shard(f"{d}/val_000.bin", 40000, 3)
EOF
cat >"$work/cfg.json" <<EOF
{"model": {"vocab_size": 512, "d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
           "head_dim": 64, "d_ff": 768, "context_length": 256},
 "residual": {"mode": "$MODE", "heads": 4},
 "train": {"micro_batch": 8, "seq_len": 256, "batch_tokens": $((8 * 256 * 2 * NP)), "steps": $STEPS,
           "lr": 3e-3, "warmup_steps": 5, "eval_every": 30, "eval_batches": 4, "log_every": 20,
           "device": "$DEVICE", "seed": 3},
 "data": {"train": "$work/train_*.bin", "val": "$work/val_*.bin"},
 "checkpoint": {"every": 0, "keep": 1}}
EOF

echo "== dp: training, plain x2, plain in half micro-batches, and mpirun -np $NP"
"$MHAR" --log-level warn train "$work/cfg.json" --run-dir "$work/plain1" 2>&1 || rc=1
"$MHAR" --log-level warn train "$work/cfg.json" --run-dir "$work/plain2" 2>&1 || rc=1
"$MHAR" --log-level warn train "$work/cfg.json" --run-dir "$work/split" --set train.micro_batch=4 2>&1 || rc=1
timeout 300 "${MPIRUN[@]}" "$MHAR" --log-level info train "$work/cfg.json" --run-dir "$work/mpi" 2>&1 || rc=1
python3 - "$work" "$STEPS" <<'EOF' || rc=1
import json, sys
d, steps = sys.argv[1], int(sys.argv[2])
def losses(run):
    return [json.loads(l)["loss"] for l in open(f"{d}/{run}/metrics.jsonl") if '"train"' in l]
a, b, s, c = losses("plain1"), losses("plain2"), losses("split"), losses("mpi")
rel = lambda x, y: max(abs(p - q) / abs(q) for p, q in zip(x, y))
rerun, reorder, diff = rel(b, a), rel(s, a), rel(c, a)
bound = 4 * max(rerun, reorder)
ok = len(a) == len(b) == len(s) == len(c) == steps and reorder > 0 and diff <= bound
print(f"DP_TRAIN {steps} steps, loss {a[0]:.4f} -> {a[-1]:.4f}; plain vs plain {rerun:.2e}, half "
      f"micro-batches vs plain {reorder:.2e}, mpirun vs plain {diff:.2e} (bound {bound:.2e}): "
      f"{'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF

echo "== dp: bench under mpirun -np $NP"
for size in $SIZES; do
  cfg="configs/${size}_${MODE}.json"
  timeout 400 "${MPIRUN[@]}" "$MHAR" --log-level warn bench "$cfg" --steps 20 --warmup 3 --device "$DEVICE" \
    >"$work/bench_$size.json" || { rc=1; continue; }
  cat "$work/bench_$size.json"
  python3 - "$work/bench_$size.json" "$size" "$NP" <<'EOF' || rc=1
import json, sys
j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
np_ = int(sys.argv[3])
ok = j["comm_overhead"] < 0.02 if np_ == 1 else True
print(f"DP_BENCH {sys.argv[2]} ranks {j['ranks']} ({j['communicator']}): {j['ms_per_step']:.1f} ms/step "
      f"vs {j['baseline_ms_per_step']:.1f} alone, overhead {100 * j['comm_overhead']:+.2f}%, "
      f"{j['tokens_per_s']:.0f} tok/s per GPU, {j['tokens_per_s_total']:.0f} total, scaling "
      f"efficiency {j['scaling_efficiency']:.3f}, peak {j['peak_mem_bytes'] / 2**30:.1f} GiB per GPU"
      + (f": {'PASS' if ok else 'FAIL'} (< 2%)" if np_ == 1 else ""))
sys.exit(0 if ok else 1)
EOF
done
rm -rf "$work"
exit "$rc"
