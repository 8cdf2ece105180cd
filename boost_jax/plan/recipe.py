"""The planner's recipe: a config YAML of exactly the keys the plan set, which
`python -m boost_jax.train recipe.yaml` runs as is (and validates like any config)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from boost_jax.config import load_config
from boost_jax.plan.layouts import Layout


def nested(overrides: Sequence[str]) -> dict:
    """`section.key=value` strings as the nested mapping a config file holds."""
    out: dict = {}
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value) if value else ""
    return out


def write_recipe(path: str | Path, base: Sequence[str], overrides: Sequence[str], layout: Layout) -> None:
    keys = [*base, *overrides, *layout.overrides()]
    load_config(None, keys)  # the recipe is a valid config before it is written
    Path(path).write_text("# Written by python -m boost_jax.plan\n" + yaml.safe_dump(nested(keys), sort_keys=False))
