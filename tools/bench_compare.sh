#!/usr/bin/env bash
# bench_compare.sh: our `mhar bench` against the PyTorch baseline
# (tools/reference/bench_step.py: bf16 autocast, torch.compile, SDPA flash, fused AdamW)
# for `standard` and `mhar` at the paper's shapes (configs/{100m,350m,1b}_{standard,mhar}.json:
# 100M micro-batch 8 x 2048, 350M and 1B 16 x 1024), on the GPU machine. Prints a table of
# tokens/s, peak memory, and the ratios ours/PyTorch and mhar/standard (also as markdown
# into $OUT/bench_table.md when OUT is set), and keeps every JSON line.
#
#   tools/bench_compare.sh [--mhar BIN] [--deadline SECONDS] [--after FILE] [--sizes "100m 350m 1b"]
#                          [--modes "standard mhar"]
#
# How it fits a ~7 minute budget: torch.compile costs ~50-95 s per model at 100M (more at
# 350M and 1B, and the mhar graphs grow with the number of routing sites), so every
# PyTorch job starts at once, as far as GPU memory allows, and compiles concurrently;
# only the timed regions take turns, through one file lock that our runs take too, so no
# two timed steps ever share the GPU. Memory: each job reserves an estimate of its peak
# (below) against 93% of the card (140 GB of an H200, 80 of an H100); a job starts only
# when its reservation fits, and a PyTorch job only when the next run of ours would still
# fit beside it (on an H100, PyTorch's 350M mhar waits for our runs).
# Our runs go one at a time (--after FILE: wait until FILE exists first, e.g. for a build
# still running). At --deadline (seconds from start, default 420) jobs still running are
# stopped and reported as "timeout"; jobs never started are "not run". Each run: 3 warm-up
# steps, then the median of 10 timed steps (PyTorch: after its compiling step).
set -uo pipefail
cd "$(dirname "$0")/.."
MHAR_BIN="build-gpu/mhar"
DEADLINE=420
AFTER=""
SIZES="100m 350m 1b"
MODES="standard mhar"
while [ $# -gt 0 ]; do
  case "$1" in
    --mhar) MHAR_BIN="$2"; shift 2 ;;
    --deadline) DEADLINE="$2"; shift 2 ;;
    --after) AFTER="$2"; shift 2 ;;
    --sizes) SIZES="$2"; shift 2 ;;
    --modes) MODES="$2"; shift 2 ;;
    *) echo "bench_compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# tools/gpu_check.sh unpacks the carried ICU here; `mhar` needs it on the loader path.
[ -d /tmp/mhar-icu/lib ] && export LD_LIBRARY_PATH="/tmp/mhar-icu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LOG_DIR="${OUT:-build-gpu/logs}"
mkdir -p "$LOG_DIR"
export MHAR_BIN DEADLINE AFTER SIZES MODES LOG_DIR PYTHONUNBUFFERED=1

python3 - <<'PY'
import fcntl, json, os, shlex, subprocess, sys, time

start = time.time()
deadline = start + float(os.environ["DEADLINE"])
log_dir = os.environ["LOG_DIR"]
mhar = os.environ["MHAR_BIN"]
after = os.environ["AFTER"]
sizes = os.environ["SIZES"].split()
modes = os.environ["MODES"].split()
for flag, given, valid in (("--sizes", sizes, ("100m", "350m", "1b")),
                           ("--modes", modes, ("standard", "mhar"))):
    bad = [x for x in given if x not in valid]
    if bad or not given:
        sys.exit(f"bench_compare.sh: {flag} {' '.join(given)!r}: "
                 f"{'unknown ' + ', '.join(bad) if bad else 'empty'}; valid: {' '.join(valid)}")
lock = os.path.join("/tmp", f"mhar_bench_lock_{os.getpid()}")
open(lock, "w").close()
results_path = os.path.join(log_dir, "bench_results.jsonl")
log_path = os.path.join(log_dir, "bench_jobs.log")
open(results_path, "w").close()
logf = open(log_path, "w")

def say(msg):
    line = f"[bench_compare {time.time() - start:6.1f}s] {msg}"
    print(line, flush=True)
    logf.write(line + "\n"); logf.flush()

# Peak-memory reservations in GB (estimates from the memory plans and the PyTorch numbers
# measured at 100M; PyTorch's mhar saves a stacked copy of the sources at every site, so
# its activations grow with sources x sites, quadratically in depth: ~113 GB of them at 1B,
# which does not fit beside its ~46 GB standard part).
TORCH_GB = {("100m", "standard"): 13, ("100m", "mhar"): 19, ("350m", "standard"): 26,
            ("350m", "mhar"): 66, ("1b", "standard"): 46, ("1b", "mhar"): 160}
OURS_GB = {("100m", "standard"): 14, ("100m", "mhar"): 15, ("350m", "standard"): 36,
           ("350m", "mhar"): 38, ("1b", "standard"): 65, ("1b", "mhar"): 70}
# The budget: 93% of the card's memory (140 GB of an H200's ~150, 80 of an H100's ~85), read
# from nvidia-smi, so that every reservation and the allocator's slack fit.
def card_gb():
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"]
    try:
        return float(subprocess.run(query, capture_output=True, text=True,
                                    check=True).stdout.split()[0]) * 1.048576e-3  # MiB -> GB
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError) as e:
        sys.exit(f"bench_compare.sh: cannot read the GPU's memory ({' '.join(query)}): {e}")
BUDGET_GB = 0.93 * card_gb()
# Priority order: PyTorch jobs first where they fit (they compile for minutes), ours as
# soon as the binary exists, one at a time; a PyTorch job starts only if the next pending
# run of ours still fits beside it.
ORDER = [("torch", "100m", "standard"), ("torch", "100m", "mhar"), ("torch", "350m", "standard"),
         ("torch", "350m", "mhar"), ("ours", "100m", "standard"), ("ours", "100m", "mhar"),
         ("ours", "350m", "standard"), ("ours", "350m", "mhar"), ("ours", "1b", "standard"),
         ("ours", "1b", "mhar"), ("torch", "1b", "standard"), ("torch", "1b", "mhar")]

jobs = []
for kind, size, mode in ORDER:
    if size not in sizes or mode not in modes:
        continue
    cfg = f"configs/{size}_{mode}.json"
    if kind == "torch":
        jobs.append(dict(kind="torch", size=size, mode=mode, gb=TORCH_GB[(size, mode)],
                         cmd=["python3", "tools/reference/bench_step.py", cfg, "--steps", "10",
                              "--warmup", "3", "--lock", lock]))
    else:
        jobs.append(dict(kind="ours", size=size, mode=mode, gb=OURS_GB[(size, mode)],
                         cmd=["flock", lock, mhar, "--log-level", "warn", "bench", cfg, "--steps",
                              "10", "--warmup", "3", "--device", "cuda"]))
for j in jobs:
    j.update(state="pending", proc=None, out=None, result=None, t0=None)

def next_ours_gb():
    return next((j["gb"] for j in jobs if j["kind"] == "ours" and j["state"] == "pending"), 0)

def reserved():
    return sum(j["gb"] for j in jobs if j["state"] == "running")

def ours_ready():
    return not after or os.path.exists(after)

def launch(j):
    j["out"] = open(os.path.join("/tmp", f"bench_{j['kind']}_{j['size']}_{j['mode']}.out"), "w+")
    j["proc"] = subprocess.Popen(j["cmd"], stdout=j["out"], stderr=subprocess.STDOUT, text=True)
    j["state"], j["t0"] = "running", time.time()
    say(f"start {j['kind']:5s} {j['size']:4s} {j['mode']:8s} (reserve {j['gb']} GB, "
        f"{reserved()} GB reserved): {shlex.join(j['cmd'])}")

def finish(j, rc):
    j["out"].seek(0)
    text = j["out"].read()
    logf.write(f"----- {j['kind']} {j['size']} {j['mode']} rc={rc} ({time.time() - j['t0']:.0f}s)\n{text}\n")
    logf.flush()
    lines = [l for l in text.splitlines() if l.startswith("{")]
    if rc == 0 and lines:
        try:
            j["result"] = json.loads(lines[-1])
            j["state"] = "done"
            with open(results_path, "a") as f:
                f.write(json.dumps({"kind": j["kind"], "size": j["size"], "mode": j["mode"],
                                    **j["result"]}) + "\n")
        except json.JSONDecodeError:
            j["state"] = "failed"
    else:
        tail = " | ".join(text.strip().splitlines()[-3:])[-300:]
        j["state"] = "oom" if "out of memory" in text.lower() else "failed"
        j["error"] = tail
    say(f"end   {j['kind']:5s} {j['size']:4s} {j['mode']:8s}: {j['state']} after "
        f"{time.time() - j['t0']:.0f}s" + (f" ({j.get('error', '')})" if j['state'] != 'done' else ""))

while True:
    now = time.time()
    for j in jobs:
        if j["state"] == "running":
            rc = j["proc"].poll()
            if rc is not None:
                finish(j, rc)
            elif now > deadline:
                j["proc"].kill()
                j["proc"].wait()
                j["state"] = "timeout"
                say(f"deadline: stopped {j['kind']} {j['size']} {j['mode']}")
    if now > deadline or all(j["state"] not in ("pending", "running") for j in jobs):
        break
    # PyTorch jobs start as soon as their memory fits (compiling is the long part).
    for j in jobs:
        if j["kind"] == "torch" and j["state"] == "pending" and j["gb"] > BUDGET_GB:
            j["state"] = "not run"
            j["error"] = f"estimated peak {j['gb']} GB exceeds the card"
            say(f"skip  torch {j['size']} {j['mode']}: {j['error']}")
        if (j["kind"] == "torch" and j["state"] == "pending"
                and reserved() + j["gb"] + next_ours_gb() <= BUDGET_GB):
            launch(j)
    # Ours one at a time, in order, when built and when memory fits.
    if ours_ready() and not any(j["kind"] == "ours" and j["state"] == "running" for j in jobs):
        for j in jobs:
            if j["kind"] == "ours" and j["state"] == "pending":
                if reserved() + j["gb"] <= BUDGET_GB:
                    launch(j)
                break
    time.sleep(1)
for j in jobs:
    if j["state"] == "pending":
        j["state"] = "not run"

# ---- the table
def get(size, mode, kind):
    for j in jobs:
        if (j["size"], j["mode"], j["kind"]) == (size, mode, kind):
            return j
def tok(j):
    return j["result"]["tokens_per_s"] if j and j["state"] == "done" else None
def mem(j):
    return j["result"].get("peak_mem_bytes") if j and j["state"] == "done" else None
def fmt_tok(j):
    return f"{tok(j):,.0f}" if tok(j) else (j["state"] if j else "-")
def fmt_mem(j):
    m = mem(j)
    return f"{m / 1e9:.1f}" if m else "-"
def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"

hdr = ("| size | mode | ours tok/s | PyTorch tok/s | ours/PyTorch | ours ms/step | PyTorch ms/step "
       "| ours peak GB | PyTorch peak GB | ours MFU | PyTorch MFU | mhar/standard ours | mhar/standard PyTorch |")
rows = [hdr, "|" + "---|" * 13]
for size in sizes:
    for mode in ("standard", "mhar"):
        o, t = get(size, mode, "ours"), get(size, mode, "torch")
        os_, ts_ = get(size, "standard", "ours"), get(size, "standard", "torch")
        ms = lambda j: f"{j['result']['ms_per_step']:.1f}" if j and j["state"] == "done" else "-"
        mfu = lambda j: f"{j['result']['mfu']:.3f}" if j and j["state"] == "done" else "-"
        rows.append(f"| {size} | {mode} | {fmt_tok(o)} | {fmt_tok(t)} | {ratio(tok(o), tok(t))} | {ms(o)} "
                    f"| {ms(t)} | {fmt_mem(o)} | {fmt_mem(t)} | {mfu(o)} | {mfu(t)} "
                    f"| {ratio(tok(o), tok(os_)) if mode == 'mhar' else ''} "
                    f"| {ratio(tok(t), tok(ts_)) if mode == 'mhar' else ''} |")
table = "\n".join(rows)
notes = []
for j in jobs:
    if j["state"] != "done":
        notes.append(f"- {j['kind']} {j['size']} {j['mode']}: {j['state']} {j.get('error', '')}".rstrip())
peak_note = ("Peak memory: ours = the most device memory the backend held from cudaMalloc "
             "(arenas, cuBLAS workspace, attention scratch); PyTorch = "
             "torch.cuda.max_memory_allocated. Neither counts the CUDA context.")
text = table + "\n\n" + peak_note + ("\n\n" + "\n".join(notes) if notes else "") + "\n"
print("\n" + text)
with open(os.path.join(log_dir, "bench_table.md"), "w") as f:
    f.write(text)
say(f"total {time.time() - start:.0f}s")
PY
