"""The planner's recipe: the command line's config with the chosen layout's keys, as the YAML file
`python -m boost_jax.train recipe.yaml` (and `bench step recipe.yaml`) runs as is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from boost_jax.config import from_dict, raw_args
from boost_jax.planner.layouts import Layout


def write_recipe(path: str | Path, args: Sequence[str], layout: Layout) -> None:
    raw = raw_args([*args, *layout.overrides()])
    from_dict(raw)  # the recipe is a valid config before it is written
    Path(path).write_text("# Written by python -m boost_jax.plan\n" + yaml.safe_dump(raw, sort_keys=False))
