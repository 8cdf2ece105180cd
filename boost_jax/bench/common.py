"""The command-line flags every benchmark shares, and the config they describe."""

from __future__ import annotations

import argparse

from boost_jax.analysis.program import DTYPES, config_for
from boost_jax.archs import ARCHS
from boost_jax.config import Config
from boost_jax.parallel import SCHEMES


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-7b", help="preset (boost_jax/presets.py)")
    p.add_argument("--arch", default="cola", choices=list(ARCHS))
    p.add_argument("--scheme", default="auto", choices=["auto", *SCHEMES])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica (all its micro-batches)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--pp-repeats", type=int, default=1, help="chunks of layers per stage (circular schedule)")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (pipeline or accumulation)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")


def bench_config(a: argparse.Namespace, **changes) -> Config:
    """The config of parsed `add_model_flags`, with some of them changed (e.g. scheme="vanilla")."""
    v = {**vars(a), **changes}
    return config_for(v["model"], v["arch"], v["scheme"], tp=v["tp"], dp=v["dp"], batch=v["batch"], seq=v["seq"],
                      dtype=v["dtype"], pp=v["pp"], pp_repeats=v["pp_repeats"], microbatches=v["microbatches"],
                      overrides=v["overrides"])
