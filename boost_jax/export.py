"""`python -m boost_jax.export RUN_DIR OUT_DIR [--step N] [--force] [--format hf]`: a checkpoint as safetensors.

A dense SwiGLU model (a LLaMA) in the Hugging Face LLaMA layout, every other model in the boost
layout, or with `--format hf` a low-rank one as a transformers custom-code model; model/hf.py
writes and reads them, docs/export.md lists the names. A run trained on chats (data.format=chat, or
with data.chat_template) also gets its chat template in tokenizer_config.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from boost_jax.config import Config
from boost_jax.data.chat import CONFIG_FILE, ChatTemplate
from boost_jax.model.hf import (
    BOOST_CONFIG,
    FORMATS,
    REMOTE_FILES,
    TOKENIZER,
    ExportError,
    check_out_dir,
    export_layout,
    export_model,
)
from boost_jax.parallel import single_device_plan
from boost_jax.runtime.cli import DEBUG_HELP, run_main

if TYPE_CHECKING:
    from boost_jax.model.run_dir import Run


def export(run: Run, out_dir: str | Path, step: int | None = None, force: bool = False, fmt: str = "auto") -> int:
    """Export checkpoint `step` (default: the newest) of an opened run dir in format `fmt` (FORMATS);
    returns the step exported."""
    out_dir = Path(out_dir)
    if out_dir.resolve() == run.run_dir.resolve():
        raise ExportError("OUT_DIR must not be the run dir")
    export_layout(run.cfg.model, fmt)  # a model the format cannot express, and
    check_out_dir(out_dir, force)  # a bad out_dir, refused before the slow restore
    chats = run.cfg.data.format == "chat" or run.cfg.data.chat_template
    template = run.chat.template if chats else None  # one that does not load, named before anything is written
    model, step = run.model(step, single_device_plan(run.cfg.model, run.cfg.parallel.scheme))
    export_model(run.cfg, model, out_dir, _run_tokenizer(run.run_dir, run.cfg), force=force, fmt=fmt)
    if template is not None:
        _write_chat_template(template, out_dir)
    return step


def _write_chat_template(template: ChatTemplate, out_dir: Path) -> None:
    """A chat-trained run's template and the named special tokens it renders with, as the
    tokenizer_config.json transformers reads beside tokenizer.json: `apply_chat_template` on the
    exported folder renders its chats as the run was trained on them (and `convert import` reads it back)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **template.special_tokens, "chat_template": template.text}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _run_tokenizer(run_dir: Path, cfg: Config) -> Path | None:
    """The tokenizer.json every training run saves in its run dir, else data.tokenizer_path; checked
    to load and to fit the model's vocab, so the export never carries a tokenizer it cannot use."""
    paths = [run_dir / TOKENIZER]
    if cfg.data.tokenizer_path:
        paths.append(Path(cfg.data.tokenizer_path).expanduser())
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return None
    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ExportError(f"{path} is not a tokenizer `tokenizers` can load ({' '.join(str(e).split())}); "
                          "restore the run's tokenizer.json or remove it to export without one") from None
    if size > cfg.model.vocab_size:
        raise ExportError(f"{path} has {size:,} tokens, more than the model's vocab_size "
                          f"{cfg.model.vocab_size:,}: it is not this run's tokenizer")
    return path


def main(argv: list[str] | None = None) -> None:
    run_main(_main, argv)


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m boost_jax.export",
        description="Export a run's checkpoint as safetensors: the Hugging Face LLaMA layout for a "
                    "dense SwiGLU model, the boost layout otherwise, or with --format hf a low-rank "
                    "model as transformers custom code (docs/export.md).",
        epilog=DEBUG_HELP)
    parser.add_argument("run_dir", help="the run dir (holds config.yaml and checkpoints/)")
    parser.add_argument("out_dir", help="folder to write; must be empty unless --force")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the newest)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty out_dir")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto: HF LLaMA / Qwen2 where the model is one, else boost; hf: svd / cola / lax "
                             "too, as a transformers model with trust_remote_code (default: auto)")
    args = parser.parse_args(argv)
    if args.step is not None and args.step < 0:
        raise ExportError(f"--step must be a checkpoint's step (>= 0), got {args.step}")
    from boost_jax.model.run_dir import open_run  # lazy: keeps Orbax out of --help

    run = open_run(args.run_dir, prepare=True, reuse_memory=False)  # no training-sized steps
    step = export(run, args.out_dir, args.step, args.force, args.format)
    out = Path(args.out_dir)
    layout = ("boost" if (out / BOOST_CONFIG).is_file() else "transformers custom code (trust_remote_code)"
              if (out / REMOTE_FILES[0]).is_file() else "Hugging Face LLaMA")
    print(f"exported step {step} of {args.run_dir} to {out} ({layout} layout): "
          + ", ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    main()
