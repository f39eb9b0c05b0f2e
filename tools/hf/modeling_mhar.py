# modeling_mhar.py: the PyTorch model of an mhar export whose residual stream is not
# Qwen3's, for Hugging Face transformers (trust_remote_code=True; `mhar export` writes it
# beside config.json). Kept in the mhar repository (tools/hf/) and compiled into the
# engine by its build.
#
# The model is the engine's (DESIGN.md sections 1-2; engine/model.cpp, engine/cpu/): a
# Qwen3-style decoder whose sublayers each read their own input. Sources: v_0 = the
# embedding output, v_{2l+1} = attention output of layer l, v_{2l+2} = MLP output of layer
# l. Site j (0..2L; site 2L feeds the final norm) builds sublayer j's input x_j from
# v_0..v_j, as the config's residual_mode says; one function per mode below, each
# following the engine's scheme file:
#   standard  x_j = sum_{i<=j} v_i                          (residual_standard.cpp)
#   attnres / mhar: depth routing, H = routing_heads heads (residual_routed.cpp), over
#     the site's sources: v_0..v_j (block_size 0), or with blocks of s = block_size
#     outputs, v_0, the sums of the closed blocks and the current block's partial sum.
#     Head h owns features [h*d/H, (h+1)*d/H):
#       k_i = g_j * RMSNorm(v_i)            RMSNorm over the full d, no learned scale
#       s_ih = sum_{c in h} q_j[c] k_i[c]   no 1/sqrt scaling
#       a_ih = softmax over i of s_ih       per token, per head
#       x_j[c] = sum_i a_{i,head(c)} v_i[c]
#   hyper  Hyper-Connections, n = hyper_n streams H = [h_1..h_n], all v_0 at first
#     (residual_hyper.cpp): x_k = sum_r A_m[r] h_r; then h_i <- B[i] v_{k+1} +
#     sum_r A_r[r, i] h_r; the head reads sum_r h_r. hyper_dynamic: per token, stream r's
#     (A_m[r], A_r[r, :], B[r]) add s * tanh(RMSNorm(h_r) @ w) (s_a, s_a.., s_b).
#   delta  x_j = (v_0 + .. + v_j) + alpha_j * route_j(null, block sums of 2*block_layers
#     outputs, partial block included) (residual_delta.cpp), routing as above.
# Every mode mixes the sources of one token only, so generate() needs nothing cached
# beyond attention keys and values (a DynamicCache, one layer per decoder layer).
#
# Numerics follow the engine: RoPE angles in float64 (engine/cpu/rope.h), norm statistics,
# routing logits, softmax and mix, Hyper-Connection coefficients and stream mixing, and the
# delta gate in at least float32 whatever the weights' dtype; sources, block sums and
# streams are kept in the weights' dtype, as the engine keeps its history.
# Tensor names and shapes are the engine checkpoint's: Hugging Face Qwen3's, plus
#   attnres, mhar  model.routing.{j}.query, .gain                 [d] each, j = 0..2L
#   hyper          model.hyper.{k}.a_m [n], .a_r [n*n] (row-major: a_r[r*n + i] is stream
#                  r's share of new stream i), .b [n]; dynamic also .w [d*(n+2)]
#                  (row-major [d, n+2]; columns a_m, a_r[r, :], b), .s_a [1], .s_b [1];
#                  k = 0..2L-1
#   delta          model.delta.{j}.alpha [1], .query [d], .gain [d]; model.delta.null [d]
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_mhar import MharConfig


def _rms_normalize(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last dimension, in float32 (or float64)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


class MharRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * _rms_normalize(x, self.eps).to(x.dtype)


def _rope_cos_sin(position_ids, head_dim, theta, dtype):
    """cos/sin [B, 1, T, head_dim] in the rotate-half layout (feature i pairs with
    i + head_dim/2, angle pos * theta^(-2i/head_dim)), formed in float64 as the engine
    does, then rounded to `dtype`."""
    device = position_ids.device
    wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    half = head_dim // 2
    inv_freq = float(theta) ** (-torch.arange(half, device=device, dtype=wide) * 2.0 / head_dim)
    angles = position_ids.to(wide)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _additive_mask(attention_mask, batch, q_len, past, dtype, device):
    """[B, 1, q_len, past + q_len] with 0 where a query may attend and the dtype's most
    negative value elsewhere (causal, and padding from a 2-D mask). A finite value keeps
    fully masked rows (left padding) finite."""
    kv_len = past + q_len
    q_pos = torch.arange(past, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None].expand(batch, 1, q_len, kv_len)
    if attention_mask is not None:
        if attention_mask.dim() == 4:  # a prepared mask: boolean, or additive
            if attention_mask.dtype == torch.bool:
                allowed = allowed & attention_mask[..., -q_len:, -kv_len:]
            else:
                return attention_mask[..., -q_len:, -kv_len:].to(dtype)
        else:
            if attention_mask.shape[-1] != kv_len:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} positions; expected past + new = {kv_len}")
            allowed = allowed & attention_mask[:, None, None, :].bool()
    mask = torch.zeros(batch, 1, q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class MharAttention(nn.Module):
    """Causal GQA attention with QK-norm (per head, over head_dim) and RoPE."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.q_norm = MharRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = MharRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past_key_values, use_sdpa):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        group = self.n_heads // self.n_kv  # query head h reads KV head h // group
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if use_sdpa:
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if mask is None:
                mask = _additive_mask(None, B, T, k.shape[-2] - T, scores.dtype, scores.device)
            scores = scores + mask
            probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
            out = torch.matmul(probs.to(v.dtype), v)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out)


class MharMLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MharDecoderLayer(nn.Module):
    """Two sublayers, each called with its own (routed) input."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = MharRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MharAttention(config, layer_idx)
        self.post_attention_layernorm = MharRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MharMLP(config)

    def attention_sublayer(self, x, cos, sin, mask, past_key_values, use_sdpa):
        return self.self_attn(self.input_layernorm(x), cos, sin, mask, past_key_values, use_sdpa)

    def mlp_sublayer(self, x):
        return self.mlp(self.post_attention_layernorm(x))


def _route(query, gain, heads, sources, normalized):
    """Depth routing of one site (engine/cpu/routing.h): sources [B, T, d] each, normalized
    their RMSNorm without scale (float32). Returns x in the sources' dtype."""
    H, d = heads, query.shape[0]
    wide = normalized[0].dtype
    qg = (query.to(wide) * gain.to(wide)).view(H, d // H)
    # s_ih = sum_{c in h} q[c] g[c] RMSNorm(v_i)[c]: [n, B, T, H]
    logits = torch.stack([(k.view(*k.shape[:-1], H, d // H) * qg).sum(dim=-1) for k in normalized])
    weights = torch.softmax(logits, dim=0)
    mixed = None
    for i, v in enumerate(sources):
        term = weights[i].unsqueeze(-1) * v.to(wide).view(*v.shape[:-1], H, d // H)
        mixed = term if mixed is None else mixed + term
    return mixed.reshape(sources[0].shape).to(sources[0].dtype)


def _site_slots(j, block):
    """The source slots site j reads (RoutingLayout in engine/backend.h): slot 0, the
    closed blocks' slots s, 2s, .., and slot j itself while its block is partial."""
    return [0] + list(range(block, j + 1, block)) + ([j] if j % block else [])


def _continues_block(i, block):
    """Whether output v_i (i >= 1) joins the block of v_{i-1}."""
    return i >= 2 and (i - 1) % block != 0


class MharRoutingSite(nn.Module):
    """Routing site j: query q_j (init 0) and gain g_j (init 1), both [d]."""

    def __init__(self, hidden_size, heads):
        super().__init__()
        self.heads = heads
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.gain = nn.Parameter(torch.ones(hidden_size))

    def forward(self, sources, normalized):
        return _route(self.query, self.gain, self.heads, sources, normalized)


class MharDeltaSite(MharRoutingSite):
    """Site j of mode delta: routing plus the scalar gate alpha_j (init 0)."""

    def __init__(self, hidden_size, heads):
        super().__init__(hidden_size, heads)
        self.alpha = nn.Parameter(torch.zeros(1))


class MharDeltaSites(nn.ModuleList):
    """Mode delta's sites and the null source (init 0), slot 0 of every site."""

    def __init__(self, sites, hidden_size, heads):
        super().__init__(MharDeltaSite(hidden_size, heads) for _ in range(sites))
        self.null = nn.Parameter(torch.zeros(hidden_size))


class MharHyperConnection(nn.Module):
    """The Hyper-Connection around sublayer k, n streams: a_m [n] (init one-hot(k mod n)),
    a_r [n*n] row-major (init I_n), b [n] (init 1); dynamic: w [d*(n+2)] (init 0), s_a,
    s_b [1] (init 0.01)."""

    def __init__(self, hidden_size, n, k, dynamic, eps):
        super().__init__()
        self.n, self.k, self.dynamic, self.eps = n, k, dynamic, eps
        self.a_m = nn.Parameter(torch.zeros(n))
        self.a_r = nn.Parameter(torch.zeros(n * n))
        self.b = nn.Parameter(torch.zeros(n))
        if dynamic:
            self.w = nn.Parameter(torch.zeros(hidden_size * (n + 2)))
            self.s_a = nn.Parameter(torch.zeros(1))
            self.s_b = nn.Parameter(torch.zeros(1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, only=lambda p: True):
        """The engine's init (Init::OneHot, Identity, One, Zero, HyperScale); `only` leaves
        the parameters it rejects (loaded ones) alone."""
        n = self.n
        if only(self.a_m):
            self.a_m.zero_()[self.k % n] = 1.0
        if only(self.a_r):
            self.a_r.copy_(torch.eye(n, dtype=self.a_r.dtype, device=self.a_r.device).reshape(-1))
        if only(self.b):
            self.b.fill_(1.0)
        if self.dynamic:
            for p, value in ((self.w, 0.0), (self.s_a, 0.01), (self.s_b, 0.01)):
                if only(p):
                    p.fill_(value)

    def coefficients(self, H):
        """Per stream r (and token, when dynamic) (a_m[r], a_r[r, :], b[r]) as
        [n, B, T, n+2] (static: [n, 1, 1, n+2]), float32 at least
        (engine/cpu/hyper.h hyper_dynamic_coef)."""
        n, wide = self.n, torch.promote_types(H.dtype, torch.float32)
        base = torch.cat([self.a_m.view(n, 1), self.a_r.view(n, n), self.b.view(n, 1)], dim=1).to(wide)
        base = base.view(n, *([1] * (H.dim() - 2)), n + 2)
        if not self.dynamic:
            return base
        hbar = _rms_normalize(H, self.eps).to(wide)
        z = torch.matmul(hbar, self.w.to(wide).view(-1, n + 2))
        s = torch.cat([self.s_a.expand(n + 1), self.s_b]).to(wide)
        return base + s * torch.tanh(z)

    def mix(self, H, C):
        """x = sum_r C[r, .., 0] h_r (the sublayer's input), in H's dtype."""
        return (C[..., 0:1] * H.to(C.dtype)).sum(dim=0).to(H.dtype)

    def update(self, H, v, C):
        """h_i <- C[i, .., n+1] v + sum_r C[r, .., 1+i] h_r, in H's dtype."""
        n, wide = self.n, C.dtype
        shares = C[..., 1:n + 1].expand(*H.shape[:-1], n)  # [n(r), B, T, n(i)]
        mixed = torch.einsum("r...i,r...c->i...c", shares, H.to(wide))
        return (C[..., n + 1:n + 2] * v.to(wide) + mixed).to(H.dtype)


# ---- The residual schemes: one function per mode. Each takes v_0 and `sublayer(j, x)`
# (runs sublayer j on its input x and returns v_{j+1}) and returns x_{2L}, the input of
# the final norm.

def standard_residual(h, sublayer, n_sublayers):
    """residual_standard.cpp: x_0 = v_0, x_j = x_{j-1} + v_j."""
    x = h
    for j in range(n_sublayers):
        x = x + sublayer(j, x)
    return x


def routed_residual(h, sublayer, sites, block, eps):
    """residual_routed.cpp: attnres / mhar, full (block 1) or block routing. Slot 0 is v_0;
    slot j >= 1 is v_j plus slot j-1 when v_j continues a block (the block's running
    sum), so a slot is summed once and s = 1 leaves slot j = v_j."""
    slots, keys = [h], [_rms_normalize(h, eps)]
    last = len(sites) - 1
    for j, site in enumerate(sites):
        read = _site_slots(j, block)
        x = site([slots[i] for i in read], [keys[i] for i in read])
        if j == last:
            return x
        v = sublayer(j, x)
        slot = v + slots[j] if _continues_block(j + 1, block) else v
        slots.append(slot)
        keys.append(_rms_normalize(slot, eps))


def hyper_residual(h, sublayer, connections, n):
    """residual_hyper.cpp: n streams, all v_0 at first; sublayer k reads its connection's
    mix and its output updates the streams; the head reads their sum."""
    H = h.unsqueeze(0).expand(n, *h.shape)
    for k, hc in enumerate(connections):
        C = hc.coefficients(H)  # the mix and the update of sublayer k read the same C
        v = sublayer(k, hc.mix(H, C))
        H = hc.update(H, v, C)
    return H.to(torch.promote_types(H.dtype, torch.float32)).sum(dim=0).to(h.dtype)


def delta_residual(h, sublayer, delta, block, eps):
    """residual_delta.cpp: the standard stream plus alpha_j times block routing over the
    null source (slot 0) and the block sums (slots as in routed_residual)."""
    wide = torch.promote_types(h.dtype, torch.float32)
    null = delta.null.to(h.dtype).expand_as(h)
    stream, slots, keys = h, [null], [_rms_normalize(null, eps)]
    last = len(delta) - 1
    for j, site in enumerate(delta):
        read = _site_slots(j, block)
        r = site([slots[i] for i in read], [keys[i] for i in read])
        x = (stream.to(wide) + site.alpha.to(wide) * r.to(wide)).to(h.dtype)
        if j == last:
            return x
        v = sublayer(j, x)
        stream = stream + v
        slot = v + slots[j] if _continues_block(j + 1, block) else v
        slots.append(slot)
        keys.append(_rms_normalize(slot, eps))


class MharPreTrainedModel(PreTrainedModel):
    config_class = MharConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MharDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_cache_class = True
    _supports_sdpa = True
    _supports_static_cache = False
    # The output layer of a tied model is the embedding itself (used directly in the
    # forward), so no parameter is tied and nothing needs re-tying after loading (an
    # empty mapping: transformers 5 expects a dict here, 4 iterates it).
    _tied_weights_keys = {}

    def get_expanded_tied_weights_keys(self, all_submodels=False):  # transformers 5
        return {}

    @torch.no_grad()
    def _init_weights(self, module):
        """Initialisation of weights missing from a checkpoint (an export has them all):
        the engine's rules without its per-layer output scaling."""

        def fresh(p):  # a weight already loaded is never overwritten
            return not getattr(p, "_is_hf_initialized", False)

        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if fresh(module.weight):
                module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, MharRMSNorm):
            if fresh(module.weight):
                module.weight.fill_(1.0)
        elif isinstance(module, MharRoutingSite):  # and MharDeltaSite
            if fresh(module.query):
                module.query.zero_()
            if fresh(module.gain):
                module.gain.fill_(1.0)
            if isinstance(module, MharDeltaSite) and fresh(module.alpha):
                module.alpha.zero_()
        elif isinstance(module, MharDeltaSites):
            if fresh(module.null):
                module.null.zero_()
        elif isinstance(module, MharHyperConnection):
            module.reset_parameters(only=fresh)


class MharModel(MharPreTrainedModel):
    """The decoder up to the final norm (HF AutoModel)."""

    def __init__(self, config):
        super().__init__(config)
        self.mode = config.residual_mode
        d, sites = config.hidden_size, 2 * config.num_hidden_layers + 1
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(MharDecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = MharRMSNorm(d, config.rms_norm_eps)
        # The scheme's parameters, under the engine's names (model.routing / hyper / delta).
        if self.mode in ("attnres", "mhar"):
            self.routing = nn.ModuleList(MharRoutingSite(d, config.routing_heads) for _ in range(sites))
        elif self.mode == "hyper":
            self.hyper = nn.ModuleList(
                MharHyperConnection(d, config.hyper_n, k, config.hyper_dynamic, config.rms_norm_eps)
                for k in range(sites - 1))
        elif self.mode == "delta":
            self.delta = MharDeltaSites(sites, d, config.routing_heads)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _use_sdpa(self):
        impl = getattr(self.config, "_attn_implementation", None)
        return impl != "eager" and hasattr(F, "scaled_dot_product_attention")

    def _residual(self, h, sublayer):
        """x_{2L} from v_0 through the config's residual scheme."""
        c, eps = self.config, self.config.rms_norm_eps
        if self.mode == "standard":
            return standard_residual(h, sublayer, 2 * c.num_hidden_layers)
        if self.mode in ("attnres", "mhar"):
            return routed_residual(h, sublayer, self.routing, max(c.block_size, 1), eps)
        if self.mode == "hyper":
            return hyper_residual(h, sublayer, self.hyper, c.hyper_n)
        return delta_residual(h, sublayer, self.delta, 2 * c.block_layers, eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None, return_dict=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True) and not self.training
        if isinstance(past_key_values, (tuple, list)):  # the legacy cache format
            past_key_values = DynamicCache.from_legacy_cache(past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise TypeError(f"past_key_values must be a transformers Cache, got {type(past_key_values).__name__}")
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:  # left padding
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=h.device)[None].expand(B, T)
        cos, sin = _rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, h.dtype)
        use_sdpa = self._use_sdpa()
        padded = attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all()))
        if use_sdpa and past == 0 and not padded:
            mask = None  # plain causal
        else:
            mask = _additive_mask(attention_mask, B, T, past, h.dtype, h.device)

        def sublayer(j, x):  # sublayer j: attention of layer j // 2 (even j) or its MLP
            layer = self.layers[j // 2]
            if j % 2 == 0:
                v = layer.attention_sublayer(x, cos, sin, mask, past_key_values, use_sdpa)
            else:
                v = layer.mlp_sublayer(x)
            return v.to(h.dtype)

        x = self._residual(h, sublayer)
        out = BaseModelOutputWithPast(last_hidden_state=self.norm(x),
                                      past_key_values=past_key_values if use_cache else None)
        return out if return_dict is not False else out.to_tuple()


class MharForCausalLM(MharPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MharModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return None if self.config.tie_word_embeddings else self.lm_head

    def set_output_embeddings(self, value):
        if self.config.tie_word_embeddings:
            raise ValueError("a tied model's output layer is its input embedding")
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, logits_to_keep=0,
                return_dict=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cache_position=cache_position, return_dict=True)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(h, weight)
        loss = None
        if labels is not None:  # next-token loss: position t predicts labels[t + 1]
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        result = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)
        return result if return_dict is not False else result.to_tuple()


__all__ = ["MharConfig", "MharPreTrainedModel", "MharModel", "MharForCausalLM"]
