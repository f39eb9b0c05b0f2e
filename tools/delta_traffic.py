#!/usr/bin/env python3
"""delta_traffic.py: the rows a delta-mode step moves beyond a standard step, as the CUDA
code runs it, and the time that takes at a given bandwidth: a floor under delta's step
time, set by the scheme's definition rather than by its kernels (cuda/NOTES.md, lead 5).

R is one [N, d] bf16 row (16,384 tokens x d). Per site j (engine/residual_delta.cpp):
  forward  one-site slot (j % s != 0), one fused kernel: reads the stream, v, prev (where
           the slot continues its block) and the closed slots (the null's included);
           writes the stream, the slot (continuing), r and x. A closing slot (j % s == 0):
           the op sequence (stream advance 5R, its logits 1R, the mix over its closed
           slots + r, the gate 3R). Then the sublayer's plain RMSNorm (2R), where standard
           runs its fused add + RMSNorm (4R: reads the stream and v, writes both).
  backward one-site slot: one fused kernel (9R) and the key gradients' read of v (1R). A
           closed slot: gate backward 5R, its source backward over every later site's
           gradient (halved by the backward tiles of two closed slots), v, r, dv, key
           gradients, source gradient 5R. The sublayer norm's backward overwrites (3R)
           where standard's adds into the running sum (4R).
The null source (slot 0) is materialised as rows: every site reads them once forward,
and slot 0's backward reads its sites' gradients (paired).

--scheme closed models a design that is NOT built: the current block's partial sum no
longer a source, so a block's sites read the null and the closed block sums only. A
block's first s - 1 sites then share their sources, and one pass over them per block
writes those sites' r rows (the closing site mixes on its own, with its new block sum);
each site's step reads the stream, v, prev, r and writes the stream, the running block
sum, x; backward, each site's gate backward (5R) and its source gradient, dresid plus its
block's gradient (3R), and the closed slots' backward as now. No one-site slots remain:
no per-site logits, key gradients or fused site backward.

  tools/delta_traffic.py [--layers 36] [--block-layers 4] [--d 1280] [--tokens 16384]
                         [--standard-ms 246.7] [--scheme partial|closed]
"""
import argparse

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--layers", type=int, default=36)
p.add_argument("--block-layers", type=int, default=4)
p.add_argument("--d", type=int, default=1280)
p.add_argument("--tokens", type=int, default=16384)
p.add_argument("--standard-ms", type=float, default=246.7,
               help="standard's step (BENCHMARKS.md, 1B, thirty-first session)")
p.add_argument("--scheme", choices=("partial", "closed"), default="partial",
               help="partial: the engine's delta mode; closed: the design without the "
               "partial block as a source (not built)")
a = p.parse_args()

s = 2 * a.block_layers
S = 2 * a.layers + 1


def closed_slots(k):  # the closed slots site k reads, the null's included
    return k // s + 1


# Both schemes: site 0 (the stream copy, the null's rows, its logits, its mix of one
# source and r, the gate) and a closed slot's backward (gate backward, its source backward
# over every later site's gradient halved by the tiles, v, r, dv, key gradients, source
# gradient), each with the plain RMSNorm in place of standard's fused one.
SITE0_FORWARD = 2 + 1 + 1 + 2 + 3
NORM_FORWARD, NORM_BACKWARD = 2 - 4, 3 - 4


def closed_slot_backward(j):
    return 5 + (S - j) / 2 + 3 + 1 + 1 + 5


def partial_scheme(j):
    """Rows beyond standard's at site j, forward and backward: the engine's delta mode."""
    if j == 0:
        f = SITE0_FORWARD
    elif j % s:
        cont = 1 if j % s != 1 else 0
        f = (2 + cont + closed_slots(j)) + (1 + cont + 1 + 1)
    else:
        f = 5 + 1 + (closed_slots(j) + 1) + 3
    b = 9 + 1 if j >= 1 and j % s else closed_slot_backward(j)
    return f + NORM_FORWARD, b + NORM_BACKWARD


def closed_scheme(j):
    """The same for the design without the partial block as a source (not built)."""
    if j == 0:
        f = SITE0_FORWARD
    else:
        cont = 1 if j % s != 1 else 0
        f = (4 + cont) + (2 + cont)  # the step: reads stream, v, [prev], r; writes 3
        if j % s == 1:  # the block's shared pass: its null and closed sums, its sites' r
            f += closed_slots(j) + (s - 1)
        if j % s == 0:  # this closed slot's logits; its own mix over the block sums so far
            f += 1 + closed_slots(j) + 1
    b = 5 + 3 if j >= 1 and j % s else closed_slot_backward(j)  # gate backward, source grad
    return f + NORM_FORWARD, b + NORM_BACKWARD


site_rows = partial_scheme if a.scheme == "partial" else closed_scheme
fwd = sum(site_rows(j)[0] for j in range(S))
bwd = sum(site_rows(j)[1] for j in range(S))
null = S + S / 2 + 6  # the null's rows read forward; slot 0's backward
R = a.tokens * a.d * 2
total = fwd + bwd
allowed = a.standard_ms / 0.95 - a.standard_ms
print(f"{a.scheme}: beyond standard: forward {fwd:.0f} R, backward {bwd:.0f} R, {total:.0f} R in all "
      f"({total * R / 1e9:.1f} GB, R = {R / 1e6:.1f} MB)")
for bw in (4.3, 3.6):
    print(f"  at {bw} TB/s: {total * R / bw / 1e9:.1f} ms; with the null as a broadcast row: "
          f"{(total - null) * R / bw / 1e9:.1f} ms")
print(f"issue 11's 0.95x of standard's {a.standard_ms} ms allows {allowed:.1f} ms beyond it")
