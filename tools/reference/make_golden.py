#!/usr/bin/env python3
# make_golden.py: writes the golden fixtures the C++ engine's golden test compares
# against (tests/fixtures/golden/<name>.safetensors), one per residual mode, one per
# block-routed mode (<mode>_block), a second hyper one (hyper_n4), dynamic
# Hyper-Connections (hyper_dynamic) and a second delta one (delta_l2, blocks of 2 layers),
# from the
# independent PyTorch reference in mhar_ref.py, and proves the reference first:
# finite differences against autograd, the routing identities, a loop-by-loop NumPy
# re-implementation of the forward pass, CPU-vs-GPU agreement and, for `standard`,
# Hugging Face's own Qwen3 where transformers is installed.
#
# Weights are drawn at random and stored as F32 (what the engine loads); everything
# expected is computed in float64 from exactly those F32 values upcast, so the
# fixture's only error is the engine's own.
#
#   /usr/bin/python3 tools/reference/make_golden.py [--out DIR] [--device cuda|cpu]
#                                                   [--modes standard,mhar_block,...]
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mhar_ref  # noqa: E402

BATCH, SEQ_LEN = 2, 8

TINY_MODEL = {
    "vocab_size": 97,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 8,
    "d_ff": 48,
    "context_length": 16,
    "rope_theta": 10000.0,
    "rms_eps": 1e-6,
    "tie_embeddings": True,
    "init_std": 0.02,
}

# fixture name -> (residual.mode, tie_embeddings, residual.heads, seed, residual.block_size).
# attnres is the untied case so the separate lm_head.weight is covered by one fixture.
# The block fixtures cover, over the 4 sublayers: blocks of 2 (two closed blocks, the
# final site reading both) and blocks of 3 (sites reading a partial sum only, one
# closed block, and the final site reading a closed block and a partial one).
FIXTURES = {
    "standard": ("standard", True, 0, 1001, 0),
    "attnres": ("attnres", False, 1, 1002, 0),
    "mhar": ("mhar", True, 4, 1003, 0),
    "attnres_block": ("attnres", False, 1, 1004, 2),
    "mhar_block": ("mhar", True, 4, 1005, 3),
    # Hyper-Connections: heads and block_size are 0; the stream count is in HYPER_N.
    "hyper": ("hyper", True, 0, 1006, 0),
    "hyper_n4": ("hyper", False, 0, 1007, 0),
    # Dynamic Hyper-Connections (residual.hyper_dynamic): per-token coefficients.
    "hyper_dynamic": ("hyper", True, 0, 1008, 0),
    # Delta: the routed term's blocks are in DELTA_BLOCK_LAYERS (block_size stays 0).
    "delta": ("delta", True, 4, 1008, 0),
    "delta_l2": ("delta", False, 2, 1009, 0),
}
# Layers per block of the delta fixtures: 1 (blocks of 2 sublayers: closed and partial
# blocks) and 2 (all 4 sublayers in one block: partial sums, then one closed block).
DELTA_BLOCK_LAYERS = {"delta": 1, "delta_l2": 2}
# Streams per hyper fixture: 3 (the one-hot starts k mod 3 wrap within the 4 sublayers)
# and 4, untied.
HYPER_N = {"hyper": 3, "hyper_n4": 4, "hyper_dynamic": 3}
HYPER_DYNAMIC = {"hyper_dynamic"}  # the others' configs carry no hyper_dynamic (unchanged files)
# The hyper fixtures' rms_eps. Site 0 mixes n streams that are all v_0, x_0 = (sum a_m) v_0,
# read only through the first RMSNorm, which is scale-invariant but for its eps: with
# eps 1e-6 the gradient of model.hyper.0.a_m is ~1e-6 of the others, pure cancellation,
# and no bound could test it. At 0.05 (activations here have mean square ~0.06) that
# path carries signal like any other.
HYPER_RMS_EPS = 0.05


def fixture_config(name):
    mode, tie, heads, _, block = FIXTURES[name]
    residual = {"mode": mode, "heads": heads}
    if block:  # the original fixtures' config carries no block_size
        residual["block_size"] = block
    model = dict(TINY_MODEL, tie_embeddings=tie)
    if mode == "hyper":
        residual["hyper_n"] = HYPER_N[name]
        if name in HYPER_DYNAMIC:
            residual["hyper_dynamic"] = True
        model["rms_eps"] = HYPER_RMS_EPS
    if mode == "delta":
        residual["block_layers"] = DELTA_BLOCK_LAYERS[name]
    return {"model": model, "residual": residual}


# ---------------------------------------------------------------------------------------
# Weights and inputs

def random_weights(model, generator):
    """Every parameter drawn large enough that every path moves the loss: matrices
    std 0.25 (init_std would leave attention and routing almost uniform), norm weights
    and routing gains 1 + 0.1 noise, routing queries std 0.5 (not the zero init, which
    would hide the key path), hyper coefficients their init (one-hot, identity, ones) +
    0.3 noise, so every stream reaches every other (dynamic: w 0 + 0.3 noise, so the
    tanh terms are neither zero nor saturated, scales 0.01 + 0.3 noise); delta gates and
    null std 0.25 (not the zero init, which would cut the routed term off). Returned as float32 tensors, the
    values the engine loads."""
    weights = {}
    init = {n: p.detach().to(torch.float64) for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        if name.startswith("model.hyper."):
            w = init[name] + 0.3 * noise
        elif name.endswith(".query"):
            w = 0.5 * noise
        elif name.endswith((".gain", "norm.weight")):
            w = 1.0 + 0.1 * noise
        else:
            w = 0.25 * noise
        weights[name] = w.to(torch.float32)
    return weights


def build_reference(cfg, weights, device, dtype=torch.float64):
    model = mhar_ref.MharModel(cfg, attn_impl="manual", device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].to(device=device, dtype=dtype))  # exact: f32 -> f64
    return model


def run_reference(cfg, weights, input_ids, targets, device):
    """float64 loss, logits and every parameter gradient (autograd), on the CPU."""
    model = build_reference(cfg, weights, device)
    logits, loss = model(input_ids.to(device), targets.to(device))
    loss.backward()
    grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    return loss.detach().cpu(), logits.detach().cpu(), grads


# ---------------------------------------------------------------------------------------
# Safetensors, written by hand (the format is tiny) so the fixtures never depend on the
# package; when it is installed it reads every file back as a cross-check.

_ST_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<i4"): "I32", np.dtype("<i8"): "I64"}
_NP_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


def write_safetensors(path, arrays, metadata):
    """arrays: name -> numpy array (little-endian F32/F64/I32/I64). Header: 8-byte
    little-endian length, then JSON padded with spaces to a multiple of 8 so every
    tensor's data starts 8-byte aligned."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        raw = a.tobytes()
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    arrays = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        arrays[name] = np.frombuffer(data[start:end], dtype=_NP_DTYPES[info["dtype"]]).reshape(info["shape"])
    return arrays, metadata


def crosscheck_with_package(path, arrays):
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return "safetensors package not installed: skipped"
    loaded = load_file(path)
    assert set(loaded) == set(arrays), "safetensors package sees other tensor names"
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and np.array_equal(loaded[name], a), name
    return "safetensors package reads it back identically"


# ---------------------------------------------------------------------------------------
# Self-checks of the reference

def finite_difference_check(cfg, weights, input_ids, targets, grads, generator, step=3e-4):
    """Finite differences of the float64 loss for two entries of every parameter tensor
    (its largest-gradient entry and a random one) against autograd. The five-point
    stencil (error O(step^4)) lets the step stay large enough that float64 rounding of
    the loss does not swamp small gradients. Returns the largest relative error over
    entries with |grad| > 1e-4, and the largest absolute error."""
    model = build_reference(cfg, weights, "cpu")
    worst_rel, worst_abs = 0.0, 0.0

    def loss_at(flat, idx, value):
        flat[idx] = value
        return model(input_ids, targets, return_logits=False)[1].item()

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = grads[name].reshape(-1)
            picks = {int(g.abs().argmax()), int(torch.randint(g.numel(), (1,), generator=generator))}
            flat = p.view(-1)
            for idx in picks:
                x = flat[idx].item()
                f = [loss_at(flat, idx, x + k * step) for k in (-2, -1, 1, 2)]
                flat[idx] = x
                fd = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * step)
                an = g[idx].item()
                err = abs(fd - an)
                worst_abs = max(worst_abs, err)
                if abs(an) > 1e-4:
                    worst_rel = max(worst_rel, err / abs(an))
    return worst_rel, worst_abs


def check_block_identities(weights, input_ids, targets):
    """Block routing, on untied attnres-shaped weights: blocks of one output are full
    routing exactly; with zero queries every site is the uniform mean of v_0, its closed
    block sums and its partial sum, formed here from the outputs (blocks of 1..4, H = 1
    and H = 4)."""
    cfg = fixture_config("attnres")
    full = build_reference(cfg, weights, "cpu")(input_ids, targets)
    cfg1 = {"model": cfg["model"], "residual": dict(cfg["residual"], block_size=1)}
    ones = build_reference(cfg1, weights, "cpu")(input_ids, targets)
    assert torch.equal(full[0], ones[0]) and torch.equal(full[1], ones[1]), "block_size 1 differs from full routing"
    worst = 0.0
    zeroed = {n: (torch.zeros_like(w) if n.endswith(".query") else w) for n, w in weights.items()}
    for s in (1, 2, 3, 4):
        for heads, mode in ((1, "attnres"), (4, "mhar")):
            c = {"model": cfg["model"], "residual": {"mode": mode, "heads": heads, "block_size": s}}
            capture = {}
            build_reference(c, zeroed, "cpu")(input_ids, targets, capture=capture)
            v = capture["sources"]
            for j, x in enumerate(capture["site_inputs"]):
                closed = [sum(v[b - s + 1:b + 1]) for b in range(s, j + 1, s)]
                partial = [sum(v[j - j % s + 1:j + 1])] if j % s else []
                src = [v[0]] + closed + partial
                worst = max(worst, (x - torch.stack(src).mean(dim=0)).abs().max().item())
    assert worst < 1e-12, f"zero queries are not the uniform mean of the block sources (max diff {worst})"
    return worst


def check_routing_identities(weights_attnres, input_ids, targets):
    """mhar with H = 1 is attnres; zero queries make every site the uniform mean of its
    sources (for H = 1 and H = 4)."""
    cfg_attnres = fixture_config("attnres")
    cfg_mhar1 = {"model": cfg_attnres["model"], "residual": {"mode": "mhar", "heads": 1}}
    la, pa = build_reference(cfg_attnres, weights_attnres, "cpu")(input_ids, targets)
    lm, pm = build_reference(cfg_mhar1, weights_attnres, "cpu")(input_ids, targets)
    assert torch.equal(la, lm) and torch.equal(pa, pm), "mhar H=1 differs from attnres"

    worst = 0.0
    for heads in (1, 4):
        cfg = {"model": cfg_attnres["model"], "residual": {"mode": "mhar", "heads": heads}}
        zeroed = {n: (torch.zeros_like(w) if n.endswith(".query") else w) for n, w in weights_attnres.items()}
        capture = {}
        build_reference(cfg, zeroed, "cpu")(input_ids, targets, capture=capture)
        for j, x in enumerate(capture["site_inputs"]):
            mean = torch.stack(capture["sources"][: j + 1]).mean(dim=0)
            worst = max(worst, (x - mean).abs().max().item())
    assert worst < 1e-12, f"zero queries are not the uniform mean (max diff {worst})"
    return worst


def check_hyper_identities(weights_standard, input_ids, targets):
    """Static Hyper-Connections at their init are the pre-norm residual: with one stream
    the loss and logits equal `standard` exactly and every shared gradient to 1e-13 (autograd's
    own summation order); with n = 3 and 4
    every sublayer input equals standard's exactly (the head reads n times the stream,
    which the final RMSNorm undoes up to its eps)."""
    cfg_std = fixture_config("standard")
    ref = build_reference(cfg_std, weights_standard, "cpu")
    cap_std = {}
    logits_s, loss_s = ref(input_ids, targets, capture=cap_std)
    loss_s.backward()
    for n in (1, 3, 4):
        cfg = {"model": cfg_std["model"], "residual": {"mode": "hyper", "hyper_n": n}}
        model = mhar_ref.MharModel(cfg, attn_impl="manual", dtype=torch.float64)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.startswith("model.hyper."):
                    p.copy_(weights_standard[name].to(torch.float64))
        cap = {}
        logits_h, loss_h = model(input_ids, targets, capture=cap)
        for j in range(len(cap["site_inputs"]) - 1):
            assert torch.equal(cap["site_inputs"][j], cap_std["site_inputs"][j]), f"hyper n={n} site {j}"
        if n == 1:
            loss_h.backward()
            assert torch.equal(loss_h, loss_s) and torch.equal(logits_h, logits_s), "hyper n=1 loss differs"
            std_grads = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                if not name.startswith("model.hyper."):
                    # autograd sums the einsum's backward in its own order: equal to rounding.
                    g_s = std_grads[name].grad
                    err = ((p.grad - g_s).abs().max() / g_s.abs().max()).item()
                    assert err < 1e-13, f"hyper n=1 gradient of {name}: max rel diff {err}"
    return True


def check_delta_identities(weights_standard, input_ids, targets):
    """Mode delta with every gate 0 is `standard` exactly (loss and logits), whatever its
    routing queries, gains and null (random here, so the gated-off term is not 0), with
    blocks of 1 and 2 layers; and a non-zero gate changes the loss."""
    cfg_std = fixture_config("standard")
    std = build_reference(cfg_std, weights_standard, "cpu")
    logits_s, loss_s = std(input_ids, targets)
    gen = torch.Generator().manual_seed(77)
    for b in (1, 2):
        cfg = {"model": cfg_std["model"], "residual": {"mode": "delta", "block_layers": b}}
        model = mhar_ref.MharModel(cfg, attn_impl="manual", dtype=torch.float64)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in weights_standard:
                    p.copy_(weights_standard[name].to(torch.float64))
                elif not name.endswith(".alpha"):
                    p.normal_(generator=gen)
        logits_d, loss_d = model(input_ids, targets)
        assert torch.equal(loss_d, loss_s) and torch.equal(logits_d, logits_s), f"delta b={b} differs at alpha 0"
        with torch.no_grad():
            model.model.delta[3].alpha.fill_(0.5)
        assert not torch.equal(model(input_ids, targets)[1], loss_s), f"delta b={b}: the gate does nothing"


def check_no_future_sources(cfg, weights, input_ids):
    """Nothing reads the future: recomputing site j from v_0..v_j alone reproduces the
    input it had in the full forward pass."""
    model = build_reference(cfg, weights, "cpu")
    capture = {}
    model(input_ids, capture=capture)
    sources = capture["sources"]
    for j, site in enumerate(model.model.routing):
        x = site(model.routed_sources(sources[: j + 1]))
        assert torch.allclose(x, capture["site_inputs"][j], rtol=0, atol=1e-14)
    return True


# A loop-by-loop NumPy re-implementation of the forward pass: a second reading of the
# equations, independent of the vectorised head reshapes in mhar_ref.py.

def numpy_forward(cfg, weights, input_ids):
    m, r = cfg["model"], mhar_ref.resolve_config(cfg)["residual"]
    W = {n: w.to(torch.float64).numpy() for n, w in weights.items()}
    d, L, eps = m["d_model"], m["n_layers"], m["rms_eps"]
    nh, nkv, hd = m["n_heads"], m["n_kv_heads"], m["head_dim"]
    half = hd // 2

    def rmsnorm(x, w=None):
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y * w if w is not None else y

    def rope(vec, pos):
        out = np.empty_like(vec)
        for i in range(half):
            angle = pos * m["rope_theta"] ** (-2.0 * i / hd)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = vec[i] * c - vec[i + half] * s
            out[i + half] = vec[i + half] * c + vec[i] * s
        return out

    def site(j, outputs):
        if r["mode"] == "standard":
            return sum(outputs)
        if r["mode"] == "delta":
            # The standard sum plus alpha_j times the routing of the null source (a row
            # per token in v_0's place) and the block sums of 2 * block_layers outputs.
            null = np.broadcast_to(W["model.delta.null"], outputs[0].shape)
            routed = route(j, [null] + list(outputs[1:]), 2 * r["block_layers"], "model.delta")
            return sum(outputs) + W[f"model.delta.{j}.alpha"][0] * routed
        return route(j, outputs, r["block_size"], "model.routing")

    def route(j, outputs, s, prefix):
        # Block routing: v_0, then the running sum of each block, each restarted after
        # every s-th output (the last one the current block's partial sum).
        sources = [outputs[0]]
        for i, v in enumerate(outputs[1:], start=1):
            if s and (i - 1) % s:
                sources[-1] = sources[-1] + v
            else:
                sources.append(v)
        H, q, g = r["heads"], W[f"{prefix}.{j}.query"], W[f"{prefix}.{j}.gain"]
        T = sources[0].shape[0]
        out = np.zeros_like(sources[0])
        for t in range(T):
            for h in range(H):
                cs = slice(h * d // H, (h + 1) * d // H)
                s = np.array([np.sum(q[cs] * (g * rmsnorm(v[t]))[cs]) for v in sources])
                a = np.exp(s - s.max())
                a /= a.sum()
                for i, v in enumerate(sources):
                    out[t, cs] += a[i] * v[t, cs]
        return out

    def attention(l, x):
        p = f"model.layers.{l}.self_attn."
        T = x.shape[0]
        q = (x @ W[p + "q_proj.weight"].T).reshape(T, nh, hd)
        k = (x @ W[p + "k_proj.weight"].T).reshape(T, nkv, hd)
        v = (x @ W[p + "v_proj.weight"].T).reshape(T, nkv, hd)
        out = np.zeros((T, nh, hd))
        for head in range(nh):
            kvh = head // (nh // nkv)
            qs = [rope(rmsnorm(q[t, head], W[p + "q_norm.weight"]), t) for t in range(T)]
            ks = [rope(rmsnorm(k[t, kvh], W[p + "k_norm.weight"]), t) for t in range(T)]
            for t in range(T):
                sc = np.array([qs[t] @ ks[u] / math.sqrt(hd) for u in range(t + 1)])
                a = np.exp(sc - sc.max())
                a /= a.sum()
                out[t, head] = sum(a[u] * v[u, kvh] for u in range(t + 1))
        return out.reshape(T, nh * hd) @ W[p + "o_proj.weight"].T

    def mlp(l, x):
        p = f"model.layers.{l}.mlp."
        gate, up = x @ W[p + "gate_proj.weight"].T, x @ W[p + "up_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * up) @ W[p + "down_proj.weight"].T

    head_w = W["model.embed_tokens.weight"] if m["tie_embeddings"] else W["lm_head.weight"]
    all_logits = []
    if r["mode"] == "hyper":
        # Hyper-Connections, element by element: n explicit stream arrays.
        n = r["hyper_n"]
        for seq in input_ids.numpy():
            streams = [W["model.embed_tokens.weight"][seq].copy() for _ in range(n)]
            for k in range(2 * L):
                l, pre = k // 2, f"model.hyper.{k}."
                # Per token coefficients [T, n] / [T, n, n] (dynamic) or constants.
                T = streams[0].shape[0]
                am = np.tile(W[pre + "a_m"], (T, 1))
                ar = np.tile(W[pre + "a_r"], (T, 1, 1))
                b = np.tile(W[pre + "b"], (T, 1))
                if r["hyper_dynamic"]:
                    w, sa, sb = W[pre + "w"], W[pre + "s_a"][0], W[pre + "s_b"][0]
                    for t in range(T):
                        for rr in range(n):
                            hb = rmsnorm(streams[rr][t])
                            am[t, rr] += sa * math.tanh(hb @ w[:, 0])
                            for i in range(n):
                                ar[t, rr, i] += sa * math.tanh(hb @ w[:, 1 + i])
                            b[t, rr] += sb * math.tanh(hb @ w[:, n + 1])
                x = np.zeros_like(streams[0])
                for i in range(n):
                    x += am[:, i : i + 1] * streams[i]
                if k % 2 == 0:
                    v = attention(l, rmsnorm(x, W[f"model.layers.{l}.input_layernorm.weight"]))
                else:
                    v = mlp(l, rmsnorm(x, W[f"model.layers.{l}.post_attention_layernorm.weight"]))
                new = []
                for i in range(n):
                    h = b[:, i : i + 1] * v
                    for rr in range(n):
                        h = h + ar[:, rr, i : i + 1] * streams[rr]
                    new.append(h)
                streams = new
            x = sum(streams)
            all_logits.append(rmsnorm(x, W["model.norm.weight"]) @ head_w.T)
        return np.stack(all_logits)
    for seq in input_ids.numpy():
        sources = [W["model.embed_tokens.weight"][seq]]
        for l in range(L):
            x = site(len(sources) - 1, sources)
            sources.append(attention(l, rmsnorm(x, W[f"model.layers.{l}.input_layernorm.weight"])))
            x = site(len(sources) - 1, sources)
            sources.append(mlp(l, rmsnorm(x, W[f"model.layers.{l}.post_attention_layernorm.weight"])))
        x = site(len(sources) - 1, sources)
        all_logits.append(rmsnorm(x, W["model.norm.weight"]) @ head_w.T)
    return np.stack(all_logits)


def check_against_transformers(cfg, weights, input_ids, logits):
    """Loads the `standard` weights into Hugging Face's own Qwen3ForCausalLM (eager
    attention, float64) and compares logits. HF forms RoPE angles in float32, so the
    difference is ~1e-6, not 1e-15."""
    try:
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except Exception as e:  # not installed, or too old for Qwen3
        return f"skipped ({type(e).__name__}: {e})"
    m = cfg["model"]
    hf_cfg = Qwen3Config(
        vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"], head_dim=m["head_dim"],
        max_position_embeddings=m["context_length"], rms_norm_eps=m["rms_eps"],
        rope_theta=m["rope_theta"], tie_word_embeddings=m["tie_embeddings"],
        attention_bias=False, hidden_act="silu", use_sliding_window=False, attn_implementation="eager",
    )
    # transformers >= 5 keeps RoPE settings in rope_parameters.
    rp = getattr(hf_cfg, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = m["rope_theta"]
    hf = Qwen3ForCausalLM(hf_cfg).to(torch.float64).eval()
    state = {n: w.to(torch.float64) for n, w in weights.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m["tie_embeddings"])]
    if missing or unexpected:
        return f"FAILED: names differ (missing {missing}, unexpected {unexpected})"
    if m["tie_embeddings"]:
        hf.tie_weights()
    with torch.no_grad():
        hf_logits = hf(input_ids=input_ids).logits.to(torch.float64)
    diff = (hf_logits - logits).abs().max().item()
    status = "ok" if diff < 1e-4 else "FAILED"
    return f"{status}: transformers {transformers.__version__} Qwen3ForCausalLM max |logit diff| = {diff:.3e}"


# ---------------------------------------------------------------------------------------

def make_fixture(name, device, out_dir, log):
    cfg = fixture_config(name)
    mode = name  # the fixture's name, in the log and the file name
    seed = FIXTURES[name][3]
    gen = torch.Generator().manual_seed(seed)
    V = cfg["model"]["vocab_size"]
    shape_model = mhar_ref.MharModel(cfg, dtype=torch.float32)
    weights = random_weights(shape_model, gen)
    input_ids = torch.randint(V, (BATCH, SEQ_LEN), generator=gen)
    targets = torch.randint(V, (BATCH, SEQ_LEN), generator=gen)

    t0 = time.time()
    loss, logits, grads = run_reference(cfg, weights, input_ids, targets, device)
    log(f"[{mode}] loss {loss.item():.12f} on {device} ({time.time() - t0:.2f}s)")

    if device != "cpu":
        # The same float64 computation on the CPU: the fixture does not hinge on one
        # device's kernels.
        loss_c, logits_c, grads_c = run_reference(cfg, weights, input_ids, targets, "cpu")
        worst = max(((grads[n] - grads_c[n]).abs().max() / grads_c[n].abs().max()).item() for n in grads)
        log(f"[{mode}] {device} vs cpu float64: |dloss| {abs(loss - loss_c).item():.2e}, "
            f"max |dlogit| {(logits - logits_c).abs().max().item():.2e}, max grad diff / max |grad| {worst:.2e}")
        assert worst < 1e-10

    rel, ab = finite_difference_check(cfg, weights, input_ids, targets, grads, gen)
    log(f"[{mode}] finite differences (2 entries per tensor, 5-point stencil, step 3e-4): max rel err {rel:.2e}, max abs err {ab:.2e}")
    assert rel < 1e-6, "autograd disagrees with finite differences"

    np_logits = numpy_forward(cfg, weights, input_ids)
    diff = np.abs(np_logits - logits.numpy()).max()
    log(f"[{mode}] loop-by-loop NumPy forward: max |logit diff| {diff:.2e}")
    assert diff < 1e-10, "NumPy re-implementation disagrees"
    np_loss = torch.nn.functional.cross_entropy(torch.from_numpy(np_logits).reshape(-1, V), targets.reshape(-1))
    assert abs(np_loss.item() - loss.item()) < 1e-10

    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        # The benchmark's SDPA path must be the same function as the explicit math.
        sdpa = mhar_ref.MharModel(cfg, attn_impl="sdpa", device=device, dtype=torch.float64)
        sdpa.load_state_dict(build_reference(cfg, weights, device).state_dict())
        with torch.no_grad():
            diff = (sdpa(input_ids.to(device))[0].cpu() - logits).abs().max().item()
        log(f"[{mode}] SDPA attention path (gqa {sdpa.model.layers[0].self_attn.sdpa_gqa}) vs explicit math: "
            f"max |logit diff| {diff:.2e}")
        assert diff < 1e-10
    if cfg["residual"]["mode"] in mhar_ref.ROUTED_MODES:
        check_no_future_sources(cfg, weights, input_ids)
    if mode == "standard":
        try:
            verdict = check_against_transformers(cfg, weights, input_ids, logits)
        except Exception as e:  # an API drift in transformers must not cost the fixtures
            verdict = f"error ({type(e).__name__}: {e})"
        log(f"[{mode}] Hugging Face check: {verdict}")

    # Dead-path guard: every gradient tensor must be non-trivial, or the fixture would
    # not catch a wrong backward term there.
    # Site 0 mixes the single source v_0 (the null in mode delta) with weight 1, so its
    # query and gain get exactly zero gradient: the engine must reproduce those zeros.
    for name, g in grads.items():
        if name.startswith(("model.routing.0.", "model.delta.0.query", "model.delta.0.gain")):
            assert g.abs().max() == 0, f"gradient of {name} should be exactly 0"
        else:
            assert g.abs().max() > 1e-6, f"gradient of {name} is ~0: the fixture would not test it"

    arrays = {name: w.numpy().astype("<f4") for name, w in weights.items()}
    arrays["input_ids"] = input_ids.numpy().astype("<i4")
    arrays["targets"] = targets.numpy().astype("<i4")
    arrays["expected.loss"] = loss.reshape(1).numpy().astype("<f8")
    arrays["expected.logits"] = logits.numpy().astype("<f8")
    for name, g in grads.items():
        arrays["expected.grad." + name] = g.numpy().astype("<f8")
    config_json = dict(cfg, batch=BATCH, seq_len=SEQ_LEN)
    metadata = {
        "config": json.dumps(config_json),
        "generator": "tools/reference/make_golden.py",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "seed": str(seed),
        "dtype_note": "weights F32 (stored values are exact); expected.* computed in float64 from them",
    }
    path = os.path.join(out_dir, f"{mode}.safetensors")
    write_safetensors(path, arrays, metadata)
    back, meta_back = read_safetensors(path)
    assert meta_back == metadata and all(np.array_equal(back[n], arrays[n]) for n in arrays)
    log(f"[{mode}] wrote {path} ({os.path.getsize(path)} bytes, {len(arrays)} tensors); "
        f"{crosscheck_with_package(path, arrays)}")
    return weights, input_ids, targets


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "..", "..", "tests", "fixtures", "golden"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default=",".join(FIXTURES))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    log(f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    made = {}
    for mode in args.modes.split(","):
        made[mode] = make_fixture(mode, args.device, args.out, log)
    if "attnres" in made:
        w, ids, tg = made["attnres"]
        worst = check_routing_identities(w, ids, tg)
        log(f"routing identities: mhar H=1 == attnres exactly; zero queries == uniform mean "
            f"(H=1 and H=4, max diff {worst:.1e})")
    if "standard" in made:
        w, ids, tg = made["standard"]
        check_hyper_identities(w, ids, tg)
        log("hyper identities: n=1 at init == standard (loss, logits exactly; shared gradients to 1e-13); "
            "n=1,3,4 at init: every sublayer input == standard's exactly")
    if "standard" in made:
        w, ids, tg = made["standard"]
        check_delta_identities(w, ids, tg)
        log("delta identities: every gate 0 == standard exactly (loss, logits; random queries, gains "
            "and null; blocks of 1 and 2 layers); a non-zero gate changes the loss")
    untied = [n for n in ("attnres_block", "attnres") if n in made]
    if untied:
        w, ids, tg = made[untied[0]]
        worst = check_block_identities(w, ids, tg)
        log(f"block identities: block_size 1 == full routing exactly; zero queries == uniform mean of "
            f"v_0, closed block sums and partial sum (blocks of 1..4, H=1 and H=4, max diff {worst:.1e})")
    log("all checks passed")


if __name__ == "__main__":
    main()
