"""The configuration files that ship inside the package (so `pip install .` carries them):
base.yaml, every config key with its default and a comment; hardware.yaml, the GPUs of the
performance model (analysis/perf_model.py); chatml.jinja, a ChatML chat template for a tokenizer
without one (data.chat_template)."""

from pathlib import Path

BASE = Path(__file__).parent / "base.yaml"
HARDWARE = Path(__file__).parent / "hardware.yaml"
CHATML = Path(__file__).parent / "chatml.jinja"
