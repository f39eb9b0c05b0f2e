#!/usr/bin/env python3
# bench_step.py: the PyTorch baseline the engine's `mhar bench` is compared against
# (issue 5): one training step of the mhar_ref.py model as a strong PyTorch user would
# write it (fp32 master weights, bf16 autocast, torch.compile, SDPA flash attention,
# fused AdamW, global-norm clipping), timed after warm-up; prints one JSON line with
# tokens/s, ms per step (median), peak memory and MFU.
#
#   python3 tools/reference/bench_step.py --preset 100m --mode mhar
#   python3 tools/reference/bench_step.py configs/350m_standard.json --set train.micro_batch=8
#
# The model config is the engine's format ({"model": ..., "residual": ..., "train":
# {"micro_batch", "seq_len"}}; other sections are ignored), from a preset, a file, or
# both (the file overrides the preset), then --set overrides, then the flags.
#
# MFU counts matmul FLOPs only: 6 * (matmul parameters, the LM head included, the
# embedding lookup not) per token, plus causal attention 6 * n_layers * seq_len *
# n_heads * head_dim per token (QK^T and AV, half the square, forward and backward),
# against a dense bf16 peak of 989 TFLOP/s (H100/H200 SXM datasheet); routing FLOPs are
# not counted, so mhar and standard share the same numerator.
import argparse
import contextlib
import copy
import fcntl
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mhar_ref  # noqa: E402

PEAK_BF16_FLOPS = 989e12

# The paper's shapes (Qwen3 vocabulary, tied embeddings, routing heads = KV heads).
_QWEN3 = {"vocab_size": 151936, "tie_embeddings": True, "rope_theta": 1e6, "rms_eps": 1e-6, "init_std": 0.02}
PRESETS = {
    "100m": {"model": dict(_QWEN3, d_model=512, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=128,
                           d_ff=1536, context_length=2048),
             "train": {"micro_batch": 8, "seq_len": 2048}},
    "350m": {"model": dict(_QWEN3, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128,
                           d_ff=4096, context_length=1024),
             "train": {"micro_batch": 16, "seq_len": 1024}},
    "1b": {"model": dict(_QWEN3, d_model=1280, n_layers=36, n_heads=16, n_kv_heads=8, head_dim=128,
                         d_ff=5120, context_length=1024),
           "train": {"micro_batch": 16, "seq_len": 1024}},
}


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def apply_set(cfg, assignment):
    """"section.key=value", value parsed as JSON when it is JSON, else a string."""
    key, _, raw = assignment.partition("=")
    section, _, field = key.partition(".")
    if not field:
        raise SystemExit(f"--set {assignment}: expected SECTION.FIELD=VALUE")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    cfg.setdefault(section, {})[field] = value


def build_config(args):
    cfg = {"model": {}, "residual": {}, "train": {}}
    if args.preset:
        cfg = copy.deepcopy(PRESETS[args.preset]) | {"residual": {}}
    if args.config:
        with open(args.config) as f:
            file_cfg = json.load(f)
        for section in ("model", "residual", "train"):
            cfg.setdefault(section, {}).update(file_cfg.get(section, {}))
    for assignment in args.set:
        apply_set(cfg, assignment)
    if args.mode:
        cfg["residual"]["mode"] = args.mode
    if args.heads is not None:
        cfg["residual"]["heads"] = args.heads
    if cfg["residual"].get("mode") == "standard":
        cfg["residual"]["heads"] = 0
    train = cfg.get("train", {})
    micro_batch = args.micro_batch or train.get("micro_batch", 8)
    seq_len = args.seq_len or train.get("seq_len", 1024)
    resolved = mhar_ref.resolve_config(cfg)
    return resolved, micro_batch, seq_len


def flash_supports_gqa(device, head_dim):
    """Whether SDPA's flash kernel takes enable_gqa=True here; else KV heads are
    repeated before the call (memory traffic, but still flash)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.randn(1, 4, 64, head_dim, device=device, dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 64, head_dim, device=device, dtype=torch.bfloat16)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except Exception as e:
        log(f"flash attention with enable_gqa unavailable ({type(e).__name__}: {e}); repeating KV heads")
        return False


def attention_context(backend):
    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def flops_per_token(cfg, seq_len):
    m = cfg["model"]
    d, L, q_dim, kv_dim = m["d_model"], m["n_layers"], m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
    per_layer = d * (2 * q_dim + 2 * kv_dim) + 3 * d * m["d_ff"]  # q, o, k, v, gate, up, down
    matmul_params = L * per_layer + d * m["vocab_size"]  # + LM head
    return 6 * matmul_params + 6 * L * seq_len * q_dim


def run(args):
    cfg, B, T = build_config(args)
    device = args.device
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    m = cfg["model"]

    attn_impl = "sdpa" if args.attention != "manual" else "manual"
    gqa = "native" if (attn_impl == "sdpa" and flash_supports_gqa(device, m["head_dim"])) else "expand"
    model = mhar_ref.MharModel(cfg, attn_impl=attn_impl, sdpa_gqa=gqa, device=device, dtype=torch.float32)
    n_params = mhar_ref.count_parameters(model)
    # Weight decay on matrices only (DESIGN.md section 5): not on norms or routing vectors.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_gpu else {}))
    params = list(model.parameters())
    V = m["vocab_size"]
    input_ids = torch.randint(V, (B, T), device=device)
    targets = torch.randint(V, (B, T), device=device)

    forward = torch.compile(model) if args.compile else model
    backend = args.attention if attn_impl == "sdpa" else "manual"

    def step():
        with attention_context(backend), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            _, loss = forward(input_ids, targets, return_logits=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    log(f"mode {cfg['residual']['mode']} H={cfg['residual']['heads']} params {n_params / 1e6:.1f}M "
        f"B={B} T={T} compile={args.compile} attention={backend} gqa={gqa}")
    t0 = time.time()
    loss = step()  # the first call compiles
    sync()
    first_step_s = time.time() - t0
    log(f"first step (compile) {first_step_s:.1f}s, loss {loss.item():.4f}")

    # Another process may be compiling beside this one; only the timed steps are
    # serialized through the lock, so two benchmarks never share the GPU while timed.
    lock = open(args.lock, "w") if args.lock else None
    if lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        log("lock acquired")
    try:
        for _ in range(args.warmup):
            loss = step()
        sync()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - t)
        final_loss = loss.item()
    finally:
        if lock:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
    if not math.isfinite(final_loss):
        raise RuntimeError(f"loss is {final_loss}")
    med = statistics.median(times)
    fpt = flops_per_token(cfg, T)
    tokens_per_s = B * T / med
    return {
        "tool": "tools/reference/bench_step.py",
        "mode": cfg["residual"]["mode"],
        "heads": cfg["residual"]["heads"],
        "preset": args.preset,
        "params": n_params,
        "micro_batch": B,
        "seq_len": T,
        "tokens_per_s": round(tokens_per_s, 1),
        "ms_per_step": round(med * 1e3, 3),
        "ms_per_step_min": round(min(times) * 1e3, 3),
        "ms_per_step_max": round(max(times) * 1e3, 3),
        "steps_timed": args.steps,
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else None,
        "flops_per_token": fpt,
        "mfu": round(tokens_per_s * fpt / PEAK_BF16_FLOPS, 4),
        "first_step_s": round(first_step_s, 1),
        "loss": round(final_loss, 4),
        "compiled": args.compile,
        "attention": f"sdpa-{backend}" if attn_impl == "sdpa" else "manual",
        "sdpa_gqa": gqa if attn_impl == "sdpa" else None,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else device,
        "config": cfg,
    }


def main():
    ap = argparse.ArgumentParser(description="PyTorch training-step benchmark of the mhar model")
    ap.add_argument("config", nargs="?", help="engine config JSON (model/residual/train sections)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="the paper's shapes")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--mode", choices=mhar_ref.RESIDUAL_MODES)
    ap.add_argument("--heads", type=int, help="routing heads H (default: n_kv_heads for mhar)")
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling one")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--attention", choices=("flash", "auto", "manual"), default="flash",
                    help="flash: SDPA restricted to the flash kernel; auto: SDPA's own choice; manual: explicit math")
    ap.add_argument("--lock", help="file lock serializing the timed steps of concurrent benchmarks")
    ap.add_argument("--out", help="also append the JSON line to this file")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script (--no-compile --attention manual)")
    args = ap.parse_args()
    if not args.preset and not args.config:
        ap.error("give a config file or --preset")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_step.py needs a CUDA GPU (--device cpu only smoke-tests it)")

    try:
        result = run(args)
    except Exception as e:
        # Flash-only attention failing under compile should not cost the measurement:
        # retry once with SDPA's own kernel choice, and say so in the result.
        if args.attention != "flash":
            raise
        log(f"failed with flash-only SDPA ({type(e).__name__}: {e}); retrying with --attention auto")
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        args.attention = "auto"
        result = run(args)
        result["flash_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
