"""boost_jax: training low-rank (bottleneck) LLMs with bottleneck-aware tensor parallelism in JAX.

The commands (`python -m boost_jax`, __main__.py, lists them): train.py (its parts in training.py), data/
(prepare), eval.py, generate.py, lm_eval.py, export.py, convert.py (with compress.py), plan.py
(planner/), bench/. The library, lowest floor first (docs/design.md section 8): errors.py, cli.py,
paths.py, cache.py, presets.py, archs.py, schemes.py and configs/ (tables, no JAX); config.py; data/,
parallel/, remat.py, flops.py, health.py, host_memory.py, optimizers.py, compile_cache.py,
startup.py; layers/; model.py; weights.py (a model's parameters), step.py (the train state and
steps), checkpoint.py, log.py, decode.py; api.py (the Python API) and analysis/."""

__version__ = "0.1.0"
