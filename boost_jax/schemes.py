"""The mesh axes and the tensor-parallel schemes, as one table (docs/design.md, "Tensor parallelism").

Every weight and activation names its dimensions with logical axes (`LOGICAL_AXES`); a scheme is
the rules mapping those names onto mesh axes, plus what the rest of the code needs to know about
it: the archs it applies to, which `model.*` knobs it uses, the shapes its splits require, and its
analytic per-layer communication (what `bench comm` compares the compiled HLO against). How a
scheme runs a block's projections (its collectives) is its strategy in
`parallel/projections.py`, registered under the same name. Adding a scheme is one entry here, its
strategy there, and its tests.

This module is a table, like `archs.py`: it imports no JAX, so the config can validate against it
in processes that never start JAX (`python -m boost_jax.data prepare`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from boost_jax.archs import ARCHS

if TYPE_CHECKING:
    from boost_jax.config import ModelConfig

# Mesh axis names, outermost first: pipeline stages (across nodes), data parallel, fully-sharded data
# parallel (ZeRO-3), context parallel (the sequence split: parallel/context.py), tensor parallel
# (innermost, so a TP group sits on neighbouring devices: one NVLink island on a GPU node, with CP
# next to it). Each is the `parallel.<name>` config key of its size.
PP, DP, FSDP, CP, TP = "pp", "dp", "fsdp", "cp", "tp"
MESH_AXES = (PP, DP, FSDP, CP, TP)

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

# Parameter dimensions: vocab, table_embed (d of the embedding table and LM head), embed (d inside
# the blocks), heads, kv_heads, mlp (d_ff), rank (r), norm (the blocks' norm scales), final_norm,
# layers (the stacked layer axis). Activation dimensions: batch, seq, act_embed (the residual
# stream), act_heads, act_kv_heads, act_mlp, act_latent ([T, r]), act_vocab.
PARAM_AXES = ("vocab", "table_embed", "embed", "heads", "kv_heads", "mlp", "rank", "norm", "final_norm", "layers")
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_latent", "act_vocab")
LOGICAL_AXES = frozenset(PARAM_AXES + ACTIVATION_AXES)

# `model.*` knobs of BOOST's optimizations and their defaults; a scheme lists those it acts on, and
# a non-default value under a scheme that ignores it is refused (config.py).
KNOB_DEFAULTS = {"norm": "online", "grouping": True, "kernels": "xla"}


@dataclass(frozen=True)
class Requirement:
    """A config value (`section.key`, or a product `model.a*b`) must divide by the product of these mesh axes."""

    key: str
    axes: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class Scheme:
    """One tensor-parallel scheme: its layout rules and what the rest of the code needs to know of it."""

    name: str
    archs: tuple[str, ...]
    knobs: tuple[str, ...]  # the model.* knobs of KNOB_DEFAULTS that change this scheme's program
    rules: Rules
    requires: tuple[Requirement, ...]
    # Elements all-reduced per decoder layer forward, per device, for `tokens` tokens per replica.
    layer_forward_elements: Callable[[ModelConfig, int], int]
    summary: str

    def rules_for(self, n_kv_heads: int, tp: int) -> Rules:
        """The rules for a model: kv heads fewer than (or not divisible by) tp are replicated (GQA)."""
        if n_kv_heads % tp == 0:
            return self.rules
        return MappingProxyType({k: (None if k in ("kv_heads", "act_kv_heads") else v) for k, v in self.rules.items()})


# Every scheme splits the batch over dp and fsdp, the sequence of every activation over cp, the stacked
# layers over pipeline stages, shards each weight over fsdp on a dimension tp leaves alone
# (FSDP/ZeRO-3), and runs the embedding and LM head vocab-parallel over tp.
_COMMON = {"batch": (DP, FSDP), "seq": CP, "layers": PP, "vocab": TP, "table_embed": FSDP, "act_vocab": TP}
_COMMON_REQUIRES = (
    Requirement("train.batch_size", (DP, FSDP)),
    Requirement("model.vocab_size", (TP,), "vocab-parallel embedding and head"),
    Requirement("model.vocab_size", (FSDP,)),
    Requirement("model.d_model", (FSDP,)),
)
_LOW_RANK = tuple(name for name, arch in ARCHS.items() if arch.low_rank)


def _megatron_elements(m: ModelConfig, tokens: int) -> int:
    return tokens * 2 * m.d_model  # after o and after down


def _vanilla_elements(m: ModelConfig, tokens: int) -> int:
    dq, dkv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return tokens * (dq + 2 * dkv + m.d_model + 2 * m.d_ff + m.d_model)  # every projection's full output


def _btp_elements(m: ModelConfig, tokens: int) -> int:
    return tokens * (4 * m.attn_rank + 3 * m.mlp_rank)  # the rank-r latents only


SCHEMES: dict[str, Scheme] = {
    "megatron": Scheme(
        "megatron", archs=("dense",), knobs=("grouping",),
        # Column-parallel q/k/v/gate/up (split heads, d_ff), row-parallel o/down: attention and the
        # SwiGLU product run on local heads/columns, two [T, d] all-reduces per layer.
        rules=MappingProxyType({**_COMMON, "embed": FSDP, "heads": TP, "kv_heads": TP, "mlp": TP,
                                "act_heads": TP, "act_kv_heads": TP, "act_mlp": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.n_heads", (TP,)), Requirement("model.d_ff", (TP,))),
        layer_forward_elements=_megatron_elements,
        summary="q/k/v/gate/up column-parallel, o/down row-parallel: 2 all-reduces of [T, d] per layer",
    ),
    "vanilla": Scheme(
        "vanilla", archs=_LOW_RANK, knobs=(),
        # Megatron applied to each (A, B) pair: A split on r, B split on r, an all-reduce of the full
        # width output after every B; attention and the MLP product run replicated.
        rules=MappingProxyType({**_COMMON, "rank": TP, "embed": FSDP, "heads": FSDP, "kv_heads": FSDP, "mlp": FSDP,
                                "act_latent": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.attn_rank", (TP,)), Requirement("model.mlp_rank", (TP,)),
                  Requirement("model.n_heads*head_dim", (FSDP,)), Requirement("model.n_kv_heads*head_dim", (FSDP,)),
                  Requirement("model.d_ff", (FSDP,))),
        layer_forward_elements=_vanilla_elements,
        summary="each (A, B) a Megatron chunk split on r: 7 all-reduces of [T, d or d_ff] per layer",
    ),
    "btp": Scheme(
        "btp", archs=_LOW_RANK, knobs=("norm", "grouping", "kernels"),
        # Bottleneck-aware TP: the residual stream stays sharded on d; every A is row-parallel (one
        # [T, r] all-reduce), every B column-parallel; latents replicated; r is never split.
        rules=MappingProxyType({**_COMMON, "embed": TP, "heads": TP, "kv_heads": TP, "mlp": TP, "norm": TP,
                                "rank": FSDP, "act_embed": TP, "act_heads": TP, "act_kv_heads": TP, "act_mlp": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.n_heads", (TP,)), Requirement("model.d_ff", (TP,)),
                  Requirement("model.d_model", (TP,), "the residual is split on d"),
                  Requirement("model.attn_rank", (FSDP,)), Requirement("model.mlp_rank", (FSDP,))),
        layer_forward_elements=_btp_elements,
        summary="residual split on d, A row-parallel, B column-parallel: 4 all-reduces of rank-r latents per layer",
    ),
}


def default_scheme(arch: str) -> str:
    """`parallel.scheme=auto`: megatron for dense, btp for the low-rank archs."""
    return "btp" if ARCHS[arch].low_rank else "megatron"
