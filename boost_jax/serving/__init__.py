"""The serving library that `python -m boost_jax.serve` (boost_jax/serve/) and `bench serve` share: the
HTTP routes (`api.py`), continuous batching (`engine.py`) over a paged KV cache whose page tables
`pages.py` keeps, the paged programs with the pool's size (`programs.py`) and the listening socket
(`listen.py`) (docs/guides/serving.md,
docs/design/serving.md)."""
