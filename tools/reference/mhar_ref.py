# mhar_ref.py: the independent PyTorch reference of the mhar model (DESIGN.md sections
# 1-2), written from the equations: a Qwen3-style decoder whose sublayer inputs come
# from one of the residual modes `standard`, `attnres` or `mhar`, the routed ones with
# full or block routing (residual.block_size), or `hyper` (static or dynamic
# Hyper-Connections with residual.hyper_n streams), or `delta` (the standard stream plus a
# gated routed term over the null source and block sums, DESIGN.md section 2). It owns the model's
# math for the golden fixtures (tools/reference/make_golden.py, run in float64) and for
# the PyTorch throughput baseline (tools/reference/bench_step.py, bf16 autocast,
# torch.compile, SDPA). Parameter names are Hugging Face Qwen3's (DESIGN.md section 6)
# plus model.routing.{j}.query / .gain (routed modes) or model.hyper.{k}.a_m / .a_r / .b
# (hyper; dynamic adds .w / .s_a / .s_b) or model.delta.{j}.alpha / .query / .gain and
# model.delta.null (delta), so a state_dict is a checkpoint of the engine.
#
# Nothing here is tied to a dtype or device: build the module, move it with .to(), and
# every computation follows the parameters' dtype (float64 works end to end).
import copy
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

RESIDUAL_MODES = ("standard", "attnres", "mhar", "hyper", "delta")
ROUTED_MODES = ("attnres", "mhar")

# Defaults of the engine's config (engine/config.h), so a partial config file means the
# same thing here as there.
DEFAULT_CONFIG = {
    "model": {
        "vocab_size": 50304,
        "d_model": 512,
        "n_layers": 12,
        "n_heads": 8,
        "n_kv_heads": 4,
        "head_dim": 64,
        "d_ff": 1536,
        "context_length": 2048,
        "rope_theta": 1e6,
        "rms_eps": 1e-6,
        "tie_embeddings": True,
        "init_std": 0.02,
    },
    "residual": {"mode": "standard", "heads": 0, "block_size": 0, "hyper_n": 4, "hyper_dynamic": False,
                 "block_layers": 4},
}


def resolve_config(config):
    """Returns a full copy of `config` (engine format: {"model": {...}, "residual":
    {...}}, other sections ignored) with defaults filled in and residual.heads resolved
    the way the engine resolves it (0 means 1 for attnres and n_kv_heads for mhar)."""
    out = copy.deepcopy(DEFAULT_CONFIG)
    for section in ("model", "residual"):
        for key, value in (config.get(section) or {}).items():
            if key not in out[section]:
                raise ValueError(f"unknown key {section}.{key}")
            out[section][key] = value
    m, r = out["model"], out["residual"]
    if r["mode"] not in RESIDUAL_MODES:
        raise ValueError(f"residual.mode = {r['mode']!r}; valid: {RESIDUAL_MODES}")
    if r["heads"] == 0:
        r["heads"] = {"standard": 0, "attnres": 1, "mhar": m["n_kv_heads"], "hyper": 0,
                      "delta": m["n_kv_heads"]}[r["mode"]]
    if r["mode"] == "attnres" and r["heads"] != 1:
        raise ValueError("residual.mode attnres is routing with exactly 1 head")
    if r["mode"] in ROUTED_MODES + ("delta",) and m["d_model"] % r["heads"]:
        raise ValueError(f"residual.heads = {r['heads']} does not divide d_model = {m['d_model']}")
    s = r["block_size"]
    if not isinstance(s, int) or s < 0:
        raise ValueError(f"residual.block_size = {s!r}; valid: 0 (full routing) or 1..2*n_layers")
    if r["mode"] not in ROUTED_MODES and s:
        raise ValueError(f"residual.block_size has no meaning in mode {r['mode']}; leave it 0")
    if r["mode"] == "hyper":
        if r["heads"]:
            raise ValueError("residual.heads has no meaning in mode hyper; leave it 0")
        if not isinstance(r["hyper_n"], int) or not 1 <= r["hyper_n"] <= 64:
            raise ValueError(f"residual.hyper_n = {r['hyper_n']!r}; valid: 1..64")
        if not isinstance(r["hyper_dynamic"], bool):
            raise ValueError(f"residual.hyper_dynamic = {r['hyper_dynamic']!r}; valid: true or false")
    b = r["block_layers"]
    if r["mode"] == "delta":
        if not isinstance(b, int) or not 1 <= b <= m["n_layers"]:
            raise ValueError(f"residual.block_layers = {b!r}; valid: 1..n_layers = {m['n_layers']}")
    elif b != DEFAULT_CONFIG["residual"]["block_layers"]:
        raise ValueError(f"residual.block_layers has no meaning in mode {r['mode']}; leave it out")
    if s > 2 * m["n_layers"]:
        raise ValueError(f"residual.block_size = {s} is more than the 2*n_layers = {2 * m['n_layers']} sublayers")
    if m["n_heads"] % m["n_kv_heads"]:
        raise ValueError("n_kv_heads must divide n_heads (GQA)")
    if m["head_dim"] % 2:
        raise ValueError("head_dim must be even (RoPE pairs i with i + head_dim/2)")
    return out


def load_config(path):
    with open(path) as f:
        return json.load(f)


def _autocast_dtype(device_type):
    """The dtype autocast computes in on `device_type`, or None when autocast is off.
    PyTorch >= 2.4 has the per-device API (which torch.compile traces); older releases
    only the per-backend functions."""
    if hasattr(torch, "get_autocast_dtype"):
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    if device_type == "cuda":
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return None


def _stat_dtype(dtype):
    # Norm statistics and routing logits/softmax run in at least float32, as the engine
    # does in bf16 (DESIGN.md section 5); float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def rms_normalize(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last dimension, without a learned scale;
    computed in at least float32 and returned in that precision."""
    xs = x.to(_stat_dtype(x.dtype))
    return xs * torch.rsqrt(xs.pow(2).mean(dim=-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-feature weight (init 1)."""

    def __init__(self, dim, eps, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        return rms_normalize(x, self.eps).to(x.dtype) * self.weight


def rope_cos_sin(seq_len, head_dim, theta, device, dtype):
    """cos/sin tables [seq_len, head_dim] in Hugging Face's rotate-half layout: feature
    i and i + head_dim/2 share the angle pos * theta^(-2i/head_dim). Angles are formed
    in float64 so the float64 reference carries no float32 rounding."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=device, dtype=torch.float64) * 2.0 / head_dim)
    pos = torch.arange(seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B, heads, T, head_dim]: out_i = x_i cos - x_{i+h/2} sin for the first half,
    out_{i+h/2} = x_{i+h/2} cos + x_i sin for the second (rotate-half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def _sdpa_supports_gqa():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


class Attention(nn.Module):
    """Causal GQA self-attention with QK-norm and RoPE (Qwen3). `impl` is "manual"
    (the explicit math: scores, mask, softmax, weighted sum; works in any dtype) or
    "sdpa" (F.scaled_dot_product_attention(is_causal=True), for speed)."""

    def __init__(self, m, impl="manual", sdpa_gqa="auto", device=None, dtype=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = m["n_heads"], m["n_kv_heads"], m["head_dim"]
        self.rope_theta = float(m["rope_theta"])
        self.impl = impl
        # "native": enable_gqa=True lets SDPA read the shared KV heads in place;
        # "expand": repeat KV heads first (older PyTorch, or kernels without GQA).
        self.sdpa_gqa = ("native" if _sdpa_supports_gqa() else "expand") if sdpa_gqa == "auto" else sdpa_gqa
        d, q_dim, kv_dim = m["d_model"], self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d, q_dim, **kw)
        self.k_proj = nn.Linear(d, kv_dim, **kw)
        self.v_proj = nn.Linear(d, kv_dim, **kw)
        self.o_proj = nn.Linear(q_dim, d, **kw)
        self.q_norm = RMSNorm(self.head_dim, m["rms_eps"], device=device, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, m["rms_eps"], device=device, dtype=dtype)

    def forward(self, x):
        B, T, _ = x.shape
        # QK-norm acts per head over head_dim, before the heads move in front of T.
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # Position = index in the sequence.
        cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Each stage of a real QK-norm output keeps its dtype; under autocast q/k become
        # float32 through the norm weight, so bring them to v's dtype for the product.
        q, k = q.to(v.dtype), k.to(v.dtype)
        group = self.n_heads // self.n_kv_heads  # query heads per KV head
        if self.impl == "sdpa":
            if self.sdpa_gqa == "native" and group > 1:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Query head h reads KV head h // group (Hugging Face's repeat_kv layout).
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
            out = torch.softmax(scores.to(_stat_dtype(scores.dtype)), dim=-1).to(v.dtype) @ v
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, m, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(m["d_model"], m["d_ff"], **kw)
        self.up_proj = nn.Linear(m["d_model"], m["d_ff"], **kw)
        self.down_proj = nn.Linear(m["d_ff"], m["d_model"], **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, m, attn_impl, sdpa_gqa, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(m["d_model"], m["rms_eps"], device=device, dtype=dtype)
        self.self_attn = Attention(m, attn_impl, sdpa_gqa, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(m["d_model"], m["rms_eps"], device=device, dtype=dtype)
        self.mlp = MLP(m, device=device, dtype=dtype)

    # The two sublayers are called separately: each reads its own routed input.
    def attention_sublayer(self, x):
        return self.self_attn(self.input_layernorm(x))

    def mlp_sublayer(self, x):
        return self.mlp(self.post_attention_layernorm(x))


def block_sources(outputs, block_size):
    """The sources of a site under block routing (DESIGN.md section 2), from its
    outputs v_0..v_j: v_0, the sum of each completed block of `block_size` consecutive
    outputs among v_1..v_j, then the partial sum of the current block when it has any
    outputs. block_size 0 is full routing: the outputs themselves."""
    if block_size == 0:
        return list(outputs)
    out = [outputs[0]]
    for first in range(1, len(outputs), block_size):
        block = outputs[first:first + block_size]
        total = block[0]
        for v in block[1:]:
            total = total + v
        out.append(total)
    return out


class RoutingSite(nn.Module):
    """Depth routing at one site j: a per-token, per-head softmax mix of its sources
    (v_0..v_j, or their block sums: block_sources) (DESIGN.md section 2). query q_j
    (init 0) and gain g_j (init 1), both [d]; head h owns features [h*d/H, (h+1)*d/H)."""

    def __init__(self, d, heads, eps, device=None, dtype=None):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.query = nn.Parameter(torch.zeros(d, device=device, dtype=dtype))
        self.gain = nn.Parameter(torch.ones(d, device=device, dtype=dtype))

    def forward(self, sources):
        V = torch.stack(sources)  # [n, B, T, d], n = j + 1
        n, B, T, d = V.shape
        H = self.heads
        # k_i = g_j * RMSNorm(v_i): the norm is over the full d and has no learned scale.
        K = self.gain * rms_normalize(V, self.eps)
        # s_{i,h} = sum_{c in h} q_j[c] k_i[c]; no 1/sqrt scaling.
        logits = (self.query * K).view(n, B, T, H, d // H).sum(dim=-1)
        weights = torch.softmax(logits, dim=0)  # over the site's sources
        # x_j[c] = sum_i a_{i, head(c)} v_i[c]
        mixed = (weights.unsqueeze(-1) * V.view(n, B, T, H, d // H)).sum(dim=0)
        return mixed.reshape(B, T, d).to(V.dtype)


class DeltaSites(nn.ModuleList):
    """Mode delta's routed term (DESIGN.md section 2): one DeltaSite per site j and the
    null source `null` [d] (init 0), the slot-0 source of every site in place of v_0."""

    def __init__(self, n_sites, d, heads, eps, device=None, dtype=None):
        super().__init__(DeltaSite(d, heads, eps, device=device, dtype=dtype) for _ in range(n_sites))
        self.null = nn.Parameter(torch.zeros(d, device=device, dtype=dtype))


class DeltaSite(RoutingSite):
    """Site j of mode delta: routing (query init 0, gain init 1) plus the scalar gate
    alpha_j (init 0) that scales the routed term added to the standard stream."""

    def __init__(self, d, heads, eps, device=None, dtype=None):
        super().__init__(d, heads, eps, device=device, dtype=dtype)
        self.alpha = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))


class HyperConnection(nn.Module):
    """Hyper-Connections around sublayer k (DESIGN.md section 2), n streams
    H [n, B, T, d]: the sublayer reads x = sum_i a_m[i] h_i, and its output v makes the
    new streams h'_i = b[i] v + sum_r a_r[r, i] h_r. Init (the pre-norm residual):
    a_m = one-hot(k mod n), a_r = I_n, b = 1.
    Dynamic (d_model given): per token, every coefficient of stream r adds s * tanh of
    hbar_r @ w, hbar_r = h_r / rms(h_r) (RMSNorm without scale, eps), w [d, n+2]
    (columns: a_m, a_r[r, :], b; init 0), s = s_a for a_m and a_r, s_b for b (init 0.01)."""

    def __init__(self, n, k, d_model=None, eps=None, device=None, dtype=None):
        super().__init__()
        self.k, self.eps = k, eps
        kw = dict(device=device, dtype=dtype)
        self.a_m = nn.Parameter(torch.zeros(n, **kw))
        self.a_r = nn.Parameter(torch.zeros(n, n, **kw))
        self.b = nn.Parameter(torch.zeros(n, **kw))
        self.dynamic = d_model is not None
        if self.dynamic:
            self.w = nn.Parameter(torch.zeros(d_model, n + 2, **kw))
            self.s_a = nn.Parameter(torch.zeros(1, **kw))
            self.s_b = nn.Parameter(torch.zeros(1, **kw))
        self.reset()

    @torch.no_grad()
    def reset(self):
        n = self.a_m.numel()
        self.a_m.zero_()[self.k % n] = 1.0
        self.a_r.copy_(torch.eye(n, dtype=self.a_r.dtype, device=self.a_r.device))
        self.b.fill_(1.0)
        if self.dynamic:
            self.w.zero_()
            self.s_a.fill_(0.01)
            self.s_b.fill_(0.01)

    def coef(self, H):
        """[n, ..., n+2]: per stream r and token, (a_m[r], a_r[r, :], b[r]) (dynamic or not)."""
        n = self.a_m.numel()
        base = torch.cat([self.a_m[:, None], self.a_r, self.b[:, None]], dim=1)  # [n, n+2]
        base = base.view(n, *([1] * (H.dim() - 2)), n + 2)
        if not self.dynamic:
            return base
        hbar = H * torch.rsqrt(H.pow(2).mean(-1, keepdim=True) + self.eps)
        s = torch.cat([self.s_a.expand(n + 1), self.s_b])
        return base + s * torch.tanh(hbar @ self.w)

    def mix(self, H):
        if not self.dynamic:  # static: the original fixtures' exact arithmetic
            return torch.einsum("i,i...->...", self.a_m, H)
        self._c = self.coef(H)  # the update of the same sublayer reads these H's coefficients
        return (self._c[..., 0:1] * H).sum(dim=0)

    def update(self, H, v):
        if not self.dynamic:
            return self.b.view(-1, *([1] * v.dim())) * v + torch.einsum("ri,r...->i...", self.a_r, H)
        c, n = self._c, self.a_m.numel()
        out = c[..., n + 1 : n + 2] * v  # [n, ..., 1] * [..., d]: b[i] v
        return out + torch.einsum("r...i,r...c->i...c", c[..., 1 : n + 1].expand(*H.shape[:-1], n), H)


class Backbone(nn.Module):
    """Holds the `model.*` parameters under Hugging Face Qwen3's names."""

    def __init__(self, cfg, attn_impl, sdpa_gqa, device=None, dtype=None):
        super().__init__()
        m, r = cfg["model"], cfg["residual"]
        self.embed_tokens = nn.Embedding(m["vocab_size"], m["d_model"], device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(m, attn_impl, sdpa_gqa, device=device, dtype=dtype) for _ in range(m["n_layers"])
        )
        self.norm = RMSNorm(m["d_model"], m["rms_eps"], device=device, dtype=dtype)
        if r["mode"] == "hyper":
            self.hyper = nn.ModuleList(
                HyperConnection(r["hyper_n"], k, m["d_model"] if r["hyper_dynamic"] else None, m["rms_eps"],
                                device=device, dtype=dtype)
                for k in range(2 * m["n_layers"])
            )
        if r["mode"] == "delta":
            self.delta = DeltaSites(2 * m["n_layers"] + 1, m["d_model"], r["heads"], m["rms_eps"],
                                    device=device, dtype=dtype)
        if r["mode"] in ROUTED_MODES:
            n_sites = 2 * m["n_layers"] + 1
            self.routing = nn.ModuleList(
                RoutingSite(m["d_model"], r["heads"], m["rms_eps"], device=device, dtype=dtype)
                for _ in range(n_sites)
            )


class MharModel(nn.Module):
    """The whole model. forward(input_ids [B,T], targets [B,T] or None) returns
    (logits [B,T,V] or None, loss or None); loss is the mean cross-entropy over all
    B*T tokens.

    attn_impl: "manual" (explicit math; the reference) or "sdpa".
    """

    def __init__(self, config, attn_impl="manual", sdpa_gqa="auto", device=None, dtype=None):
        super().__init__()
        self.config = resolve_config(config)
        m, r = self.config["model"], self.config["residual"]
        self.mode = r["mode"]
        # Mode delta routes block sums of 2 * block_layers sublayer outputs.
        self.block_size = 2 * r["block_layers"] if r["mode"] == "delta" else r["block_size"]
        self.n_layers = m["n_layers"]
        self.model = Backbone(self.config, attn_impl, sdpa_gqa, device=device, dtype=dtype)
        if not m["tie_embeddings"]:
            self.lm_head = nn.Linear(m["d_model"], m["vocab_size"], bias=False, device=device, dtype=dtype)
        self.init_weights()

    def lm_head_weight(self):
        return self.model.embed_tokens.weight if self.config["model"]["tie_embeddings"] else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, generator=None):
        """DESIGN.md section 1-2 init: matrices normal(0, init_std), output projections
        (o_proj, down_proj) scaled by 1/sqrt(2L), norms 1, routing queries 0, gains 1,
        hyper coefficients the pre-norm residual (HyperConnection.reset), delta gates and
        null 0."""
        std = self.config["model"]["init_std"]
        out_std = std / math.sqrt(2 * self.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, out_std, generator=generator)
            elif name.endswith((".query", ".alpha")) or name == "model.delta.null":
                p.zero_()
            elif name.endswith(("norm.weight", ".gain")):
                p.fill_(1.0)
            elif name.startswith("model.hyper."):
                pass  # below
            else:
                p.normal_(0.0, std, generator=generator)
        for hc in getattr(self.model, "hyper", []):
            hc.reset()

    def routed_sources(self, outputs):
        """The sources a routing site mixes, from the outputs v_0..v_j before it."""
        return block_sources(outputs, self.block_size)

    def site_input(self, j, sources, running_sum):
        """Input of site j (0..2L) from the outputs v_0..v_j."""
        if self.mode == "standard":
            return running_sum
        if self.mode == "delta":
            # The standard stream plus alpha_j times the routing of the null source (in
            # v_0's place) and the block sums, the current partial block included.
            routed = self.routed_sources(sources)
            routed[0] = self.model.delta.null.expand_as(sources[0]).to(sources[0].dtype)
            site = self.model.delta[j]
            return running_sum + site.alpha * site(routed)
        return self.model.routing[j](self.routed_sources(sources))

    def forward(self, input_ids, targets=None, return_logits=True, capture=None):
        """capture: optional dict; receives "sources" (the outputs v_0..v_2L) and
        "site_inputs" (x_0..x_2L), for tests of the routing identities."""
        h = self.model.embed_tokens(input_ids)
        # Under autocast every source should share the compute dtype, as the engine's
        # bf16 history does; the embedding lookup alone would stay float32.
        ac = _autocast_dtype(h.device.type)
        if ac is not None:
            h = h.to(ac)
        sources = [h]  # v_0
        running_sum = h  # standard mode's residual stream: sum of sources so far
        if self.mode == "hyper":  # n streams, each v_0
            streams = h.unsqueeze(0).expand(self.config["residual"]["hyper_n"], *h.shape)
        site_inputs = []
        for l, layer in enumerate(self.model.layers):
            for sub in (layer.attention_sublayer, layer.mlp_sublayer):
                j = len(sources) - 1  # site j feeds sublayer j and sees v_0..v_j
                if self.mode == "hyper":
                    x = self.model.hyper[j].mix(streams)
                else:
                    x = self.site_input(j, sources, running_sum)
                site_inputs.append(x)
                v = sub(x).to(h.dtype)
                sources.append(v)
                if self.mode in ("standard", "delta"):
                    running_sum = running_sum + v
                if self.mode == "hyper":
                    streams = self.model.hyper[j].update(streams, v)
        if self.mode == "hyper":  # site 2L: the head reads the sum of the streams
            x = streams.sum(dim=0)
        else:
            x = self.site_input(len(sources) - 1, sources, running_sum)  # site 2L: the final norm
        site_inputs.append(x)
        if capture is not None:
            capture["sources"], capture["site_inputs"] = sources, site_inputs
        logits = F.linear(self.model.norm(x), self.lm_head_weight())
        loss = None
        if targets is not None:
            V = logits.shape[-1]
            loss = F.cross_entropy(logits.reshape(-1, V).float() if logits.dtype in (torch.float16, torch.bfloat16)
                                   else logits.reshape(-1, V), targets.reshape(-1))
        return (logits if return_logits else None), loss


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())
