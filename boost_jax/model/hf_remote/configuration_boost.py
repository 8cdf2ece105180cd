"""transformers configuration of a boost_jax low-rank model (svd, cola, lax), written beside its
weights by `python -m boost_jax.export RUN_DIR OUT --format hf`; imports only transformers."""

from transformers import PretrainedConfig


class BoostConfig(PretrainedConfig):
    """A LLaMA block whose seven projections are low-rank pairs A, B: `arch` says what lies between
    them (svd: nothing, cola: SiLU, lax: SiLU plus the previous layer's latent of the projection)."""

    model_type = "boost_lowrank"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(self, arch="cola", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=64, attn_rank=64, mlp_rank=172,
                 attn_latent_heads=1, mlp_gate_silu=False, qkv_bias=False, rms_norm_eps=1e-6,
                 boost_rope=None, max_position_embeddings=2048, tie_word_embeddings=False, **kwargs):
        self.arch, self.vocab_size, self.hidden_size = arch, vocab_size, hidden_size
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = (num_attention_heads,
                                                                             num_key_value_heads, head_dim)
        self.attn_rank, self.mlp_rank, self.attn_latent_heads = attn_rank, mlp_rank, attn_latent_heads
        self.mlp_gate_silu, self.qkv_bias, self.rms_norm_eps = mlp_gate_silu, qkv_bias, rms_norm_eps
        # RoPE: {"theta": ..., "type": "default" | "llama3", and llama3's factor, low_freq_factor,
        # high_freq_factor, original_max_position_embeddings}; not `rope_parameters`, which
        # transformers would standardise for its own rotary classes, which this model does not use
        self.boost_rope = boost_rope or {"type": "default", "theta": 10000.0}
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
