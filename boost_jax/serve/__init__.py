"""`python -m boost_jax.serve RUN_DIR`: an OpenAI-compatible server of a run's model (`__main__.py`, the
command; the library it runs, routes, engine and paged cache, is boost_jax/serving/)."""
