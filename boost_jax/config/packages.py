"""The optional packages a config needs (the data loader's grain, tensorboardX for log.tensorboard,
...), named before any of them is imported: a GPU machine's own Python stack may lack them, and the
train command checks here before it imports the loop (whose modules import the loader)."""

from __future__ import annotations

import importlib.util

from boost_jax.config.config import Config
from boost_jax.runtime.errors import PackageError


def check_packages(cfg: Config) -> None:
    """Name, before any work, the optional packages this run needs and lacks (importing the
    package does not need them: a GPU machine's own Python stack may have neither)."""
    need = {"grain": "the data loader (boost_jax/data/loader.py)"}
    if cfg.log.tensorboard:
        need["tensorboardX"] = "log.tensorboard=true (or set log.tensorboard=false)"
    if cfg.data.tokenizer == "sentencepiece" and cfg.data.source in ("stdlib", "files") and not cfg.data.tokenizer_path:
        need["sentencepiece"] = "data.tokenizer=sentencepiece (pip install 'boost_jax[sentencepiece]')"
    if cfg.log.wandb:
        need["wandb"] = "log.wandb=true (pip install 'boost_jax[wandb]', or set log.wandb=false)"
    # Found, not imported: tensorboardX would import torch where it is installed (training/log.py).
    missing = [f"{package}, for {why}" for package, why in need.items() if importlib.util.find_spec(package) is None]
    if missing:
        raise PackageError("not installed: " + "; ".join(missing) + ". pip install what is missing")
