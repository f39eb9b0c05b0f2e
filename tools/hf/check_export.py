#!/usr/bin/env python3
# check_export.py: the "Done when" checks of issue 9 (Hugging Face export and import),
# run against transformers on a machine with PyTorch (tools/hf/check_export.sh builds
# `mhar` and calls this). Every figure it prints comes from a run here:
#
#   1. A small corpus (Python's own docstrings, deterministic) -> three tokenizers (GPT-2,
#      Qwen3, and one trained by `mhar data train-tokenizer`) -> shards (`mhar data prepare`)
#      -> tiny models trained for 30 steps on the CPU, one per residual scheme (RUNS):
#      standard (GPT-2, tied), attnres (Qwen3, untied), mhar (H=4, trained tokenizer, tied),
#      block_mhar (H=2, block_size 3, untied), hyper (n=4 static, tied), hyper_dynamic
#      (n=3 dynamic, untied), delta (H=2, block_layers 1, tied), the last four on the
#      trained tokenizer.
#   2. Each exported (fp32; attnres also sharded; bf16; every model_type "mhar" export
#      also imported back by `mhar import`, tensors bit for bit) and loaded with
#      transformers (stock Qwen3ForCausalLM without trust_remote_code for standard; the
#      exported modeling_mhar.py with trust_remote_code=True for the others):
#      - every tensor loaded bit for bit;
#      - fp32 logits vs `mhar eval --logits-out` (the engine's CPU forward): max over
#        positions of max|diff| / max|mhar logit| <= 1e-5 (SDPA and eager attention);
#        the check sees the scheme: its own parameters put back at their init (queries,
#        delta gates zeroed; Hyper-Connection coefficients reset) move the logits > 1e-3;
#      - mean loss over the validation windows vs `mhar eval`: |diff| <= 1e-5;
#      - 32 greedy tokens of generate() (KV cache) vs `mhar sample --temperature 0` on the
#        CPU for three prompts; a divergence is allowed only where transformers' top two
#        logits are within 1e-4 (reported); the cached logits equal a full forward's; a
#        left-padded batch generates what single prompts do;
#      - bf16 export: every tensor is the round-to-nearest-even of the fp32 one, and its
#        bf16 logits/loss deviate from fp32 by at most 2x what a stochastically rounded
#        bf16 copy of the same weights deviates (the measured bf16 noise, 3 draws);
#      - AutoTokenizer ids == `mhar data encode` ids on held-out text.
#   3. Import: Qwen3ForCausalLM from a small Qwen3Config (random init, norms perturbed;
#      tied and untied; saved sharded; also bf16 and fp16 copies) -> `mhar import` ->
#      `mhar eval` loss == transformers' within 1e-5; `mhar export` of the import equals
#      the original tensors bit for bit.
# Prints a table; exits 1 if any check fails.
#
#   python3 tools/hf/check_export.py --mhar build-hf/mhar --work build-hf/hf_check [--log-dir DIR]
#   --skip-hf: run only the mhar side (for a machine without transformers)
import argparse
import array
import copy
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import traceback

RESULTS = []  # (section, check, ok, figure, bound, note)
LOG = None


def log(*parts):
    text = " ".join(str(p) for p in parts)
    print(text, flush=True)
    if LOG:
        LOG.write(text + "\n")
        LOG.flush()


def record(section, check, ok, figure="", bound="", note=""):
    RESULTS.append((section, check, bool(ok), str(figure), str(bound), str(note)))
    log(f"[{'PASS' if ok else 'FAIL'}] {section}: {check}: {figure}" + (f" (bound {bound})" if bound else "")
        + (f" -- {note}" if note else ""))


def section(name, fn, *args):
    """Runs one group of checks; an exception fails the group with its traceback."""
    log(f"\n=== {name}")
    t0 = time.time()
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - every failure is reported, the others still run
        log(traceback.format_exc())
        record(name, "completed", False, f"{type(e).__name__}: {str(e)[:300]}")
        return None
    finally:
        log(f"--- {name}: {time.time() - t0:.1f} s")


# ------------------------------------------------------------------ mhar and files

MHAR = None
WORK = None


def mhar(*args, timeout=600):
    cmd = [MHAR, "--log-level", "warn", *[str(a) for a in args]]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    if LOG:
        LOG.write(f"$ {' '.join(cmd)}  [exit {p.returncode}, {time.time() - t0:.1f} s]\n")
        LOG.write(p.stderr.decode("utf-8", "replace")[-4000:] + "\n")
        LOG.flush()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr.decode('utf-8', 'replace')[-3000:]}")
    return p


def mhar_json(*args):
    out = mhar(*args).stdout.decode().strip().splitlines()
    return json.loads(out[-1])


def read_safetensors(path):
    """A safetensors file (or a directory's model.safetensors / sharded index) as
    {name: torch tensor} and the header metadata; written from the format itself."""
    import torch
    if os.path.isdir(path):
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(single):
            return read_safetensors(single)
        index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
        out, meta = {}, None
        for f in sorted(set(index["weight_map"].values())):
            part, meta = read_safetensors(os.path.join(path, f))
            out.update(part)
        return out, meta
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I32": torch.int32, "I64": torch.int64}
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        b0, b1 = e["data_offsets"]
        buf = bytearray(raw[8 + n + b0:8 + n + b1])
        t = torch.frombuffer(buf, dtype=dtypes[e["dtype"]]) if buf else torch.empty(0, dtype=dtypes[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out, meta


def raw_tensors(path):
    """A single safetensors file as {name: (dtype, shape, bytes)}, without torch."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (e["dtype"], tuple(e["shape"]), raw[8 + n + e["data_offsets"][0]:8 + n + e["data_offsets"][1]])
            for k, e in header.items()}


def read_shard_tokens(paths):
    """The llm.c shards (256 int32 header; uint16 or uint32 tokens) as one stream."""
    stream = []
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        magic, version, count = struct.unpack("<3i", data[:12])
        if (magic, version) == (20240520, 1):
            a = array.array("H")
        elif (magic, version) == (20240801, 7):
            a = array.array("I")
        else:
            raise ValueError(f"{p}: not an llm.c shard (magic {magic}, version {version})")
        a.frombytes(data[1024:1024 + count * a.itemsize])
        stream.extend(a)
    return stream


def eval_windows(stream, B, T, max_batches):
    """`mhar eval`'s windows (data/loader.h, sequential): window k = stream[k*T : k*T+T+1],
    batch g = windows g*B .. g*B+B-1, only full batches."""
    import torch
    n_batches = ((len(stream) - 1) // T) // B
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    for g in range(n_batches):
        rows = [stream[(g * B + b) * T:(g * B + b) * T + T + 1] for b in range(B)]
        w = torch.tensor([list(r) for r in rows], dtype=torch.long)
        yield w[:, :-1], w[:, 1:]


def byte_decoder():
    """GPT-2's byte-level alphabet, reversed: the character of a token string -> its byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes_table(tokenizer_json):
    j = json.load(open(tokenizer_json, encoding="utf-8"))
    dec = byte_decoder()
    table = {}
    for tok, i in j["model"]["vocab"].items():
        table[i] = bytes(dec[ch] if ch in dec else ord(ch) for ch in tok) if all(ch in dec for ch in tok) \
            else tok.encode("utf-8")
    for a in j.get("added_tokens", []):
        table[a["id"]] = a["content"].encode("utf-8")
    return table


# ------------------------------------------------------------------ corpus and runs

HELD_OUT_EXTRA = [
    "naïve café — déjà vu; Grüße aus Köln. 東京は日本の首都です。 Привет, мир! 🙂👍 ½ ¾ x² ∑∫",
    "Tabs\tand  double  spaces   and trailing   \n\n\nnew lines\r\nand CRLF.",
    "Numbers: 1234567 3.14159 1e-10 0x1F 2024-11-30 12:34:56, 99.9% of $1,000,000.",
    "def f(x):\n    return x ** 2  # square\n\nclass A(object):\n    pass\n",
    "HELLO hello HeLLo; don't I'll we've they're it's O'Neil's",
    "e\u0301 (decomposed) vs \u00e9 (composed); Å vs A\u030a; ﬁ ligature; Ｆｕｌｌ width",
]


def build_corpus(work):
    """Documents from Python's own docstrings (deterministic for a Python version): the
    training corpus and, apart from it, held-out text for the tokenizer check."""
    import importlib
    import inspect
    names = ["argparse", "ast", "asyncio.events", "bisect", "calendar", "collections", "configparser",
             "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
             "enum", "fractions", "functools", "heapq", "http.client", "inspect", "ipaddress",
             "itertools", "json", "logging", "os", "pathlib", "pickle", "pprint", "queue", "random",
             "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
             "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile"]
    docs = []
    for name in names:
        try:
            mod = importlib.import_module(name)
            members = [v for _, v in sorted(inspect.getmembers(mod), key=lambda kv: kv[0])]
        except Exception:  # noqa: BLE001 - a module missing or odd on this Python is skipped
            continue
        seen = set()
        for obj in [mod] + members:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj) or
                                          inspect.isfunction(obj) or inspect.isbuiltin(obj)) else None
            if doc and len(doc) >= 200 and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    held_out = docs[-12:] + HELD_OUT_EXTRA
    docs = docs[:-12]
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    for i, d in enumerate(docs):
        with open(os.path.join(corpus, f"doc_{i:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(d)
    held = os.path.join(work, "heldout")
    os.makedirs(held, exist_ok=True)
    paths = []
    for i, d in enumerate(held_out):
        p = os.path.join(held, f"held_{i:02d}.txt")
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(d)
        paths.append(p)
    nbytes = sum(len(d.encode()) for d in docs)
    log(f"corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB; held out: {len(paths)} texts")
    return corpus, paths


RUNS = [  # name, residual.mode, tokenizer, model vocab, tied, further residual.* fields
    ("standard", "standard", "gpt2", 50304, True, {}),
    ("attnres", "attnres", "qwen3", 151936, False, {"heads": 1}),
    ("mhar", "mhar", "trained", 512, True, {"heads": 4}),
    # 2 layers = 4 sublayers: blocks of 3 give a closed block and a partial one.
    ("block_mhar", "mhar", "trained", 512, False, {"heads": 2, "block_size": 3}),
    ("hyper", "hyper", "trained", 512, True, {"hyper_n": 4}),
    ("hyper_dynamic", "hyper", "trained", 512, False, {"hyper_n": 3, "hyper_dynamic": True}),
    ("delta", "delta", "trained", 512, True, {"heads": 2, "block_layers": 1}),
]
T_SEQ, B_EVAL, MAX_EVAL_BATCHES = 64, 4, 32


def prepare_tokenizers(work, corpus):
    trained = os.path.join(work, "tok512", "tokenizer.json")
    os.makedirs(os.path.dirname(trained), exist_ok=True)
    mhar("data", "train-tokenizer", "--vocab", 512, "--input", corpus, "--out", trained, "--threads", 0)
    tokenizers = {"gpt2": "gpt2", "qwen3": "qwen3", "trained": trained}
    for tok, name in tokenizers.items():
        mhar("data", "prepare", "--tokenizer", name, "--input", corpus, "--out", os.path.join(work, f"shards_{tok}"),
             "--val-docs", 40, "--no-progress")
    return tokenizers


def train_run(work, tokenizers, name, mode, tok, vocab, tied, residual):
    shards = os.path.join(work, f"shards_{tok}")
    cfg = {
        "model": {"vocab_size": vocab, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "head_dim": 16, "d_ff": 128, "context_length": 128, "tie_embeddings": tied},
        "residual": {"mode": mode, **residual},
        "train": {"micro_batch": 4, "seq_len": T_SEQ, "steps": 30, "lr": 1e-2, "warmup_steps": 3,
                  "eval_every": 30, "eval_batches": 2, "log_every": 10, "device": "cpu", "seed": 7},
        "data": {"train": os.path.join(shards, "train_*.bin"), "val": os.path.join(shards, "val_*.bin"),
                 "tokenizer": tokenizers[tok]},
        "checkpoint": {"every": 0, "keep": 1},
    }
    cfg_path = os.path.join(work, f"{name}.json")
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    run_dir = os.path.join(work, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    mhar("train", cfg_path, "--run-dir", run_dir)
    evals = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"eval"' in l]
    log(f"trained {name} ({mode} {residual}): {time.time() - t0:.1f} s, val loss {evals[0]['val_loss']:.4f} -> "
        f"{evals[-1]['val_loss']:.4f}")
    record(name, "training lowered the validation loss", evals[-1]["val_loss"] < evals[0]["val_loss"],
           f"{evals[0]['val_loss']:.4f} -> {evals[-1]['val_loss']:.4f} in 30 steps")
    return {"name": name, "mode": mode, "remote": mode != "standard", "tok_name": tok,
            "tokenizer": tokenizers[tok], "vocab": vocab, "tied": tied,
            "run": run_dir, "val": cfg["data"]["val"]}


def export_run(work, r):
    mode = r["name"]
    exp = os.path.join(work, "exports")
    r["fp32"] = os.path.join(exp, f"{mode}_fp32")
    r["bf16"] = os.path.join(exp, f"{mode}_bf16")
    for d in (r["fp32"], r["bf16"]):
        shutil.rmtree(d, ignore_errors=True)
    args = ["--checkpoint", r["run"], "--out", r["fp32"], "--dtype", "fp32"]
    if mode == "attnres":  # routed and sharded: the remote-code path reads an index
        args += ["--max-shard-size", "4MB"]
    log(mhar("export", *args).stdout.decode().rstrip())
    mhar("export", "--checkpoint", r["run"], "--out", r["bf16"], "--dtype", "bf16")
    files = sorted(os.listdir(r["fp32"]))
    log(f"{mode} export: {files}")
    if mode == "attnres":
        n = sum(f.endswith(".safetensors") for f in files)
        record(mode, "export is sharded with an index", "model.safetensors.index.json" in files and n > 1, f"{n} shards")
    # The engine's own numbers: eval over the validation windows, and logits of the first
    # windows.
    r["eval"] = mhar_json("eval", "--checkpoint", r["run"], "--data", r["val"], "--device", "cpu",
                          "--batch-size", B_EVAL, "--seq-len", T_SEQ, "--batches", MAX_EVAL_BATCHES)
    logits_file = os.path.join(work, f"{mode}_logits.safetensors")
    mhar("eval", "--checkpoint", r["run"], "--data", r["val"], "--device", "cpu", "--batch-size", 2,
         "--seq-len", T_SEQ, "--batches", 2, "--logits-out", logits_file)
    r["logits_file"] = logits_file
    log(f"{mode}: mhar eval loss {r['eval']['loss']:.6f} over {r['eval']['tokens']} tokens")
    if r["remote"]:  # an mhar export imports back to the checkpoint it came from
        imp = os.path.join(work, "imports", mode)
        shutil.rmtree(imp, ignore_errors=True)
        mhar("import", "--hf", r["fp32"], "--out", imp)
        ckpts = sorted(glob.glob(os.path.join(r["run"], "checkpoints", "step_*")))
        src = raw_tensors(os.path.join(ckpts[-1], "model.safetensors"))
        back = raw_tensors(os.path.join(imp, "checkpoints", "step_00000000", "model.safetensors"))
        bad = sorted(n for n in src if back.get(n) != src[n]) + sorted(set(back) - set(src))
        record(mode, "mhar import of the export == checkpoint, bit for bit", not bad, f"{len(src)} tensors",
               note=f"differ: {bad[:5]}" if bad else "")


# ------------------------------------------------------------------ transformers side

def load_hf(path, dtype, remote, **kw):
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=remote, **kw)
    except TypeError as e:  # transformers without the `dtype` argument
        if "dtype" not in str(e):
            raise
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, trust_remote_code=remote, **kw)


def scheme_to_init(model, mode):
    """Puts the residual scheme's own parameters of a loaded mhar model back at their
    init (where they carry no information): routing queries zeroed (uniform mixing),
    delta gates zeroed (the standard model), Hyper-Connection coefficients reset (the
    pre-norm residual). Returns what was done, for the record."""
    import torch
    with torch.no_grad():
        if mode == "hyper":
            for m in model.modules():
                if type(m).__name__ == "MharHyperConnection":
                    m.reset_parameters()
            return "Hyper-Connection coefficients reset to their init"
        suffix = ".alpha" if mode == "delta" else ".query"
        for n, p in model.named_parameters():
            if n.endswith(suffix):
                p.zero_()
        return "delta gates alpha zeroed" if mode == "delta" else "queries zeroed"


def loading_info_problems(info, tied):
    def get(k):
        v = info.get(k) if isinstance(info, dict) else getattr(info, k, None)
        return sorted(v) if v else []
    missing = [k for k in get("missing_keys") if not (tied and k == "lm_head.weight")]
    return {"missing": missing, "unexpected": get("unexpected_keys"), "mismatched": [str(m) for m in get("mismatched_keys")]}


def rel_err_per_position(a, b):
    """max|a - b| / max|b| over the vocabulary, per position (float64)."""
    a, b = a.double(), b.double()
    return (a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30)


def hf_logits(model, ids, attention_mask=None):
    import torch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attention_mask).logits.float()


def mean_loss(model, stream, B, T, batches):
    """Mean cross-entropy (float64 from the model's logits) over `mhar eval`'s windows."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    for x, y in eval_windows(stream, B, T, batches):
        logits = hf_logits(model, x).double()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return total / count, count


def token_losses(logits, targets):
    import torch.nn.functional as F
    return F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def engine_logits(r):
    """The windows `mhar eval --logits-out` wrote: input ids, targets, the engine's logits."""
    lf, _ = read_safetensors(r["logits_file"])
    return lf["input_ids"].long(), lf["targets"].long(), lf["logits"]


def check_load_and_logits(r):
    import torch
    from transformers import AutoConfig
    mode, routed, tied = r["name"], r["remote"], r["tied"]
    exp = r["fp32"]
    cfg = json.load(open(os.path.join(exp, "config.json")))
    record(mode, "config model_type", cfg["model_type"] == ("mhar" if routed else "qwen3"),
           f"{cfg['model_type']}" + (f", auto_map {sorted(cfg.get('auto_map', {}))}" if routed else ""))
    if routed:  # a stock loader must refuse it rather than silently drop the routing
        try:
            AutoConfig.from_pretrained(exp, trust_remote_code=False)
            refused, why = False, "loaded without trust_remote_code"
        except Exception as e:  # noqa: BLE001
            refused, why = True, f"{type(e).__name__}: {str(e)[:120]}"
        record(mode, "refused without trust_remote_code", refused, why)

    model, info = load_hf(exp, torch.float32, routed, output_loading_info=True)
    model.eval()
    want = "MharForCausalLM" if routed else "Qwen3ForCausalLM"
    record(mode, "loads as", type(model).__name__ == want, type(model).__name__)
    problems = loading_info_problems(info, tied)
    record(mode, "no missing/unexpected/mismatched keys", not any(problems.values()), problems)
    weights, meta = read_safetensors(exp)
    sd = model.state_dict()
    bad = [n for n, t in weights.items() if n not in sd or not torch.equal(sd[n].cpu().contiguous().view(torch.int32),
                                                                         t.contiguous().view(torch.int32))]
    record(mode, "every tensor loaded bit for bit", not bad, f"{len(weights)} tensors", note=f"differ: {bad[:5]}" if bad else "")
    record(mode, "safetensors metadata format", meta.get("format") == "pt", meta)
    try:
        from safetensors import safe_open
        first = next(f for f in sorted(os.listdir(exp)) if f.endswith(".safetensors"))
        with safe_open(os.path.join(exp, first), framework="pt") as f:
            record(mode, "safetensors library reads the export", (f.metadata() or {}).get("format") == "pt",
                   f"{first}: {len(list(f.keys()))} tensors")
    except ImportError:
        log("(safetensors package not installed: skipped its read-back)")

    # fp32 logits vs the engine's CPU forward.
    ids, targets, ref = engine_logits(r)
    out = hf_logits(model, ids)
    rel = rel_err_per_position(out, ref)
    record(mode, "fp32 logits vs mhar CPU forward (max over positions, relative)", rel.max().item() <= 1e-5,
           f"{rel.max().item():.3e} over {rel.numel()} positions, max|diff| "
           f"{(out.double() - ref.double()).abs().max().item():.3e}", "1e-5")
    if routed:
        # The attention without SDPA (attn_implementation="eager") gives the same.
        eager = load_hf(exp, torch.float32, True, attn_implementation="eager").eval()
        rel_e = rel_err_per_position(hf_logits(eager, ids), ref)
        record(mode, "eager attention logits vs mhar", rel_e.max().item() <= 1e-5, f"{rel_e.max().item():.3e}", "1e-5")
        # The comparison sees the scheme: with its own parameters back at their init the
        # logits move far beyond the tolerance.
        what = scheme_to_init(eager, r["mode"])
        rel_z = rel_err_per_position(hf_logits(eager, ids), ref).max().item()
        record(mode, f"sensitivity: {what} move the logits by", rel_z > 1e-3, f"{rel_z:.3e}", "> 1e-3")
        del eager

    # Mean loss over the validation windows vs `mhar eval`.
    stream = read_shard_tokens(sorted(glob.glob(r["val"])))
    first = next(eval_windows(stream, 2, T_SEQ, 2))[0]
    record(mode, "eval windows match mhar's (logits file inputs)", torch.equal(first, ids[:2]), f"{tuple(ids.shape)}")
    loss, count = mean_loss(model, stream, B_EVAL, T_SEQ, MAX_EVAL_BATCHES)
    diff = abs(loss - r["eval"]["loss"])
    record(mode, "mean val loss vs mhar eval", diff <= 1e-5 and count == r["eval"]["tokens"],
           f"transformers {loss:.7f}, mhar {r['eval']['loss']:.7f}, |diff| {diff:.2e}, {count} tokens", "1e-5")


def check_generate(r):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList
    mode, routed = r["name"], r["remote"]
    exp = r["fp32"]
    cfg = json.load(open(os.path.join(exp, "config.json")))
    model = load_hf(exp, torch.float32, routed).eval()
    table = token_bytes_table(os.path.join(exp, "tokenizer.json"))
    tok_vocab = max(table) + 1
    eot = cfg.get("eos_token_id")

    class PadRows(LogitsProcessor):  # `mhar sample` never draws the embedding's padding rows
        def __call__(self, input_ids, scores):
            scores = scores.clone()  # the raw logits (output_logits) stay untouched
            scores[:, tok_vocab:] = -float("inf")
            return scores

    def gap_at(steps, k):
        top = steps[min(k, len(steps) - 1)][:tok_vocab].double().topk(2).values
        return (top[0] - top[1]).item()

    prompts = ["The meaning of", "def main(args):\n    ", "In this module, the function"]
    singles = []
    for pi, prompt in enumerate(prompts):
        pids = [int(t) for t in mhar("data", "encode", "--tokenizer", r["tokenizer"], "--text", prompt).stdout.decode().split()]
        ref_text = mhar("sample", "--checkpoint", r["run"], "--prompt", prompt, "--temperature", 0, "--top-k", 0,
                        "--max-tokens", 32, "--device", "cpu").stdout
        if ref_text.endswith(b"\n"):
            ref_text = ref_text[:-1]
        x = torch.tensor([pids])
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                               eos_token_id=eot, pad_token_id=eot, logits_processor=LogitsProcessorList([PadRows()]),
                               output_logits=True, return_dict_in_generate=True)
        new = g.sequences[0, len(pids):].tolist()
        steps = [l[0].float() for l in g.logits]
        if eot is not None and eot in new:
            new = new[:new.index(eot)]
        text = b"".join(table[t] for t in new)
        singles.append((pids, new, steps))
        ok, note = text == ref_text, ""
        if not ok:  # the first token whose bytes leave mhar's text; allowed only at a near tie
            pos, k = 0, 0
            while k < len(new) and ref_text[pos:].startswith(table[new[k]]):
                pos += len(table[new[k]])
                k += 1
            gap = gap_at(steps, k)
            ok = gap <= 1e-4
            note = (f"diverges at new token {k}: top-2 logit gap {gap:.2e} "
                    f"({'near tie, allowed' if ok else 'NOT a near tie'}); "
                    f"transformers {text[:60]!r} vs mhar {ref_text[:60]!r}")
        record(mode, f"greedy prompt {pi + 1} vs mhar sample", ok,
               f"{len(new)} tokens, {'identical text' if text == ref_text else 'differs'}", "near tie 1e-4", note)
        # The KV-cached steps equal a full forward over the final sequence.
        full = hf_logits(model, g.sequences[:, :len(pids) + len(steps)])[0]
        rel_c = rel_err_per_position(torch.stack(steps), full[len(pids) - 1:len(pids) - 1 + len(steps)])
        record(mode, f"prompt {pi + 1}: cached decode logits vs full forward", rel_c.max().item() <= 1e-5,
               f"{rel_c.max().item():.3e} over {len(steps)} steps", "1e-5")

    # A left-padded batch of prompts 1 and 3 generates what they generate alone.
    pad = eot if eot is not None else 0
    rows = [singles[0][0], singles[2][0]]
    width = max(len(p) for p in rows)
    x = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with torch.no_grad():
        gb = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=eot,
                            pad_token_id=pad, logits_processor=LogitsProcessorList([PadRows()]))
    for row, si in ((0, 0), (1, 2)):
        got = gb[row, width:].tolist()
        if eot is not None and eot in got:
            got = got[:got.index(eot)]
        want_tokens, steps = singles[si][1], singles[si][2]
        k = next((i for i, (a, b) in enumerate(zip(got, want_tokens)) if a != b), None)
        if k is None and len(got) != len(want_tokens):
            k = min(len(got), len(want_tokens))
        if k is None:
            record(mode, f"left-padded batch row {row + 1} == single prompt", True, f"{len(got)} tokens")
        else:
            gap = gap_at(steps, k)
            record(mode, f"left-padded batch row {row + 1} == single prompt", gap <= 1e-4,
                   f"diverges at token {k}", "near tie 1e-4", f"top-2 gap {gap:.2e}")


def check_tokenizer(r):
    from transformers import AutoTokenizer
    mode, exp = r["name"], r["fp32"]
    eot = json.load(open(os.path.join(exp, "config.json"))).get("eos_token_id")
    # As lm_eval loads it: trust_remote_code for an mhar export (its config.json needs it).
    hf_tok = AutoTokenizer.from_pretrained(exp, trust_remote_code=r["remote"])
    mismatches, total = [], 0
    for p in r["heldout"]:
        text = open(p, encoding="utf-8", newline="").read()
        want_ids = [int(t) for t in mhar("data", "encode", "--tokenizer", r["tokenizer"], "--file", p).stdout.decode().split()]
        got_plain = hf_tok(text, add_special_tokens=False)["input_ids"]
        got_default = hf_tok(text)["input_ids"]
        total += len(want_ids)
        if got_plain != want_ids or got_default != want_ids:
            mismatches.append(os.path.basename(p))
    record(mode, "AutoTokenizer ids == mhar data encode", not mismatches,
           f"{len(r['heldout'])} texts, {total} tokens, {type(hf_tok).__name__}", note=f"differ: {mismatches}" if mismatches else "")
    record(mode, "tokenizer eos", eot is None or hf_tok.eos_token_id == eot, f"eos {hf_tok.eos_token!r} = {hf_tok.eos_token_id}")


def check_modeling_file_standard_mode(r):
    """modeling_mhar.py with residual_mode "standard" on the standard export's weights
    equals stock Qwen3 (and so the engine): a check of its attention, RoPE and norms."""
    import torch
    src = r["fp32"]
    dst = os.path.join(os.path.dirname(src), "standard_as_mhar")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f.startswith("tokenizer"):
            shutil.copy(os.path.join(src, f), dst)
    mhar_dir = os.path.join(os.path.dirname(src), "mhar_fp32")
    for f in ("configuration_mhar.py", "modeling_mhar.py"):
        shutil.copy(os.path.join(mhar_dir, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k in ("rope_parameters", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
        cfg.pop(k, None)
    cfg.update({"model_type": "mhar", "architectures": ["MharForCausalLM"], "residual_mode": "standard",
                "routing_heads": 1, "auto_map": json.load(open(os.path.join(mhar_dir, "config.json")))["auto_map"]})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    m = load_hf(dst, torch.float32, True).eval()
    ids, _, ref = engine_logits(r)
    rel = rel_err_per_position(hf_logits(m, ids), ref)
    record("standard", "modeling_mhar.py (standard mode) vs mhar", rel.max().item() <= 1e-5, f"{rel.max().item():.3e}", "1e-5")


def stochastic_bf16(t, gen):
    """fp32 -> a bf16-representable fp32 tensor, rounded up or down at random with the
    probability of the distance (unbiased): another bf16 rendition of the same weights."""
    import torch
    bits = t.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + torch.randint(0, 1 << 16, bits.shape, generator=gen, dtype=torch.int64)) & 0xFFFF0000
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits)
    return bits.to(torch.int32).view(torch.float32)


def check_bf16(r):
    import torch
    mode, routed = r["name"], r["remote"]
    ids, targets, ref = engine_logits(r)
    w32, _ = read_safetensors(r["fp32"])
    w16, meta = read_safetensors(r["bf16"])
    bad = [n for n in w32 if n not in w16 or w16[n].dtype != torch.bfloat16 or
           not torch.equal(w16[n].view(torch.int16), w32[n].to(torch.bfloat16).view(torch.int16))]
    record(mode, "bf16 export = round-to-nearest-even of fp32, every tensor", not bad and len(w16) == len(w32),
           f"{len(w16)} tensors", note=f"differ: {bad[:5]}" if bad else "")
    cfg = json.load(open(os.path.join(r["bf16"], "config.json")))
    record(mode, "bf16 config dtype", cfg.get("dtype") == "bfloat16", cfg.get("dtype"))

    ref_loss = token_losses(ref, targets)

    def deviation(model):
        out = hf_logits(model, ids)
        return rel_err_per_position(out, ref).max().item(), (token_losses(out, targets) - ref_loss).abs().mean().item()

    m16 = load_hf(r["bf16"], torch.bfloat16, routed).eval()
    got = deviation(m16)
    # The copies must compute exactly as the loaded bf16 model does: bf16 parameters, and
    # buffers (Qwen3's RoPE inv_freq) in whatever dtype that model keeps them.
    buffer_dtypes = {n: b.dtype for n, b in m16.named_buffers()}
    del m16
    gen = torch.Generator().manual_seed(1234)
    noise = []
    for _ in range(3):
        m = load_hf(r["fp32"], torch.float32, routed).eval()
        with torch.no_grad():
            for _, p in m.named_parameters():
                p.data = stochastic_bf16(p.data, gen).to(torch.bfloat16)
            for n, b in list(m.named_buffers()):
                if n in buffer_dtypes and b.dtype != buffer_dtypes[n]:
                    owner, _, leaf = n.rpartition(".")
                    (m.get_submodule(owner) if owner else m)._buffers[leaf] = b.to(buffer_dtypes[n])
        noise.append(deviation(m))
        del m
    bound_l, bound_t = 2 * max(n[0] for n in noise), 2 * max(n[1] for n in noise)
    record(mode, "bf16 logits vs fp32 (relative, max over positions)", got[0] <= bound_l,
           f"{got[0]:.3e}; stochastic-rounding copies {', '.join(f'{n[0]:.3e}' for n in noise)}", f"{bound_l:.3e}")
    record(mode, "bf16 per-token loss vs fp32 (mean |diff|)", got[1] <= bound_t,
           f"{got[1]:.3e}; stochastic-rounding copies {', '.join(f'{n[1]:.3e}' for n in noise)}", f"{bound_t:.3e}")


# ------------------------------------------------------------------ import

def write_random_shard(path, vocab, count, seed):
    import random
    rng = random.Random(seed)
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, count
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(array.array("H", [rng.randrange(vocab) for _ in range(count)]).tobytes())


def save_sharded(model, path, max_shard_size="150KB"):
    """save_pretrained with a small shard limit (so the import reads an index)."""
    try:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    except TypeError as e:  # a transformers without max_shard_size: shard its file here
        if "max_shard_size" not in str(e):
            raise
        log(f"save_pretrained has no max_shard_size ({e}); sharding its model.safetensors here")
        model.save_pretrained(path)
        from safetensors.torch import save_file
        tensors, _ = read_safetensors(os.path.join(path, "model.safetensors"))
        names = list(tensors)
        parts = [names[i:i + 4] for i in range(0, len(names), 4)]
        weight_map = {}
        for k, part in enumerate(parts):
            f = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, f), metadata={"format": "pt"})
            weight_map.update({n: f for n in part})
        os.remove(os.path.join(path, "model.safetensors"))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                  open(os.path.join(path, "model.safetensors.index.json"), "w"), indent=2)


def check_import(work, trained_tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    base = os.path.join(work, "import")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    vocab = 1000
    shard = os.path.join(base, "val_000000.bin")
    write_random_shard(shard, vocab, 4 * 4 * T_SEQ + 1, seed=5)
    stream = read_shard_tokens([shard])
    for tied in (True, False):
        tag = "tied" if tied else "untied"
        cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          rms_norm_eps=1e-6, tie_word_embeddings=tied, attention_bias=False, use_sliding_window=False)
        rp = getattr(cfg, "rope_parameters", None)
        if isinstance(rp, dict):
            rp["rope_theta"] = 1e6
        else:
            cfg.rope_theta = 1e6
        torch.manual_seed(11 if tied else 12)
        model = Qwen3ForCausalLM(cfg).float().eval()
        with torch.no_grad():  # random init has norm weights of exactly 1: make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.randn_like(p))
        src = os.path.join(base, f"qwen3_{tag}")
        save_sharded(model, src)
        files = sorted(os.listdir(src))
        shards = [f for f in files if f.endswith(".safetensors")]
        record(f"import {tag}", "transformers saved it sharded", "model.safetensors.index.json" in files and len(shards) > 1,
               f"{len(shards)} shards: {files}")
        variants = [(src, torch.float32, "fp32")]
        if not tied:
            for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                d = os.path.join(base, f"qwen3_{tag}_{name}")
                save_sharded(copy.deepcopy(model).to(dt), d)
                variants.append((d, dt, name))
        for path, dt, name in variants:
            ck = os.path.join(base, f"run_{tag}_{name}")
            log(mhar("import", "--hf", path, "--out", ck, "--set", f"data.tokenizer={trained_tokenizer}").stdout.decode().rstrip())
            ev = mhar_json("eval", "--checkpoint", ck, "--data", shard, "--device", "cpu", "--batch-size", 4,
                           "--seq-len", T_SEQ, "--logits-out", os.path.join(base, f"logits_{tag}_{name}.safetensors"))
            hf = load_hf(path, torch.float32, False).eval()  # bf16/fp16 weights upcast exactly
            loss, count = mean_loss(hf, stream, 4, T_SEQ, 0)
            diff = abs(loss - ev["loss"])
            record(f"import {tag}", f"{name}: mhar eval loss vs transformers", diff <= 1e-5 and count == ev["tokens"],
                   f"transformers {loss:.7f}, mhar {ev['loss']:.7f}, |diff| {diff:.2e}, {count} tokens", "1e-5")
            lf, _ = read_safetensors(os.path.join(base, f"logits_{tag}_{name}.safetensors"))
            rel = rel_err_per_position(hf_logits(hf, lf["input_ids"].long()), lf["logits"])
            record(f"import {tag}", f"{name}: logits vs transformers (relative, max over positions)",
                   rel.max().item() <= 1e-5, f"{rel.max().item():.3e}", "1e-5")
            if name != "fp32":
                continue
            back = os.path.join(base, f"reexport_{tag}")
            shutil.rmtree(back, ignore_errors=True)
            mhar("export", "--checkpoint", ck, "--out", back)
            x, _ = read_safetensors(src)
            y, _ = read_safetensors(back)
            names_x = set(x) - ({"lm_head.weight"} if tied else set())
            bad = [n for n in names_x if n not in y or not torch.equal(x[n].contiguous().view(torch.int32),
                                                                     y[n].contiguous().view(torch.int32))]
            extra = sorted(set(y) - names_x)
            if tied and "lm_head.weight" in x:  # a tied head saved anyway must be the embedding
                bad += [] if torch.equal(x["lm_head.weight"], x["model.embed_tokens.weight"]) else ["lm_head.weight"]
            record(f"import {tag}", "export(import(x)) == x, bit for bit (fp32)", not bad and not extra,
                   f"{len(names_x)} tensors", note=(f"differ: {bad[:5]} " if bad else "") + (f"extra: {extra}" if extra else ""))
            # As transformers reads them (a key left out of a file means its default).
            from transformers import AutoConfig
            cx, cy = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(back)
            keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps", "rope_theta"]

            def value(c, k):
                if k == "rope_theta" and isinstance(getattr(c, "rope_parameters", None), dict):
                    return c.rope_parameters.get("rope_theta")
                return getattr(c, k, None)
            diffs = {k: (value(cx, k), value(cy, k)) for k in keys if value(cx, k) != value(cy, k)}
            record(f"import {tag}", "re-exported config.json agrees", not diffs, f"{len(keys)} fields", note=str(diffs) if diffs else "")


# ------------------------------------------------------------------ main

def main():
    global MHAR, WORK, LOG
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mhar", required=True, help="the mhar binary")
    ap.add_argument("--work", required=True, help="scratch directory (recreated)")
    ap.add_argument("--log-dir", default=None, help="where hf_check.log and hf_check.json go")
    ap.add_argument("--skip-hf", action="store_true", help="only the mhar side (no transformers)")
    args = ap.parse_args()
    MHAR = os.path.abspath(args.mhar)
    WORK = os.path.abspath(args.work)
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    log_dir = os.path.abspath(args.log_dir or WORK)
    os.makedirs(log_dir, exist_ok=True)
    LOG = open(os.path.join(log_dir, "hf_check_commands.log"), "w")
    # Everything local: no hub look-ups, and transformers' module cache in the work dir.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ["HF_HOME"] = os.path.join(WORK, "hf_home")
    t0 = time.time()
    if not args.skip_hf:
        import torch
        import transformers
        torch.set_num_threads(os.cpu_count() or 1)
        versions = f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}"
        try:
            import tokenizers
            versions += f", tokenizers {tokenizers.__version__}"
        except ImportError:
            pass
        log(versions)
    log(subprocess.run([MHAR, "--version"], capture_output=True).stdout.decode().strip())

    corpus, heldout = build_corpus(WORK)
    tokenizers = section("tokenizers and shards", prepare_tokenizers, WORK, corpus)
    runs = {}
    for name, mode, tok, vocab, tied, residual in (RUNS if tokenizers else []):
        r = section(f"train {name}", train_run, WORK, tokenizers, name, mode, tok, vocab, tied, residual)
        if r:
            r["heldout"] = heldout
            section(f"export {name}", export_run, WORK, r)
            runs[name] = r
    if not args.skip_hf:
        for mode, r in runs.items():
            if "logits_file" not in r:
                continue
            section(f"{mode}: load, logits, loss", check_load_and_logits, r)
            section(f"{mode}: generate", check_generate, r)
            section(f"{mode}: tokenizer", check_tokenizer, r)
            section(f"{mode}: bf16", check_bf16, r)
            if mode == "standard" and "mhar" in runs:
                section("standard: modeling_mhar.py in standard mode", check_modeling_file_standard_mode, r)
        trained = os.path.join(WORK, "tok512", "tokenizer.json")
        section("import", check_import, WORK, trained)

    log(f"\n=== summary ({time.time() - t0:.0f} s)")
    w1 = max([len(s) + len(c) + 2 for s, c, *_ in RESULTS] + [10])
    for s, c, ok, fig, bound, note in RESULTS:
        log(f"{'PASS' if ok else 'FAIL'}  {(s + ': ' + c).ljust(w1)}  {fig}" + (f"  [bound {bound}]" if bound else "")
            + (f"  {note}" if note and not ok else ""))
    failed = [r for r in RESULTS if not r[2]]
    json.dump([dict(zip(("section", "check", "ok", "figure", "bound", "note"), r)) for r in RESULTS],
              open(os.path.join(log_dir, "hf_check.json"), "w"), indent=1)
    log(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
