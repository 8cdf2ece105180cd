"""The layouts a planner considers: every (scheme, tp, pp, pp_repeats, dp, fsdp, cp, micro-batches,
remat) whose mesh is the GPU count, each checked the way a run checks it (config validation and
the plan's divisibility rules) before anything is compiled."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from boost_jax.config import Config, ConfigError, from_dict, raw_args
from boost_jax.config.schemes import SCHEMES
from boost_jax.parallel import abstract_plan
from boost_jax.parallel.remat import REMAT_POLICIES

# The config keys a layout sets (the planner's to choose, never the user's config).
LAYOUT_KEYS = ("parallel.scheme", "parallel.tp", "parallel.pp", "parallel.pp_repeats", "parallel.dp", "parallel.fsdp",
               "parallel.cp", "train.microbatches", "train.remat")


@dataclass(frozen=True)
class Layout:
    scheme: str
    tp: int
    pp: int
    pp_repeats: int
    dp: int
    fsdp: int
    cp: int
    microbatches: int
    remat: str

    def values(self) -> tuple:
        """The values of LAYOUT_KEYS this layout sets."""
        return (self.scheme, self.tp, self.pp, self.pp_repeats, self.dp, self.fsdp, self.cp, self.microbatches,
                self.remat)

    def overrides(self) -> list[str]:
        """The config keys this layout sets (LAYOUT_KEYS)."""
        return [f"{k}={v}" for k, v in zip(LAYOUT_KEYS, self.values())]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Space:
    """What the enumeration ranges over; each a tuple of allowed values (empty: all sensible)."""

    schemes: tuple[str, ...] = ()
    tp: tuple[int, ...] = ()
    pp: tuple[int, ...] = ()
    pp_repeats: tuple[int, ...] = (1, 2)
    cp: tuple[int, ...] = ()
    remat: tuple[str, ...] = tuple(REMAT_POLICIES)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(arch: str, gpus: int, global_batch: int, seq_len: int, gpus_per_node: int,
                      space: Space) -> Iterator[Layout]:
    """Every layout of `gpus` devices. TP stays inside a node (its all-reduces are per layer; over
    the network they would dominate), so tp <= gpus_per_node unless `space.tp` asks otherwise. CP may
    span nodes (a long sequence's attention has work to hide its collectives behind); it splits the
    sequence into 2 cp chunks, so it divides seq_len / 2."""
    schemes = space.schemes or tuple(name for name, s in SCHEMES.items() if arch in s.archs)
    for name in schemes:
        if name not in SCHEMES:
            raise ConfigError(f"--schemes: unknown scheme {name!r}; choose from {sorted(SCHEMES)}")
    tps = space.tp or tuple(t for t in _divisors(gpus) if t <= gpus_per_node)
    for scheme in schemes:
        for tp in tps:
            if gpus % tp:
                continue
            for pp in space.pp or _divisors(gpus // tp):
                if gpus % (tp * pp):
                    continue
                for repeats in space.pp_repeats if pp > 1 else (1,):
                    cps = space.cp or [c for c in _divisors(gpus // (tp * pp)) if c == 1 or seq_len % (2 * c) == 0]
                    for cp in cps:
                        if gpus % (tp * pp * cp):
                            continue
                        data = gpus // (tp * pp * cp)  # the batch's devices: dp x fsdp
                        for fsdp in _divisors(data):
                            for m in _divisors(global_batch):
                                if m < pp or (global_batch // m) % data:
                                    continue
                                for remat in space.remat:
                                    yield Layout(scheme, tp, pp, repeats, data // fsdp, fsdp, cp, m, remat)


def layout_config(args: Sequence[str], layout: Layout) -> Config:
    """The config a run of `layout` loads (the command line's config `args`, then the layout's own
    keys), checked like make_plan checks it; raises ConfigError naming what does not divide."""
    return raw_layout_config(raw_args(args), layout)


def raw_layout_config(raw: dict, layout: Layout) -> Config:
    """`layout_config` of the command line's config as `raw_args` parsed it (once for every layout)."""
    raw = copy.deepcopy(raw)
    for key, value in zip(LAYOUT_KEYS, layout.values()):
        section, name = key.split(".")
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"{section}: expected a mapping, got {raw[section]!r}")
        raw[section][name] = value
    cfg = from_dict(raw)
    abstract_plan(cfg)
    return cfg
