# modeling_mhar.py: the PyTorch model of an mhar export with depth routing, for Hugging
# Face transformers (trust_remote_code=True; `mhar export` writes it beside config.json).
# Kept in the mhar repository (tools/hf/) and compiled into the engine by its build.
#
# The model is the engine's (DESIGN.md sections 1-2; engine/model.cpp, engine/cpu/):
# a Qwen3-style decoder whose sublayers each read their own input. Sources: v_0 = the
# embedding output, v_{2l+1} = attention output of layer l, v_{2l+2} = MLP output of layer
# l. Site j (0..2L; site 2L feeds the final norm) builds its input from v_0..v_j:
#   standard: x_j = sum_{i<=j} v_i (the ordinary residual stream)
#   attnres / mhar (H routing heads, head h owning features [h*d/H, (h+1)*d/H)):
#     k_i = g_j * RMSNorm(v_i)            RMSNorm over the full d, no learned scale
#     s_ih = sum_{c in h} q_j[c] k_i[c]   no 1/sqrt scaling
#     a_ih = softmax over i of s_ih       per token, per head
#     x_j[c] = sum_i a_{i,head(c)} v_i[c]
# Routing mixes the sources of one token only, so generate() needs nothing cached
# beyond attention keys and values (a DynamicCache, one layer per decoder layer).
#
# Numerics follow the engine: RoPE angles in float64 (engine/cpu/rope.h), norm statistics
# and routing logits, softmax and mix in at least float32 whatever the weights' dtype.
# Tensor names are Hugging Face Qwen3's plus model.routing.{j}.query / .gain.
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


class MharRoutingSite(nn.Module):
    """Routing site j: query q_j (init 0) and gain g_j (init 1), both [d]."""

    def __init__(self, hidden_size, heads):
        super().__init__()
        self.heads = heads
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.gain = nn.Parameter(torch.ones(hidden_size))

    def forward(self, sources, normalized):
        """sources: v_0..v_j ([B, T, d] each); normalized: RMSNorm(v_i) without scale
        (float32). Returns x_j in the sources' dtype."""
        H = self.heads
        d = self.query.shape[0]
        qg = (self.query.to(normalized[0].dtype) * self.gain.to(normalized[0].dtype)).view(H, d // H)
        # s_ih = sum_{c in h} q[c] g[c] RMSNorm(v_i)[c]: [n, B, T, H]
        logits = torch.stack([(k.view(*k.shape[:-1], H, d // H) * qg).sum(dim=-1) for k in normalized])
        weights = torch.softmax(logits, dim=0)
        mixed = None
        for i, v in enumerate(sources):
            term = weights[i].unsqueeze(-1) * v.to(weights.dtype).view(*v.shape[:-1], H, d // H)
            mixed = term if mixed is None else mixed + term
        return mixed.reshape(sources[0].shape).to(sources[0].dtype)


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
        elif isinstance(module, MharRoutingSite):
            if fresh(module.query):
                module.query.zero_()
            if fresh(module.gain):
                module.gain.fill_(1.0)


class MharModel(MharPreTrainedModel):
    """The decoder up to the final norm (HF AutoModel)."""

    def __init__(self, config):
        super().__init__(config)
        self.mode = config.residual_mode
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MharDecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = MharRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.mode != "standard":
            sites = 2 * config.num_hidden_layers + 1
            self.routing = nn.ModuleList(
                MharRoutingSite(config.hidden_size, config.routing_heads) for _ in range(sites))
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _use_sdpa(self):
        impl = getattr(self.config, "_attn_implementation", None)
        return impl != "eager" and hasattr(F, "scaled_dot_product_attention")

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

        routed = self.mode != "standard"
        eps = self.config.rms_norm_eps
        sources = [h]  # v_0
        normalized = [_rms_normalize(h, eps)] if routed else None
        stream = h  # standard: the running sum of the sources
        for layer in self.layers:
            for attention in (True, False):
                j = len(sources) - 1  # site j feeds this sublayer and sees v_0..v_j
                x = self.routing[j](sources, normalized) if routed else stream
                if attention:
                    v = layer.attention_sublayer(x, cos, sin, mask, past_key_values, use_sdpa)
                else:
                    v = layer.mlp_sublayer(x)
                v = v.to(h.dtype)
                sources.append(v)
                if routed:
                    normalized.append(_rms_normalize(v, eps))
                else:
                    stream = stream + v
        x = self.routing[len(sources) - 1](sources, normalized) if routed else stream  # site 2L
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
