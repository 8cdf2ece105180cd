"""Building blocks of the decoder: lowrank.py (the one linear of every arch), norm.py (RMSNorm),
attention.py (causal self-attention's math: RoPE, grouped-query heads, document masks, cached and
latent-cache attention; and the layer's weights, whose inputs the plan's projections hand it),
kv_cache.py (decoding's caches), paged_cache.py (those caches as a pool of pages, for serving), mlp.py (the LLaMA MLP) and cross_entropy.py (the one-pass loss).
Nothing here reads the plan's scheme or mesh: that is parallel/'s."""
