"""The planner: every layout, checked, sized by the memory model, priced by the performance model
(branch and bound: a layout whose lower bound cannot beat the fastest priced one is not compiled),
ranked; each loser keeps the reason it lost."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from boost_jax.analysis.memory_model import breakdown, one_layer_config
from boost_jax.analysis.perf_model import Hardware
from boost_jax.config import Config, ConfigError, from_args
from boost_jax.flops import count
from boost_jax.planner.layouts import Layout, Space, enumerate_layouts, layout_config
from boost_jax.planner.price import DiskCache, Layers, lower_bound, step_seconds

PIPELINE_MICROBATCHES = (1, 2, 4, 8)  # micro-batches priced under a pipeline, as multiples of pp


@dataclass
class Candidate:
    layout: Layout
    cfg: Config | None = None
    memory: dict | None = None
    fits: bool = False
    step: dict | None = None
    why: str = ""  # why it lost ("" for a priced candidate until ranked)

    def row(self, hw: Hardware, gpus: int) -> dict:
        """The JSON row of a priced candidate."""
        t = self.cfg.train
        tokens = t.batch_size * t.seq_len
        flops = count(self.cfg.model, t.seq_len).train_flops_per_token * tokens
        s = self.step["seconds"]
        return {"layout": self.layout.as_dict(), "step_s": s, "tokens_per_s_per_gpu": tokens / s / gpus,
                "mfu": flops / (s * gpus * hw.peak_flops), "memory_bytes_per_gpu": self.memory["total"],
                "fits": self.fits, "step_parts_s": self.step["parts"], "memory_parts": self.memory}


def plan(args: Sequence[str], *, gpus: int, hw: Hardware, space: Space, headroom: float,
         cache: DiskCache, log=lambda s: None, must_price: Callable[[Layout], bool] = lambda layout: False,
         max_priced: int | None = None) -> list[Candidate]:
    """All candidates for the config of `args` (an optional YAML file, then overrides; no layout
    key), priced ones first (fastest first), then the rest with their reasons. At most `max_priced`
    (None: all that can win) are priced besides the `must_price` ones, in order of their lower bound."""
    first = from_args(args)
    out = [Candidate(layout) for layout in enumerate_layouts(first.model.arch, gpus, first.train.batch_size,
                                                             first.train.seq_len, hw.gpus_per_node, space)]
    budget = hw.hbm_bytes * (1 - headroom)
    layers = Layers(cache)
    fewest: dict[tuple, int] = {}  # per layout without a pipeline (M aside): the fewest micro-batches that fit
    fitting: set = set()  # the layouts without context parallelism that fit (`_fold`)
    for k, c in enumerate(sorted(out, key=lambda c: (c.layout.microbatches, c.layout.cp))):
        if k % 50 == 0:
            log(f"sizing layouts by the memory model: {k}/{len(out)}")
        try:
            c.cfg = layout_config(args, c.layout)
        except ConfigError as e:
            c.why = f"does not divide: {e}"
            continue
        c.why = _not_worth_sizing(c.layout, fewest, fitting)
        if c.why:
            continue
        c.memory = breakdown(c.cfg, layers.bytes)
        c.fits = c.memory["total"] <= budget
        if not c.fits:
            c.why = f"does not fit: {c.memory['total'] / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB"
            continue
        if c.layout.pp == 1:
            fewest[_without_m(c.layout)] = c.layout.microbatches
        if c.layout.cp == 1:
            fitting.add(_fold(c.layout))
    # Branch and bound: price in order of a bound no compile can undercut (price.lower_bound, from
    # the layer compiled for its memory), and stop where the next bound exceeds the fastest priced so
    # far; `must_price` layouts are priced regardless (e.g. one to compare with).
    bounds = {id(c): lower_bound(c.cfg, hw, c.memory["param_elems"], layers.work(one_layer_config(c.cfg)))
              for c in out if c.fits}
    worth = sorted((c for c in out if c.fits), key=lambda c: (not must_price(c.layout), bounds[id(c)]))
    best, optional, started, compiled = math.inf, 0, time.monotonic(), 0
    for i, c in enumerate(worth):
        bound = bounds[id(c)]
        if not must_price(c.layout):
            if bound >= best:
                c.why = f"not priced: cannot beat {best:.3g} s (lower bound {bound:.3g} s)"
                continue
            if max_priced and optional == max_priced:
                c.why = f"not priced: past the {max_priced} lowest lower bounds (--max-priced)"
                continue
            optional += 1
        # At most every layout left is priced, each about as long as those so far (a cached one is instant).
        left = "" if not compiled else f", at most ~{(time.monotonic() - started) / compiled * (len(worth) - i):.0f} s left"
        log(f"pricing {i + 1}/{len(worth)} (lower bound {bound:.3g} s, best so far {best:.3g} s{left}): {c.layout}")
        c.step = step_seconds(c.cfg, hw, c.memory["param_elems"], cache)
        best, compiled = min(best, c.step["seconds"]), compiled + 1
    priced = sorted((c for c in worth if c.step), key=lambda c: c.step["seconds"])
    for c in priced[1:]:
        c.why = f"slower by {c.step['seconds'] / priced[0].step['seconds']:.2f}x"
    rest = [c for c in out if c.step is None]
    return priced + rest


def _without_m(l: Layout) -> tuple:
    return (l.scheme, l.tp, l.pp, l.pp_repeats, l.dp, l.fsdp, l.cp, l.remat)


def _fold(l: Layout) -> tuple:
    """A layout with its cp folded into dp; without a pipeline, M aside (layouts come fewest M
    first, so one found here fits with at most as many micro-batches)."""
    folded = dataclasses.replace(l, dp=l.dp * l.cp, cp=1)
    return _without_m(folded) if l.pp == 1 else folded


def _not_worth_sizing(l: Layout, fewest: dict[tuple, int], fitting: set) -> str:
    """Why a layout is not worth sizing or compiling ("" if it is). Without a pipeline, micro-batches
    only trade memory for smaller GEMMs: the fewest that fit win (layouts come fewest first). Under
    one, more micro-batches shrink the bubble and grow the buffers: pp x 1, 2, 4, 8 of them. Context
    parallelism trades memory for attention's collectives: the same devices as data parallelism
    (cp folded into dp) do the same work per device without them, so cp > 1 is sized only where that
    layout does not fit (layouts come cp = 1 first)."""
    if l.cp > 1 and _fold(l) in fitting:
        return f"not priced: dp={l.dp * l.cp} without context parallelism fits"
    if l.pp == 1 and _without_m(l) in fewest:
        return f"not priced: M={fewest[_without_m(l)]} fits with fewer, larger micro-batches"
    if l.pp > 1 and l.microbatches not in [l.pp * k for k in PIPELINE_MICROBATCHES]:
        return f"not priced: pipelines are priced at M = pp x {PIPELINE_MICROBATCHES}"
    return ""
