"""boost_jax: training low-rank (bottleneck) LLMs with bottleneck-aware tensor parallelism in JAX."""

__version__ = "0.1.0"
