"""boost_jax: training low-rank (bottleneck) LLMs with bottleneck-aware tensor parallelism in JAX.

Here sit the commands (`python -m boost_jax`, __main__.py, lists them): train.py, eval.py,
generate.py, lm_eval.py, export.py, convert.py, plan.py, compile.py, study.py, and data/, bench/ and serve/
(the OpenAI-compatible server, whose library, shared with `bench serve`, is serving/); and api.py, the
Python API. The library is in rooms, lowest floor first (docs/design.md section 8): runtime/
(errors, exit, paths, cache; no JAX) and ops/ (the attention op, math on arrays), config/ (the
config and its tables; no JAX) beside configs/ (base.yaml, hardware.yaml), launch/ (the pre-JAX
setup), data/, parallel/, layers/, model/ (the
decoder, its weights, decoding, SVD compression), training/ (optimizers, steps, checkpoints, logs,
the loop's parts), analysis/, planner/ and comparison/ (the fair comparison behind study.py)."""

__version__ = "0.1.0"
