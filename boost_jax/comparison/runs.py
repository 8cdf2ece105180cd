"""One run of a study: an ordinary run dir, trained by `training.run.train` (which resumes from its newest
checkpoint), then evaluated on study.eval_tokens held-out tokens by `python -m boost_jax.eval`'s
evaluator; the figures go to <run_dir>/study_result.json, whose presence is what makes a run finished."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import jax

from boost_jax.comparison.grid import finite_number, read_json
from boost_jax.config import Config, ConfigError
from boost_jax.runtime.cache import atomic_write
from boost_jax.runtime.errors import DivergenceError

RESULT = "study_result.json"


def result(cfg: Config, eval_tokens: int, log=print, stopped: Callable[[], str | None] = lambda: None) -> dict:
    """The run's final figures: read when it finished before, else trained (resumed) and evaluated.
    A run that diverges is finished too, with loss None. A result file that cannot be read back is
    said in one line and computed again from the run's checkpoints. `stopped`: the signal that
    stopped the study (None to go on), asked before a run is trained."""
    from boost_jax.training.evaluate import evaluate  # optional: grain (the loop's loader)
    from boost_jax.training.run import train  # optional: grain (the loop's loader)

    path = Path(cfg.run_dir) / RESULT
    if path.is_file():
        done, why = read_result(path)
        if done is not None:
            return done
        log(f"  {path} is damaged ({why}): computing the run's result again from its checkpoints")
    if signal := stopped():
        raise SystemExit(f"stopped by {signal} before {cfg.run_dir}: every finished run is saved; rerun the same "
                         "command to resume the study")
    try:
        summary = train(cfg, jax.devices()[:1])
    except DivergenceError as e:
        out = {"loss": None, "bits_per_byte": None, "diverged": str(e)}
    else:
        if summary.get("stopped_by"):
            raise SystemExit(f"stopped by {summary['stopped_by']}: {cfg.run_dir} is saved; rerun the same command "
                             "to resume the study")
        r = evaluate(cfg.run_dir, max_tokens=eval_tokens)
        out = {**{k: r[k] for k in ("step", "loss", "bits_per_byte", "tokens")}, "spectra": final_spectra(cfg)}
    atomic_write(path, lambda f: f.write(json.dumps(out).encode()))
    loss = "diverged" if out["loss"] is None else f"val loss {out['loss']:.4f}, bpb {out['bits_per_byte']:.4f}"
    log(f"  {cfg.run_dir}: {loss}")
    return out


def read_result(path: Path) -> tuple[dict | None, str]:
    """(a finished run's figures, "") as `result` wrote them, or (None, what is wrong with the file)."""
    out, why = read_json(path)
    if why:
        return None, why
    if not isinstance(out, dict):
        return None, "not a JSON object"
    if out.get("loss") is None:  # a diverged run
        return (out, "") if out.get("bits_per_byte") is None and isinstance(out.get("diverged"), str) else \
            (None, "loss null without a divergence")
    for key, ok in (("loss", finite_number), ("bits_per_byte", finite_number), ("step", lambda x: isinstance(x, int)),
                    ("tokens", lambda x: isinstance(x, int)),
                    ("spectra", lambda x: x is None or isinstance(x, dict) and all(map(finite_number, x.values())))):
        if not ok(out.get(key)):
            return None, f"{key}: {out.get(key)!r}"
    return out, ""


def final_spectra(cfg: Config) -> dict[str, float]:
    """The factors' health at the last step (log.health: the largest sigma of each layer group's A and
    B factors and its smallest stable rank, training/health.py); empty without log.health or factors."""
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    last = next((r for r in reversed(rows) if r.get("step") == cfg.train.steps), {})
    return {k: v for k, v in last.items() if k.startswith(("spectral_a/", "spectral_b/", "stable_rank/"))}


def check_eval_split(cfg: Config, eval_tokens: int) -> None:
    """Refuse by name a validation split whose whole batches hold fewer than `eval_tokens` held-out
    tokens: before any training, so no run is spent on an eval that cannot carry the comparison."""
    from boost_jax.data.build import build_data  # optional: grain (the loader)

    t = cfg.train
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=t.seq_len, seed=t.seed, batch_size=t.batch_size)
    sets = data.eval_sets("val")
    windows = min((s.num_windows for s in sets.values()), default=0)
    held = windows // t.batch_size * t.batch_size * t.seq_len
    if held < eval_tokens:
        raise ConfigError(f"study.eval_tokens={eval_tokens:,}: the validation split of {data.directory} holds "
                          f"{held:,} evaluable tokens ({windows:,} windows of {t.seq_len}, in whole batches of "
                          f"{t.batch_size}); raise data.val_fraction or data.max_bytes, or lower study.eval_tokens")


def note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
