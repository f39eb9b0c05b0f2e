# configuration_mhar.py: the Hugging Face configuration of an mhar model whose residual
# stream is not Qwen3's (model_type "mhar"). Written by `mhar export` beside
# modeling_mhar.py and loaded with trust_remote_code=True. The fields are Qwen3's
# (vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim, max_position_embeddings, rope_theta, rms_norm_eps,
# tie_word_embeddings) plus the residual scheme under the engine's residual.* names:
#   residual_mode   "attnres", "mhar", "hyper", "delta" (or "standard")
#   routing_heads   routing heads H (attnres: 1; mhar, delta: default num_key_value_heads)
#   block_size      attnres/mhar: sublayer outputs per routing block, 0 = full routing
#   hyper_n         hyper: residual streams n (default 4)
#   hyper_dynamic   hyper: per-token (dynamic) coefficients (default false)
#   block_layers    delta: layers per block of the routed sources (default 4)
# A field that has no meaning in the mode must keep its default, as in the engine's
# config (engine/config.cpp).
# Kept in the mhar repository (tools/hf/) and compiled into the engine by its build.
try:  # transformers >= 5
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as _BaseConfig

RESIDUAL_MODES = ("standard", "attnres", "mhar", "hyper", "delta")
ROUTING_MODES = ("attnres", "mhar", "delta")  # the modes with routing heads


class MharConfig(_BaseConfig):
    model_type = "mhar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=50304,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        residual_mode="mhar",
        routing_heads=None,
        block_size=0,
        hyper_n=4,
        hyper_dynamic=False,
        block_layers=4,
        hidden_act="silu",
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    ):
        if residual_mode not in RESIDUAL_MODES:
            raise ValueError(f"residual_mode = {residual_mode!r}; valid: {RESIDUAL_MODES}")
        if routing_heads is None:  # the engine's default: 1 for attnres, the KV heads for mhar and delta
            routing_heads = {"attnres": 1, "mhar": num_key_value_heads,
                             "delta": num_key_value_heads}.get(residual_mode, 0)
        if residual_mode == "attnres" and routing_heads != 1:
            raise ValueError("residual_mode 'attnres' is routing with exactly 1 head")
        if residual_mode in ROUTING_MODES and (routing_heads < 1 or hidden_size % routing_heads):
            raise ValueError(f"routing_heads = {routing_heads} does not divide hidden_size = {hidden_size}")
        if residual_mode not in ROUTING_MODES and routing_heads not in (0, 1):
            raise ValueError(f"routing_heads = {routing_heads} has no meaning in residual_mode {residual_mode!r}")
        sublayers = 2 * num_hidden_layers
        if residual_mode in ("attnres", "mhar"):
            if not 0 <= block_size <= sublayers:
                raise ValueError(f"block_size = {block_size}; valid: 0 (full routing) or 1..{sublayers}")
        elif block_size != 0:
            raise ValueError(f"block_size = {block_size} has no meaning in residual_mode {residual_mode!r}")
        if residual_mode == "hyper":
            if not 1 <= hyper_n <= 64:
                raise ValueError(f"hyper_n = {hyper_n}; valid: 1..64")
        elif hyper_n != 4 or hyper_dynamic:
            raise ValueError(f"hyper_n / hyper_dynamic have no meaning in residual_mode {residual_mode!r}")
        if residual_mode == "delta":
            if not 1 <= block_layers <= num_hidden_layers:
                raise ValueError(f"block_layers = {block_layers}; valid: 1..{num_hidden_layers}")
        elif block_layers != 4:
            raise ValueError(f"block_layers = {block_layers} has no meaning in residual_mode {residual_mode!r}")
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act = {hidden_act!r}; mhar models use 'silu' (SwiGLU)")
        fields = dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(rms_norm_eps),
            initializer_range=initializer_range,
            tie_word_embeddings=bool(tie_word_embeddings),
            residual_mode=residual_mode,
            routing_heads=int(routing_heads),
            block_size=int(block_size),
            hyper_n=int(hyper_n),
            hyper_dynamic=bool(hyper_dynamic),
            block_layers=int(block_layers),
            hidden_act=hidden_act,
            use_cache=use_cache,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
        for key, value in fields.items():
            setattr(self, key, value)
        super().__init__(
            tie_word_embeddings=bool(tie_word_embeddings),
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            **kwargs,
        )
        # Set again: some transformers versions give their base-class defaults to these.
        for key, value in fields.items():
            setattr(self, key, value)
