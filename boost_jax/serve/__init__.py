"""`python -m boost_jax.serve RUN_DIR`: an OpenAI-compatible server of a run's model (`__main__.py`,
the command; `api.py`, the HTTP routes), continuous batching (`engine.py`) over a paged KV cache whose
page tables `pages.py` keeps (docs/guides/serving.md, docs/design/serving.md)."""
