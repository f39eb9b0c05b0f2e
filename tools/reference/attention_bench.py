#!/usr/bin/env python3
"""attention_bench.py: PyTorch's causal attention (SDPA) at issue 13's comparison shapes,
per backend (cuDNN, FlashAttention-2), forward and backward, in TFLOP/s by the convention
of tests/attention_timing_cudatest.cpp (forward 4 B Hq T^2 hd / 2, backward 2.5x that), so
that one device call compares ours against it:

    python3 tools/reference/attention_bench.py        # prints one line per backend/shape

Layout [B, H, T, hd] bf16 (SDPA's), GQA through enable_gqa where the backend takes it,
else K and V repeated to Hq heads beforehand (outside the timing). Time: CUDA events,
median of 7 rounds of the mean of 10 calls after warm-up; the backward is timed alone
(torch.autograd.grad from a saved graph, retain_graph), on random inputs.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(16, 1024), (8, 2048)]
HQ, HKV, HD = 16, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def median_ms(fn, rounds=7, calls=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def bench(backend, B, T):
    q = (2.0 * torch.randn(B, HQ, T, HD, device="cuda")).bfloat16().requires_grad_()
    k = torch.randn(B, HKV, T, HD, device="cuda").bfloat16()
    v = torch.randn(B, HKV, T, HD, device="cuda").bfloat16()
    gqa = "native"
    with sdpa_kernel([BACKENDS[backend]]):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            kw = {"enable_gqa": True}
        except RuntimeError:
            k = k.repeat_interleave(HQ // HKV, dim=1)
            v = v.repeat_interleave(HQ // HKV, dim=1)
            kw, gqa = {}, "repeated"
        k.requires_grad_()
        v.requires_grad_()
        fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        dout = torch.randn_like(out)
        bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    flop = 4.0 * B * HQ * HD * T * T / 2
    for what, ms, f in (("forward", fwd, flop), ("backward", bwd, 2.5 * flop)):
        print(f"PYTORCH {what:<8} {backend:<6} B{B} T{T} H16/8 hd128 ({gqa} GQA) "
              f"{ms:8.3f} ms {f / ms * 1e-9:7.1f} TFLOP/s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="cudnn,flash", help="comma list of cudnn, flash")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench.py: no CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            raise SystemExit(f"attention_bench.py: --backends: unknown '{backend}' (cudnn, flash)")
        for B, T in SHAPES:
            try:
                bench(backend, B, T)
            except RuntimeError as e:
                print(f"PYTORCH {backend} B{B} T{T}: unavailable ({str(e).splitlines()[0]})")


if __name__ == "__main__":
    main()
