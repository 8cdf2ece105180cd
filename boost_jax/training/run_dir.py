"""A training run's folder: checked before any slow work (resume compatibility with the saved
config, writable folders), held against a second run, and claimed once a step has run (config.yaml,
tokenizer.json)."""

from __future__ import annotations

from pathlib import Path

import jax

from boost_jax.config import Config, ConfigError, from_dict, load_yaml
from boost_jax.model.checkpoint import changed_keys, identity
from boost_jax.runtime.paths import LOCK, check_writable_dir, lock_dir
from boost_jax.training.local_tier import local_path


class RunDir:
    """A run's folder: checked before any slow work, claimed once the first step has run."""

    def __init__(self, cfg: Config, primary: bool = True):
        """`primary`: the process that holds the run dir (process 0; the others write only through it
        and Orbax)."""
        self.cfg, self.path = cfg, Path(cfg.run_dir)
        self.saved = check_resume_compatible(cfg, self.path)  # the saved config of a run being resumed
        check_writable_dir(self.path, "run_dir")
        for name in ("metrics.jsonl", LOCK):  # files the run writes: a folder in their place is named now
            if (self.path / name).is_dir():
                raise ConfigError(f"run_dir: {self.path / name} is a folder, not a file; move it aside "
                                  "(the run writes that file)")
        if saves_checkpoints(cfg):
            check_writable_dir(self.path / "checkpoints", "run_dir")
        if cfg.checkpoint.local_dir:
            check_writable_dir(local_path(cfg.checkpoint.local_dir), "checkpoint.local_dir")
        self.lock = lock_dir(self.path, "run_dir") if primary else None  # one writer: before anything is written
        self.primary, self.claimed = primary, False

    def release(self) -> None:
        """Let another run have the run dir."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def claim(self, tokenizer, first_step) -> None:
        """Write config.yaml and the tokenizer once the first step (`first_step`: its metrics) has run:
        only a run that got through one step claims the run dir, so a failed start leaves no
        config.yaml to refuse the corrected command."""
        if self.primary and not self.claimed:
            jax.block_until_ready(first_step)
            self.cfg.dump(self.path / "config.yaml")
            tokenizer.save(str(self.path / "tokenizer.json"))  # travels with the run (and its export)
            self.claimed = True

    def schedule_note(self) -> str | None:
        """A note when train.steps changed since the saved run without a fixed schedule horizon."""
        t = self.cfg.train
        before = self.saved and (self.saved.get("train") or {}).get("steps")
        if before and before != t.steps and not t.schedule_steps:
            return (f"note: train.steps changed {before} -> {t.steps}: the LR schedule horizon changed with it "
                    "(fix train.schedule_steps to keep one schedule across extensions)")
        return None


def check_resume_compatible(cfg: Config, run_dir: Path) -> dict | None:
    """The saved config of an existing run, after checking the frozen keys did not change. (Each
    checkpoint checks them again on restore, so this only fails earlier, before any work.)"""
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return None
    aside = "move it aside to resume (each checkpoint carries the frozen keys, so the resume stays checked)"
    try:
        saved = load_yaml(saved_path)
    except ConfigError as e:
        raise ConfigError(f"{e}; {aside}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_path} is damaged (not a mapping of config keys); {aside}")
    try:
        from_dict(saved)  # an unknown section or key in it is named, as eval and generate name it
    except ConfigError as e:
        raise ConfigError(f"{saved_path} is damaged or edited: {e}; {aside}") from None
    changed = changed_keys(identity(saved), identity(cfg.to_dict()))
    if changed:
        raise ConfigError(
            f"run_dir {run_dir} holds a run with a different {', '.join(changed)}; "
            "use a new run_dir (the existing run was left untouched)"
        )
    check_optimizer_switch((saved.get("train") or {}).get("optimizer", "adamw"), cfg, f"run_dir {run_dir}")
    return saved


def check_optimizer_switch(saved: str, cfg: Config, where: str) -> bool:
    """Whether a resume switches train.optimizer (from `saved`), which only train.reset_optimizer allows:
    the parameters resume, the optimizer state starts fresh."""
    now = cfg.train.optimizer
    if saved != now and not cfg.train.reset_optimizer:
        raise ConfigError(f"train.optimizer: {where} was trained with {saved!r}, now {now!r}: its optimizer state "
                          f"does not carry over; set train.reset_optimizer=true to resume the parameters with a "
                          f"fresh {now} state, or use a new run_dir (the existing run was left untouched)")
    return saved != now


def saves_checkpoints(cfg: Config) -> bool:
    """Whether the run checkpoints: by steps (`checkpoint.every`), by time (`checkpoint.every_minutes`) or both."""
    return cfg.checkpoint.every > 0 or cfg.checkpoint.every_minutes > 0
