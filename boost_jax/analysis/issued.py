"""Collectives as the program issues them: counted on the jaxpr, before XLA's optimiser combines
independent all-reduces (the compiled HLO, `hlo.py`, shows what runs after combining).

Only explicit collectives (psum and friends in `shard_map` blocks) exist at this level; those the
SPMD partitioner inserts for sharding annotations appear only in the compiled HLO.
"""

from __future__ import annotations

from collections import Counter

import jax
from jax.extend import core

KINDS = {"psum": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
         "ppermute": "collective-permute", "all_to_all": "all-to-all"}


def issued(fn, *args) -> dict[str, Counter]:
    """{"layer": Counter(kind -> count) inside one scanned layer body, "outside": the rest}."""
    out = {"layer": Counter(), "outside": Counter()}
    _walk(jax.make_jaxpr(fn)(*args).jaxpr, out, in_layer=False)
    return out


def _walk(jaxpr: core.Jaxpr, out: dict, in_layer: bool) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KINDS:
            out["layer" if in_layer else "outside"][KINDS[eqn.primitive.name]] += 1
        inner = in_layer or eqn.primitive.name == "scan"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, core.ClosedJaxpr):
                    _walk(sub.jaxpr, out, inner)
                elif isinstance(sub, core.Jaxpr):
                    _walk(sub, out, inner)
