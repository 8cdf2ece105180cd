"""The planner: every layout, checked, sized by the memory model, priced by the performance model
(branch and bound: a layout whose lower bound cannot beat the fastest priced one is not compiled),
ranked; each loser keeps the reason it lost."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from boost_jax.analysis.memory_model import breakdown, one_layer_config
from boost_jax.config import Config, ConfigError, from_dict, raw_args
from boost_jax.config.hardware import Hardware
from boost_jax.model.counts import count
from boost_jax.parallel.remat import SLOWER_THAN
from boost_jax.planner.layouts import Layout, Space, enumerate_layouts, raw_layout_config
from boost_jax.planner.price import DiskCache, Layers, compile_programs, lower_bound, program_key, step_seconds
from boost_jax.planner.workers import Workers
from boost_jax.runtime.units import GIB

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


def rank_layouts(args: Sequence[str], *, gpus: int, hw: Hardware, space: Space, headroom: float,
                 cache: DiskCache, log=lambda s: None, must_price: Callable[[Layout], bool] = lambda layout: False,
                 max_priced: int | None = None, workers: Workers | None = None, overlap: bool = False) -> list[Candidate]:
    """All candidates for the config of `args` (an optional YAML file, then overrides; no layout
    key), priced ones first (fastest first), then the rest with their reasons. At most `max_priced`
    (None: all that can win) are priced besides the `must_price` ones, in order of their lower bound.
    `workers` compile several layers or programs at once (None: one at a time, in this process);
    the answer is the same for any number of them. `overlap`: priced with the performance model's
    overlap of communication with the backward pass (price.step_seconds)."""
    workers = workers or Workers(1, 0)
    raw = raw_args(args)
    first = from_dict(raw)
    out = [Candidate(layout) for layout in enumerate_layouts(first.model.arch, gpus, first.train.batch_size,
                                                             first.train.seq_len, hw.gpus_per_node, space)]
    for c in out:
        try:
            c.cfg = raw_layout_config(raw, c.layout)
        except ConfigError as e:
            c.why = f"does not divide: {e}"
    layers = Layers(cache)
    _size(sorted((c for c in out if c.cfg), key=_sizing_order), layers, hw.hbm_bytes * (1 - headroom), workers, log,
          keep=must_price)
    # Branch and bound: price in order of a bound no compile can undercut (price.lower_bound, from
    # the layer compiled for its memory), and stop where the next bound exceeds the fastest priced so
    # far; `must_price` layouts are priced regardless (e.g. one to compare with).
    bounds = {id(c): lower_bound(c.cfg, hw, c.memory["param_elems"], layers.work(one_layer_config(c.cfg)), overlap)
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
        if not cache.has(program_key(c.cfg)):  # compile it and the next ones that may be priced, at once
            n = workers.n if not max_priced else min(workers.n, 1 + max_priced - optional)
            compiled += compile_programs(_ahead(worth[i:], bounds, best, must_price, cache, n), cache, workers)
        # At most every layout left whose bound is under the best so far is priced, each about as
        # long as those so far (a cached one is instant).
        could = sum(1 for d in worth[i + 1:] if must_price(d.layout) or bounds[id(d)] < best)
        left = "" if not compiled else f", at most ~{(time.monotonic() - started) / compiled * could:.0f} s left"
        log(f"pricing {i + 1}/{len(worth)} (lower bound {bound:.3g} s, best so far {best:.3g} s{left}): {c.layout}")
        c.step = step_seconds(c.cfg, hw, c.memory["param_elems"], cache, overlap)
        best = min(best, c.step["seconds"])
    priced = sorted((c for c in worth if c.step), key=lambda c: c.step["seconds"])
    for c in priced[1:]:
        c.why = f"slower by {c.step['seconds'] / priced[0].step['seconds']:.2f}x"
    rest = [c for c in out if c.step is None]
    return priced + rest


def _size(cands: list[Candidate], layers: Layers, budget: float, workers: Workers, log,
          keep: Callable[[Layout], bool]) -> None:
    """Sizes by the memory model each candidate worth sizing (`_not_worth_sizing`, or `keep`: that
    depends on which others fit, so `cands` come in `_sizing_order`), setting its memory and fit, or
    why not. In waves: each decides what the layers compiled so far can decide, and compiles at once
    on the workers the layers of those left open; the last compiles nothing and decides as one pass
    in this order with every layer at hand would."""
    for wave in itertools.count(1):
        fewest: dict[tuple, int] = {}  # per layout without a pipeline (M aside): the fewest micro-batches that fit
        fitting: set = set()  # the layouts without context parallelism that fit (`_fold`)
        lighter: dict[Layout, set] = {}  # per layout with remat "": the remats that fit (or are beaten)
        open_m: set = set()  # `_without_m` keys whose fewest fitting M is not known yet
        open_fold: set = set()  # `_fold` keys not known to fit yet
        open_remat: set = set()  # `_without_remat` keys with a remat not known to fit yet
        todo: list[Config] = []
        for c in cands:
            l = c.layout
            c.why, beaten = ("", False) if keep(l) else _not_worth_sizing(l, fewest, fitting, lighter)
            if beaten:  # a layout at least as fast fits: so it does for each remat slower than this one
                lighter.setdefault(_without_remat(l), set()).add(l.remat)
            if c.why:
                continue
            layer_cfg = one_layer_config(c.cfg)
            blocked = ((l.pp == 1 and _without_m(l) in open_m) or (l.cp > 1 and _fold(l) in open_fold)
                       or (l.remat in SLOWER_THAN and _without_remat(l) in open_remat))
            if blocked or not layers.has(layer_cfg):  # open: decided in a later wave
                if not blocked:
                    todo.append(layer_cfg)
                if l.pp == 1:
                    open_m.add(_without_m(l))
                if l.cp == 1:
                    open_fold.add(_fold(l))
                open_remat.add(_without_remat(l))
                continue
            if c.memory is None:
                c.memory = breakdown(c.cfg, layers.bytes, compiler="gpu")  # the hardware file's machines are GPUs
                c.fits = c.memory["total"] <= budget
            if not c.fits:
                c.why = f"does not fit: {c.memory['total'] / GIB:.1f} GiB > {budget / GIB:.1f} GiB"
                continue
            if l.pp == 1:
                fewest[_without_m(l)] = l.microbatches
            if l.cp == 1:
                fitting.add(_fold(l))
            lighter.setdefault(_without_remat(l), set()).add(l.remat)
        if not todo:
            return
        layers.compile(todo, workers, _Progress(log, f"sizing layouts by the memory model (wave {wave}, "
                                                     f"{workers.n} worker{'s' * (workers.n > 1)}): layer compiles"))


class _Progress:
    """`done(k, n)` logs "what: k/n, ~s left" at the first, the last and every 10 s between."""

    def __init__(self, log, what: str):
        self.log, self.what, self.started, self.last = log, what, time.monotonic(), -math.inf

    def __call__(self, k: int, n: int) -> None:
        now = time.monotonic()
        if k in (1, n) or now - self.last >= 10:
            self.last = now
            self.log(f"{self.what}: {k}/{n}, ~{(now - self.started) / k * (n - k):.0f} s left")


def _ahead(cands: list[Candidate], bounds: dict, best: float, must_price, cache: DiskCache, n: int) -> list[Config]:
    """The configs of the next `n` distinct programs not yet compiled that the pricing loop may reach,
    from the first of `cands` on (in its order: those that must be priced, then by lower bound)."""
    picked: dict[tuple, Config] = {}
    for c in cands:
        if len(picked) == n or not (must_price(c.layout) or bounds[id(c)] < best):
            break
        if not cache.has(key := program_key(c.cfg)):
            picked.setdefault(key, c.cfg)
    return list(picked.values())


def _sizing_order(c: Candidate) -> tuple:
    """Fewest micro-batches, then cp = 1, then remats slower than others last (`_not_worth_sizing`)."""
    return c.layout.microbatches, c.layout.cp, c.layout.remat in SLOWER_THAN


def _without_m(l: Layout) -> tuple:
    return (l.scheme, l.tp, l.pp, l.pp_repeats, l.dp, l.fsdp, l.cp, l.remat)


def _fold(l: Layout) -> tuple:
    """A layout with its cp folded into dp; without a pipeline, M aside (layouts come fewest M
    first, so one found here fits with at most as many micro-batches)."""
    folded = dataclasses.replace(l, dp=l.dp * l.cp, cp=1)
    return _without_m(folded) if l.pp == 1 else folded


def _without_remat(l: Layout) -> Layout:
    return dataclasses.replace(l, remat="")


def _not_worth_sizing(l: Layout, fewest: dict[tuple, int], fitting: set,
                      lighter: dict[Layout, set]) -> tuple[str, bool]:
    """Why a layout is not worth sizing or compiling ("" if it is), and whether that is because a
    layout at least as fast fits. Without a pipeline, micro-batches only trade memory for smaller
    GEMMs: the fewest that fit win (layouts come fewest first). Under one, more micro-batches shrink
    the bubble and grow the buffers: pp x 1, 2, 4, 8 of them. Context parallelism trades memory for
    attention's collectives: the same devices as data parallelism (cp folded into dp) do the same
    work per device without them, so cp > 1 is sized only where that layout does not fit (layouts
    come cp = 1 first). Full remat only trades memory for recomputed GEMMs (remat.SLOWER_THAN): it
    is sized only where the other presets do not fit (they come first)."""
    if l.cp > 1 and _fold(l) in fitting:
        return f"not priced: dp={l.dp * l.cp} without context parallelism fits", True
    if l.pp == 1 and _without_m(l) in fewest:
        return f"not priced: M={fewest[_without_m(l)]} fits with fewer, larger micro-batches", True
    if faster := sorted(lighter.get(_without_remat(l), set()) & set(SLOWER_THAN.get(l.remat, ()))):
        return f"not priced: remat={faster[0]} fits and recomputes less", True
    if l.pp > 1 and l.microbatches not in [l.pp * k for k in PIPELINE_MICROBATCHES]:
        return f"not priced: pipelines are priced at M = pp x {PIPELINE_MICROBATCHES}", False
    return "", False
