"""Building blocks of the decoder: lowrank.py (the one linear of every arch), norm.py (RMSNorm),
attention.py (causal self-attention: RoPE, grouped-query heads, document masks), kv_cache.py
(decoding's caches), mlp.py (the LLaMA MLP) and cross_entropy.py (the one-pass loss)."""
