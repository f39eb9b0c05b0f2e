# configuration_mhar.py: the Hugging Face configuration of an mhar model with depth
# routing (model_type "mhar"). Written by `mhar export` beside modeling_mhar.py and
# loaded with trust_remote_code=True. The fields are Qwen3's (vocab_size, hidden_size,
# intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# head_dim, max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings)
# plus the residual mode ("attnres", "mhar", or "standard") and the routing head count.
# Kept in the mhar repository (tools/hf/) and compiled into the engine by its build.
try:  # transformers >= 5
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as _BaseConfig

RESIDUAL_MODES = ("standard", "attnres", "mhar")


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
        hidden_act="silu",
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    ):
        if residual_mode not in RESIDUAL_MODES:
            raise ValueError(f"residual_mode = {residual_mode!r}; valid: {RESIDUAL_MODES}")
        if routing_heads is None:  # the engine's default: 1 for attnres, the KV heads for mhar
            routing_heads = {"standard": 1, "attnres": 1, "mhar": num_key_value_heads}[residual_mode]
        if residual_mode == "attnres" and routing_heads != 1:
            raise ValueError("residual_mode 'attnres' is routing with exactly 1 head")
        if hidden_size % routing_heads:
            raise ValueError(f"routing_heads = {routing_heads} does not divide hidden_size = {hidden_size}")
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
