"""Typed run configuration, the one vocabulary of every command.

Defaults live in the dataclasses below; `boost_jax/configs/base.yaml` documents every knob (a test keeps the
two equal). A run is `defaults <- optional YAML file <- dotted key=value overrides`, validated
before any work starts: an unknown key or a bad value raises `ConfigError` naming the key. This
module imports no JAX: it validates against the tables beside it in config/: `archs.py`, `schemes.py` and
`presets.py` (and the `study` section by `study.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from boost_jax import configs
from boost_jax.config.archs import ARCHS
from boost_jax.config.presets import PRESETS
from boost_jax.config.schemes import KNOB_DEFAULTS, SCHEMES, default_scheme
from boost_jax.config.study import StudyConfig, validate_study
from boost_jax.runtime.errors import ConfigError

MAX_INT32_VOCAB = 2**31 - 1
# Choices read from their tables (config/archs.py, config/schemes.py), so adding an entry there is enough.
Arch = Literal[tuple(ARCHS)]
SchemeName = Literal[("auto", *SCHEMES)]
DType = Literal["float32", "bfloat16"]
OptimizerName = Literal["adamw", "muon", "spectron", "invariant_muon"]  # boost_jax/training/optimizers.py
# How a decoder matrix split over devices is orthogonalised (training/muon_layout.py)
MuonComm = Literal["auto", "gram", "gather", "distribute"]


@dataclass(frozen=True)
class RopeScalingConfig:
    """`model.rope_scaling.*`: RoPE's frequencies as a long-context checkpoint stretched them. default:
    theta ** (-2i / d_h) as trained; llama3 (Llama 3.1-3.3): frequencies of a wavelength above
    original_max_position_embeddings / low_freq_factor divided by factor, below .. / high_freq_factor
    kept, between them interpolated (transformers' `_compute_llama3_parameters`, ops/attention.py)."""

    type: Literal["default", "llama3"] = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """`model.*`: the architecture, its sizes (None: the preset's) and BOOST's switches."""

    preset: str = "llama-mini"
    arch: Arch = "cola"
    # Sizes: None takes the preset's value (ranks: d_model / 4).
    d_model: int | None = None
    d_ff: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    attn_rank: int | None = None
    mlp_rank: int | None = None
    # Latent heads of k and v (MLRA-style): their rank-r latents split into this many groups, each
    # group's B mapping its r / g latent columns only to its n_kv_heads / g heads (a block-diagonal B,
    # stored as the g blocks stacked: [r, n_kv_heads * head_dim / g]). 1 = one latent, as before.
    attn_latent_heads: int = 1
    # Decoupled RoPE (MLA-style, low-rank archs): that many dimensions of each head rotary, their key
    # part from a small projection of its own (one per latent head, shared by its kv heads), the rest
    # of each head position-free, so that a latent cache's decode absorbs B_k and B_v
    # (docs/design/absorbed-attention.md). 0 = RoPE on every dimension after B_k, as before.
    attn_rope_dims: int = 0
    # None = the arch's default: SwiGLU gate SiLU on for dense/svd, off for cola/lax.
    mlp_gate_silu: bool | None = None
    # The family's switches; None takes the preset's value, else the default in FAMILY_DEFAULTS.
    tie_embeddings: bool | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: RopeScalingConfig | None = None
    # A bias on q, k and v (Qwen2's): added to each projection's output, after B in the low-rank archs
    # (docs/design/hf-models.md). o, the MLP and the norms have none.
    qkv_bias: bool | None = None
    init_std: float = 0.02
    # Attention: xla (XLA's softmax attention, a loop over blocks of attention_query_block queries when
    # that divides the sequence, so one block's scores live at a time; in one block, causal blocks of
    # 128 queries that skip the keys after them, ops/attention.py) | cudnn (cuDNN's fused flash
    # kernel, GPU only, for causal self-attention; decoding and document masks use xla) | auto
    # (cudnn on GPU devices where cuDNN takes the dtype, head dim and layout: bfloat16, not float32;
    # xla elsewhere). The plan resolves it (parallel/attention_choice.py).
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    attention_query_block: int = 512
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    # BOOST's optimizations (low-rank archs under btp; docs/design.md sections 4-5):
    norm: Literal["online", "sync"] = "online"  # online: RMSNorm statistics ride the latent all-reduce
    grouping: bool = True  # q|k|v and gate|up as one GEMM + one all-reduce each (dense, vanilla: stacked GEMMs where tp splits them)
    kernels: Literal["xla", "pallas"] = "xla"  # fused norm+down-projection and grouped matmul as Pallas kernels

    def require_resolved(self, reader: str) -> None:
        """Refuse, naming `reader`, a config whose presets were never filled in (`resolved`, which
        loading a config runs once): readers take the config as it is."""
        if unset := [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]:
            raise ConfigError(f"{reader} needs a resolved ModelConfig (as a loaded config holds; else "
                              f"ModelConfig(...).resolved()): {', '.join(unset)} unset")

    def resolved(self) -> ModelConfig:
        """Fill every None from the preset and the arch; the result has no None left."""
        if self.preset not in PRESETS:
            raise ConfigError(
                f"model.preset: unknown preset {self.preset!r}; "
                f"choose one of {sorted(PRESETS)}"
            )
        p = PRESETS[self.preset]
        get = lambda name: getattr(self, name) if getattr(self, name) is not None else p.get(name)
        d, h = get("d_model"), get("n_heads")
        out = dataclasses.replace(
            self,
            d_model=d,
            d_ff=get("d_ff"),
            n_layers=get("n_layers"),
            n_heads=h,
            n_kv_heads=get("n_kv_heads") or h,
            head_dim=get("head_dim") or (d // h if h and d % h == 0 else None),
            vocab_size=get("vocab_size"),
            attn_rank=_default(get("attn_rank"), d and d // 4),
            mlp_rank=_default(get("mlp_rank"), d and d // 4),
            mlp_gate_silu=(
                self.mlp_gate_silu
                if self.mlp_gate_silu is not None
                else p.get("mlp_gate_silu", ARCHS[self.arch].default_gate_silu)
            ),
            **{name: _default(get(name), default) for name, default in FAMILY_DEFAULTS.items()},
        )
        if isinstance(out.rope_scaling, dict):  # a preset's
            out = dataclasses.replace(out, rope_scaling=RopeScalingConfig(**out.rope_scaling))
        _validate_model(out)
        return out


# The model family's switches a preset may set (presets.py: Llama 3, Qwen2.5, SmolLM2), and their
# values where neither the config nor the preset does.
FAMILY_DEFAULTS = {"tie_embeddings": False, "norm_eps": 1e-6, "rope_theta": 10000.0,
                   "rope_scaling": RopeScalingConfig(), "qkv_bias": False}


def _default(value, default):
    """None means the default; any other value (0 included) is the user's, and validated."""
    return default if value is None else value


@dataclass(frozen=True)
class MuonConfig:
    """`train.muon.*`: the orthogonalised side of muon and spectron (optax's `scale_by_muon` defaults)."""

    momentum: float = 0.95  # beta of the momentum (Keller Jordan's Muon; optax)
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    # The quintic's (a, b, c): 3 values for every iteration, or 3 x ns_steps (one triple per iteration)
    ns_coeffs: tuple[float, ...] = (3.4445, -4.7750, 2.0315)
    # Update RMS matched to AdamW's: consistent_rms x sqrt(max(fan_in, fan_out)) (Moonlight: 0.2), so
    # train.lr and train.weight_decay carry over; None = Keller Jordan's sqrt(max(1, fan_out / fan_in)).
    consistent_rms: float | None = 0.2
    # A matrix split over tp / fsdp is orthogonalised by all-reducing its Gram matrix at every
    # iteration (gram), gathering it once (gather) or handing whole layers to ranks (distribute); auto:
    # per matrix, the cheapest on `hardware` (a machine of configs/hardware.yaml) by the performance model.
    comm: MuonComm = "auto"
    hardware: str = "h100-80gb"


@dataclass(frozen=True)
class SpectronConfig:
    """`train.spectron.*`: the factor pairs' renormalisation (docs/design.md section 14)."""

    power_steps: int = 2  # power iterations per step for each factor's spectral norm (warm-started)


@dataclass(frozen=True)
class TrainConfig:
    """`train.*`: steps, the global batch, optimizer, schedule, remat, eval."""

    steps: int = 150
    batch_size: int = 16  # global, in sequences
    # Gradient accumulation: the batch runs as this many micro-batches in one step, one update.
    microbatches: int = 1
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 15  # clipped to the schedule horizon
    # Horizon of the cosine schedule; 0 = steps. Fix it to extend a run later with more steps
    # and keep the exact trajectory of one uninterrupted run.
    schedule_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    b1: float = 0.9
    b2: float = 0.95
    # adamw | muon: Muon on the decoder layers' matrices, AdamW (lr, b1, b2, weight_decay) on the rest |
    # spectron: Muon's orthogonalised factor updates renormalised per (A, B) pair (low-rank archs) |
    # invariant_muon: each factor's Muon step in the metric of the other, the same for (cA, B/c) (low-rank archs)
    optimizer: OptimizerName = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    spectron: SpectronConfig = field(default_factory=SpectronConfig)
    # A resume whose checkpoint was trained with another train.optimizer: refused, unless this lets the
    # parameters resume with a fresh optimizer state (said in one line)
    reset_optimizer: bool = False
    # Start a new run from another's parameters: a run dir (its newest checkpoint, or PATH@STEP) or a
    # Hugging Face / export folder (read as `convert import` reads it); a fresh optimizer and
    # schedule, step 0. The model is the source's (training/importer.py). "" = the seed's parameters.
    init_from: str = ""
    seed: int = 0
    remat: Literal["none", "full", "lowrank"] = "none"
    # LM head + cross-entropy this many sequence positions at a time, each chunk's logits recomputed
    # in the backward: the fp32 [batch, seq, vocab] logits never exist whole. 0 = all at once.
    loss_chunk: int = 0
    eval_every: int = 50  # 0 disables
    eval_batches: int = 4
    # A non-finite loss or gradient norm: stop the run (no checkpoint after it), or skip = drop
    # that step's update inside the jitted step (counted as `skipped` in metrics.jsonl).
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # Weight of the z-loss, mean log^2 Z of the softmax normaliser, added to the training loss
    # (PaLM: 1e-4); it keeps the logits from drifting. 0 = off. Eval losses never include it.
    z_loss: float = 0.0
    # Skip an update whose loss exceeds the mean of the last spike_window updates' losses by this
    # many of their standard deviations (counted as `spike_skipped`); 0 = off.
    spike_skip: float = 0.0
    spike_window: int = 100
    # The tokens the loss is taken over: completion = the assistant's turns (data.format=chat) or the
    # completion (prompt_completion), each with its end-of-turn token; all = every token; auto =
    # completion for those formats, all for text
    loss_on: Literal["auto", "completion", "all"] = "auto"

    def loss_on_completion(self, fmt: str) -> bool:
        """Whether only completion tokens are targets under data.format=`fmt`."""
        return self.loss_on == "completion" or (self.loss_on == "auto" and fmt != "text")


@dataclass(frozen=True)
class MixtureEntry:
    """One prepared dataset of a mixture and its share of the sequences."""

    path: str
    weight: float
    name: str = ""  # in the per-dataset eval metrics; "" = the directory's name


@dataclass(frozen=True)
class DataConfig:
    """`data.*`: where the tokens come from and how they are cut."""

    # stdlib and files are prepared into the cache on first use; prepared reads `path`; mixture
    # draws each batch's sequences from the prepared datasets of `mixture` by their weights
    source: Literal["stdlib", "files", "prepared", "mixture"] = "stdlib"
    path: str = ""  # a dataset made by `python -m boost_jax.data prepare` (source=prepared)
    # source=mixture: [{path: DIR, weight: W, name: N}, ...], one tokenizer; weights may change at a resume
    mixture: tuple[MixtureEntry, ...] = ()
    paths: tuple[str, ...] = ()  # text, .jsonl(.gz/.zst), .parquet files, dirs, globs (source=files)
    text_key: str = "text"  # field of .jsonl lines / column of Parquet files holding the text
    max_bytes: int = 8_000_000  # cap on corpus bytes read; 0 = no cap
    val_fraction: float = 0.02  # chance that a document is held out, by a stable hash of its text
    tokenizer: Literal["bpe", "byte_bpe", "sentencepiece"] = "bpe"
    tokenizer_path: str = ""  # an existing tokenizer.json instead of training one
    cache_dir: str = ""  # "" = $BOOST_JAX_CACHE or ~/.cache/boost_jax
    # JAX's persistent compilation cache of every command (boost_jax/launch/compile_cache.py), in
    # compile_cache_dir ("" = $JAX_COMPILATION_CACHE_DIR, else <cache_dir>/xla)
    compile_cache: bool = True
    compile_cache_dir: str = ""
    # Packed documents attend only within themselves: segment ids from the end-of-document tokens
    # (the loader computes them) mask attention across a boundary. Off: every token of a window
    # attends to every earlier one, as the loss has always been measured here.
    document_mask: bool = False
    # text: documents (text_key) | chat: rows with `messages`, [{role, content}, ...], rendered by the
    # chat template | prompt_completion: rows with `prompt` and `completion`. Rows are packed whole into
    # windows, each attending only within itself (segment ids and positions, whatever document_mask)
    format: Literal["text", "chat", "prompt_completion"] = "text"
    # format=chat (and generate --chat): a Jinja chat template file instead of the tokenizer's own (the chat_template of the
    # tokenizer_config.json, or chat_template.jinja, beside data.tokenizer_path); "chatml" = the ChatML
    # template shipped for a tokenizer without one (boost_jax/configs/chatml.jinja)
    chat_template: str = ""
    # A row longer than a window (train.seq_len + 1 tokens): none = refused, naming it | right = its
    # first seq_len + 1 tokens kept | drop = left out (counted in the data stats)
    truncate: Literal["none", "right", "drop"] = "none"



LOCAL_DIR_PROCESS = "{process}"  # in checkpoint.local_dir: the process index (training/local_tier.py)


@dataclass(frozen=True)
class CheckpointConfig:
    """`checkpoint.*`: how often Orbax saves, how many are kept."""

    every: int = 50  # steps between saves; 0: none by steps (none at all with every_minutes 0)
    keep: int = 3  # newest checkpoints kept
    every_minutes: float = 0.0  # also save once this many minutes have passed since the last save; 0 = off
    # Orbax writes a save in the background while training goes on (the state is copied off the
    # devices first); false: the loop waits for each save to be on disk.
    async_save: bool = True
    # A second, frequent tier on each host's own disk (training/local_tier.py), beside the persistent
    # one in run_dir; "" = off. "{process}" in it stands for the process index, so processes sharing
    # a machine keep apart.
    local_dir: str = ""
    local_every: int = 0  # steps between saves to local_dir


@dataclass(frozen=True)
class ParallelConfig:
    """`parallel.*`: the mesh's sizes, the TP scheme, simulated and multi-process devices."""

    pp: int = 1  # pipeline stages (parallel/pipeline.py); train.microbatches micro-batches flow through them
    pp_repeats: int = 1  # circular schedule: each stage runs this many chunks of layers per step
    dp: int = -1  # -1 = all devices left over
    fsdp: int = 1
    # Context parallel: the sequence of every activation split over this many devices, load-balanced
    # (parallel/context.py); attention gathers k and v (gather), passes them round a ring of ppermutes
    # with an online softmax (ring), or gathers the rank-r latents of k and v and rebuilds them (latent).
    cp: int = 1
    cp_attention: Literal["gather", "ring", "latent"] = "gather"
    tp: int = 1
    # megatron (dense only) | vanilla | btp (low-rank archs); auto = megatron for dense, else btp
    scheme: SchemeName = "auto"
    cpu_devices: int = 0  # >0: simulate this many host devices (set before JAX starts)
    # On CPU, each step's temporaries reuse the host memory the last step freed instead of fresh
    # pages: faster steps, more host memory (boost_jax/launch/host_memory.py; set before JAX starts), in
    # train, eval and bench; decoding keeps glibc's defaults. Nothing changes on an accelerator.
    cpu_reuse_memory: bool = True
    # Memory per device for the train step, in GiB; 0 = the device's own (a GPU's, as XLA's allocator
    # reports it; none on CPU). A resume whose devices would hold more than this of the global batch
    # adds train.microbatches (analysis/microbatch_fit.py).
    device_memory_gib: float = 0.0
    # Multi-process runs on JAX's distributed runtime: "" = one process; "auto" = JAX's cluster
    # detection (SLURM, Open MPI, ...); "host:port" = this coordinator with the two fields below.
    # $BOOST_JAX_COORDINATOR, $BOOST_JAX_NUM_PROCESSES, $BOOST_JAX_PROCESS_ID fill unset values.
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    # How long a process waits for the coordinator and every other process to join before it stops
    # with one message (JAX's own timeout aborts the process with a C++ stack).
    coordinator_timeout_s: int = 300
    # A process silent this long (killed, stopped, cut off) is lost: every other process stops with
    # one message naming it (JAX's coordination-service heartbeat; boost_jax/parallel/peers.py).
    heartbeat_timeout_s: int = 20


@dataclass(frozen=True)
class LogConfig:
    """`log.*`: log lines, progress bar, TensorBoard, profiler trace."""

    every: int = 10  # steps between log lines
    progress: bool = True
    tensorboard: bool = True
    # > 0: a JAX profiler trace of steps profile_start .. profile_start + profile_steps - 1 in <run_dir>/profile
    profile_start: int = 0
    profile_steps: int = 3
    # Norms of each layer group's gradients, parameters and updates at every log line (computed in
    # the step, only on those steps).
    health: bool = True
    wandb: bool = False  # also log to Weights & Biases (pip install boost_jax[wandb]; WANDB_MODE=offline works offline)
    wandb_project: str = "boost_jax"


@dataclass(frozen=True)
class ServeConfig:
    """`serve.*`: `python -m boost_jax.serve`'s decode slots, paged cache and queue (docs/guides/serving.md)."""

    slots: int = 8  # sequences decoded together, each step (the decode program's batch)
    page_tokens: int = 16  # positions per cache page
    cache_gib: float = 0.0  # the page pool's GiB per device; 0 = a GPU's memory left, on CPU every slot at the context
    prefill_chunk: int = 64  # prompt tokens per prefill call, interleaved with decode steps
    prefill_rows: int = 4  # prompts whose chunks one prefill call takes together
    decode_steps: int = 8  # decode steps per program call while no request joins (tokens stream this many at a time)
    buckets: int = 3  # program shapes per dimension: slots, slots/2, ... rows and context, context/2, ... pages
    queue: int = 64  # requests waiting for a slot before new ones get 503
    max_tokens: int = 16  # a request's max_tokens when it names none (OpenAI's default)


@dataclass(frozen=True)
class Config:
    """A whole run: one section per dataclass above, plus the run dir."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    study: StudyConfig = field(default_factory=StudyConfig)  # read by `python -m boost_jax.study` only
    serve: ServeConfig = field(default_factory=ServeConfig)  # read by `python -m boost_jax.serve` only
    run_dir: str = "runs/default"

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts and lists (what config.yaml holds)."""
        return _plain(dataclasses.asdict(self))

    def dump(self, path: str | Path) -> None:
        """Write the resolved config as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- loading


def from_args(args: typing.Sequence[str]) -> Config:
    """A command line's config: an optional YAML file (an argument without `=`) first, then
    `section.key=value` overrides; what every command reads."""
    return from_dict(raw_args(args))


def raw_args(args: typing.Sequence[str]) -> dict[str, Any]:
    """The mapping `from_args` validates: the YAML file's content with the overrides applied."""
    path = args[0] if args and "=" not in args[0] else None
    return raw_config(path, args[1:] if path else args)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- `section.key=value` overrides; validated and resolved."""
    return from_dict(raw_config(path, overrides))


def raw_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The nested mapping of a YAML file with `section.key=value` overrides applied, before defaults
    and validation (what a recipe written back holds)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = load_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        raw = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[leaf] = _parse_yaml(value, f"override {item!r}") if value else ""
    return raw


def load_yaml(path: Path) -> Any:
    """A YAML file's content; an unreadable or binary file, or a syntax error, names the file (and the line)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a YAML text file (byte {e.start} is not UTF-8)") from None
    return _parse_yaml(text, str(path))


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None


def from_dict(raw: dict[str, Any]) -> Config:
    """A validated, resolved config from a nested mapping of config keys (unknown keys raise)."""
    cfg = _build(Config, raw, "")
    cfg = dataclasses.replace(cfg, model=cfg.model.resolved())
    if cfg.parallel.scheme == "auto":
        scheme = default_scheme(cfg.model.arch)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, scheme=scheme))
    _validate(cfg)
    return cfg


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow: a planner builds a config per layout


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}; valid keys: {names}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{f.name}: missing (required)")
    for name in names:
        if name not in raw:
            continue
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, raw[name], f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(raw[name], typ, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(typ):
        return _build(typ, value, f"{key}.")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        many = dataclasses.is_dataclass(args[0])  # entries named by index: data.mixture[1].weight
        return tuple(_coerce(v, args[0], f"{key}[{i}]" if many else key) for i, v in enumerate(value))
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # no key means anything by inf or nan (0 is what disables)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {typ}")  # a bug in this file, not user input


# ----------------------------------------------------------------------------- validation


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _validate_model(m: ModelConfig) -> None:
    for name in ("d_model", "d_ff", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "vocab_size", "attn_rank", "mlp_rank", "attention_query_block"):
        v = getattr(m, name)
        _require(v is not None and v > 0, f"model.{name}",
                 f"must be a positive integer, got {v!r}"
                 + (" (d_model must divide by n_heads, or set head_dim)" if name == "head_dim" else "")
                 + (" (null means the default, d_model / 4)" if name.endswith("_rank") else ""))
    # Token ids travel as int32 (and tokenizers' ids are u32): a larger vocab cannot be addressed.
    _require(m.vocab_size <= MAX_INT32_VOCAB, "model.vocab_size", f"must be at most {MAX_INT32_VOCAB:,} (token ids are "
             f"int32), got {m.vocab_size:,}")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"n_heads={m.n_heads} must be a multiple of n_kv_heads={m.n_kv_heads}")
    _require(m.head_dim % 2 == 0, "model.head_dim", f"RoPE needs an even head_dim, got {m.head_dim}")
    _require(m.norm_eps > 0, "model.norm_eps", "must be > 0")
    _require(m.rope_theta > 0, "model.rope_theta", "must be > 0")
    _require(m.init_std > 0, "model.init_std", "must be > 0")
    _validate_rope_scaling(m.rope_scaling)
    _validate_latent_heads(m)
    _validate_rope_dims(m)


def _validate_rope_dims(m: ModelConfig) -> None:
    n = m.attn_rope_dims
    if n == 0:
        return
    key = "model.attn_rope_dims"
    _require(n > 0, key, f"must be >= 0 (0 = RoPE on the whole head after B_k), got {n}")
    _require(ARCHS[m.arch].low_rank, key,
             f"{n} decouples the rotary keys from B_k of a low-rank arch (svd, cola, lax); arch {m.arch} has no B_k "
             "(leave it at 0)")
    _require(n % 2 == 0, key, f"RoPE rotates pairs of dimensions: {n} is odd")
    _require(n < m.head_dim, key,
             f"{n} must be smaller than model.head_dim={m.head_dim} (the rest of each head, head_dim - {n}, is the "
             "position-free part B_k makes)")


def _validate_rope_scaling(r: RopeScalingConfig) -> None:
    if r.type == "default":
        return
    _require(r.factor >= 1, "model.rope_scaling.factor", f"must be >= 1 (the context's stretch), got {r.factor}")
    _require(0 < r.low_freq_factor < r.high_freq_factor, "model.rope_scaling.high_freq_factor",
             f"must exceed model.rope_scaling.low_freq_factor > 0 (llama3 interpolates between them), got "
             f"low {r.low_freq_factor}, high {r.high_freq_factor}")
    _require(r.original_max_position_embeddings > 0, "model.rope_scaling.original_max_position_embeddings",
             f"must be > 0, got {r.original_max_position_embeddings}")


def _validate_latent_heads(m: ModelConfig) -> None:
    g = m.attn_latent_heads
    _require(g > 0, "model.attn_latent_heads", f"must be a positive integer (1 = one latent), got {g}")
    if g == 1:
        return
    _require(ARCHS[m.arch].low_rank, "model.attn_latent_heads",
             f"{g} splits the k/v latents of a low-rank arch (svd, cola, lax); arch {m.arch} has none (leave it at 1)")
    _require(m.attn_rank % g == 0, "model.attn_latent_heads",
             f"{g} must divide model.attn_rank={m.attn_rank} (each latent head takes attn_rank / g latent columns)")
    _require(m.n_kv_heads % g == 0, "model.attn_latent_heads",
             f"{g} must divide model.n_kv_heads={m.n_kv_heads} (each latent head feeds n_kv_heads / g kv heads)")


@functools.cache
def hardware_names() -> list[str]:
    """The machines of boost_jax/configs/hardware.yaml (config/hardware.py reads their constants)."""
    return list(load_yaml(configs.HARDWARE) or {})


def _validate_optimizer(t: TrainConfig, m: ModelConfig) -> None:
    u = t.muon
    _require(0 < u.momentum < 1, "train.muon.momentum", f"must be in (0, 1), got {u.momentum}")
    _require(u.ns_steps > 0, "train.muon.ns_steps", f"must be >= 1 Newton-Schulz iteration, got {u.ns_steps}")
    _require(len(u.ns_coeffs) in (3, 3 * u.ns_steps), "train.muon.ns_coeffs",
             f"must hold 3 values (a, b, c for every iteration) or 3 x train.muon.ns_steps = {3 * u.ns_steps} "
             f"(a triple per iteration), got {len(u.ns_coeffs)}")
    _require(u.consistent_rms is None or u.consistent_rms > 0, "train.muon.consistent_rms",
             f"must be > 0 (Moonlight: 0.2) or null, got {u.consistent_rms}")
    machines = hardware_names()
    _require(u.hardware in machines, "train.muon.hardware",
             f"unknown machine {u.hardware!r}; {configs.HARDWARE.name} has {machines}")
    _require(t.spectron.power_steps > 0, "train.spectron.power_steps",
             f"must be >= 1 power iteration, got {t.spectron.power_steps}")
    _require(t.optimizer not in ("spectron", "invariant_muon") or ARCHS[m.arch].low_rank, "train.optimizer",
             f"{'spectron renormalises' if t.optimizer == 'spectron' else 'invariant_muon updates'} low-rank factor "
             f"pairs: arch {m.arch} has none (use muon)")


def _validate(c: Config) -> None:
    t = c.train
    for name in ("steps", "batch_size", "microbatches", "seq_len", "eval_batches"):
        _require(getattr(t, name) > 0, f"train.{name}", "must be > 0")
    _require(t.batch_size % t.microbatches == 0, "train.microbatches",
             f"train.batch_size={t.batch_size} must divide by train.microbatches={t.microbatches}")
    _require(t.loss_chunk >= 0 and (t.loss_chunk == 0 or t.seq_len % t.loss_chunk == 0), "train.loss_chunk",
             f"must be 0 (whole sequence) or divide train.seq_len={t.seq_len}, got {t.loss_chunk}")
    _require(t.lr > 0, "train.lr", "must be > 0")
    _require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _require(t.schedule_steps >= 0, "train.schedule_steps", "must be >= 0 (0 = steps)")
    _require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    _require(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    _require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables)")
    _require(0 <= t.b1 < 1 and 0 <= t.b2 < 1, "train.b1/b2", "must be in [0, 1)")
    _validate_optimizer(t, c.model)
    _require(t.eval_every >= 0, "train.eval_every", "must be >= 0")
    _require(t.z_loss >= 0, "train.z_loss", f"must be >= 0 (0 = off), got {t.z_loss}")
    _require(t.spike_skip >= 0, "train.spike_skip", f"must be > 0 standard deviations, or 0 = off; got {t.spike_skip}")
    _require(t.spike_window >= 2, "train.spike_window", f"must be >= 2 losses (a standard deviation needs two), "
             f"got {t.spike_window}")
    _require(c.checkpoint.every_minutes >= 0, "checkpoint.every_minutes",
             f"must be >= 0 (0 = off), got {c.checkpoint.every_minutes}")
    d = c.data
    _require(0 <= d.val_fraction < 1, "data.val_fraction", "must be in [0, 1)")
    _require(d.val_fraction > 0 or t.eval_every == 0 or d.source not in ("stdlib", "files"), "data.val_fraction",
             f"0 holds no validation data out, so train.eval_every={t.eval_every} would evaluate nothing: set "
             "train.eval_every=0 too, or a val_fraction > 0")
    _require(d.max_bytes >= 0, "data.max_bytes", "must be >= 0")
    _require(t.loss_on != "completion" or d.format != "text", "train.loss_on",
             "completion needs instruction data (data.format=chat or prompt_completion): text has no completion")
    _require(d.format == "text" or d.source in ("files", "prepared"), "data.format",
             f"{d.format} rows are read from data.source=files or a prepared dataset, not {d.source}")
    _require(d.format == "text" or bool(d.tokenizer_path) or d.source == "prepared", "data.tokenizer_path",
             f"data.format={d.format} fine-tunes a model: name its tokenizer.json (e.g. RUN_DIR/tokenizer.json)")
    _require(d.source != "files" or bool(d.paths), "data.paths", "source=files needs data.paths")
    _require(d.source != "prepared" or bool(d.path), "data.path", "source=prepared needs data.path")
    _require((d.source == "mixture") == bool(d.mixture), "data.mixture",
             "source=mixture needs data.mixture, a list of {path, weight}" if d.source == "mixture"
             else f"is read only with data.source=mixture (now {d.source})")
    for i, e in enumerate(d.mixture):
        _require(bool(e.path), f"data.mixture[{i}].path", "must name a prepared dataset")
        _require(math.isfinite(e.weight) and e.weight >= 0, f"data.mixture[{i}].weight",
                 f"must be a finite number >= 0, got {e.weight}")
    if d.mixture:
        _require(sum(e.weight for e in d.mixture) > 0, "data.mixture", "the weights sum to 0: no dataset to draw from")
        names = [mixture_name(e) for e in d.mixture]
        _require(len(set(names)) == len(names), "data.mixture",
                 f"two datasets share a name ({names}): give each a distinct `name`")
    _require(c.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0 disables)")
    _require(c.checkpoint.keep > 0, "checkpoint.keep", "must be > 0")
    k = c.checkpoint
    _require(k.local_every >= 0, "checkpoint.local_every", f"must be >= 0, got {k.local_every}")
    _require(k.local_every == 0 or bool(k.local_dir), "checkpoint.local_every",
             f"{k.local_every} needs checkpoint.local_dir (a folder on each host's own disk) to save into")
    stray = re.search(r"\{[^}]*\}?|\}", k.local_dir.replace(LOCAL_DIR_PROCESS, ""))
    _require(stray is None, "checkpoint.local_dir", f"{k.local_dir!r}: {stray and stray.group()} is not a placeholder; "
             f"the one it takes is {LOCAL_DIR_PROCESS} (the process index), e.g. /local/ckpt/{LOCAL_DIR_PROCESS}")
    _require(not k.local_dir or k.local_every > 0, "checkpoint.local_dir",
             "needs checkpoint.local_every > 0 (the steps between its saves)")
    _require(not k.local_dir or k.every > 0 or k.every_minutes > 0, "checkpoint.local_dir",
             "is the frequent tier beside the persistent checkpoints in run_dir, which are off: set "
             "checkpoint.every or checkpoint.every_minutes > 0")
    for name in ("slots", "page_tokens", "prefill_chunk", "prefill_rows", "decode_steps", "buckets", "queue", "max_tokens"):
        _require(getattr(c.serve, name) > 0, f"serve.{name}", f"must be a positive integer, got {getattr(c.serve, name)}")
    _require(c.serve.cache_gib >= 0, "serve.cache_gib", f"must be >= 0 GiB (0 = every slot at the full context), "
             f"got {c.serve.cache_gib}")
    p = c.parallel
    _require(p.pp > 0, "parallel.pp", "must be > 0")
    _require(p.pp_repeats > 0, "parallel.pp_repeats", "must be > 0")
    _require(p.dp == -1 or p.dp > 0, "parallel.dp", "must be > 0 or -1 (fill)")
    _require(p.fsdp > 0, "parallel.fsdp", "must be > 0")
    _require(p.cp > 0, "parallel.cp", "must be > 0")
    _require(p.cp == 1 or t.seq_len % (2 * p.cp) == 0, "parallel.cp",
             f"train.seq_len={t.seq_len} must divide by 2 x parallel.cp = {2 * p.cp} (each device holds two of the "
             "sequence's 2 x cp chunks, one early and one late, so causal attention's work is even)")
    _require(t.loss_chunk % p.cp == 0, "train.loss_chunk",
             f"{t.loss_chunk} must divide by parallel.cp={p.cp} (each device takes loss_chunk / cp positions of a chunk)")
    _require(p.cp_attention != "latent" or ARCHS[c.model.arch].low_rank, "parallel.cp_attention",
             f"'latent' gathers the rank-r latents of k and v: arch {c.model.arch} has none (use gather or ring)")
    _require(p.cp == 1 or p.cp_attention != "latent" or not c.model.qkv_bias, "parallel.cp_attention",
             "'latent' rebuilds k and v from their gathered latents, without model.qkv_bias's bias (use gather or ring)")
    _require(p.tp > 0, "parallel.tp", "must be > 0")
    _require(p.cpu_devices >= 0, "parallel.cpu_devices", "must be >= 0")
    _require(p.coordinator_timeout_s > 0, "parallel.coordinator_timeout_s", f"must be > 0, got {p.coordinator_timeout_s}")
    _require(p.device_memory_gib >= 0, "parallel.device_memory_gib",
             f"must be >= 0 GiB (0 = the device's own), got {p.device_memory_gib}")
    _require(p.heartbeat_timeout_s > 0, "parallel.heartbeat_timeout_s", f"must be > 0, got {p.heartbeat_timeout_s}")
    _require(p.num_processes >= 0, "parallel.num_processes", "must be >= 0")
    scheme = SCHEMES[p.scheme]
    _require(c.model.arch in scheme.archs, "parallel.scheme",
             f"{p.scheme} does not apply to arch {c.model.arch}: "
             + "; ".join(f"{s.name} takes {'/'.join(s.archs)}" for s in SCHEMES.values()))
    g = c.model.attn_latent_heads
    _require(g == 1 or scheme.latent_heads, "model.attn_latent_heads",
             f"{g} needs a scheme that lays the latent heads out over tp (btp); parallel.scheme={p.scheme} "
             "splits the rank or the dense weights instead")
    _require(g == 1 or g % p.tp == 0, "model.attn_latent_heads",
             f"{g} must divide by parallel.tp={p.tp}: each tp rank keeps whole latent heads (g / tp of them)")
    for knob, default in KNOB_DEFAULTS.items():  # a setting the program would ignore is a mistake
        value = getattr(c.model, knob)
        _require(value == default or knob in scheme.knobs, f"model.{knob}",
                 f"{value!r} has no effect under parallel.scheme={p.scheme} with arch {c.model.arch} "
                 f"(schemes that use it: {[s.name for s in SCHEMES.values() if knob in s.knobs]}); "
                 f"leave it at {default!r}")
    _require(c.log.every > 0, "log.every", "must be > 0")
    _require(c.log.profile_start >= 0, "log.profile_start", "must be >= 0 (0 = no profile)")
    _require(c.log.profile_steps > 0, "log.profile_steps", "must be > 0")
    _require(bool(c.run_dir), "run_dir", "must not be empty")
    validate_study(c.study, typing.get_args(OptimizerName))


def _plain(x: Any) -> Any:
    """Tuples to lists so the dump is plain YAML."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def mixture_name(entry: MixtureEntry) -> str:
    """A mixture dataset's name in metrics: its `name`, or its directory's."""
    return entry.name or Path(entry.path).expanduser().name
