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

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from boost_jax.config.archs import ARCHS


class ModelShape(Protocol):
    """What a scheme's analytic communication reads of a model (a resolved `config.ModelConfig`): named
    here so that this table does not import the config that validates against it."""

    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attn_rank: int
    mlp_rank: int
    attn_latent_heads: int
    attn_rope_dims: int
    grouping: bool

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
# layers (the stacked layer axis); with latent heads (model.attn_latent_heads), a block-diagonal B
# stored as its blocks stacked [r, d_out / g]: latent_rows (its r rows, whole groups in order) and
# latent_cols (one group's outputs); rope_key, the outputs of decoupled RoPE's key projection
# (model.attn_rope_dims: [d, g d_r], no B). Activation dimensions: batch, seq, act_embed (the residual
# stream), act_heads, act_kv_heads, act_mlp, act_latent ([T, r]), act_kv_latent (the r of k's and
# v's latents: split over tp by their latent heads under btp, else laid out as act_latent), act_kv_rope
# (decoupled RoPE's keys, one per latent head: split as act_kv_latent under btp, else whole), act_vocab.
PARAM_AXES = ("vocab", "table_embed", "embed", "heads", "kv_heads", "mlp", "rank", "norm", "final_norm", "layers",
              "latent_rows", "latent_cols", "rope_key")
ACTIVATION_AXES = ("batch", "seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_latent", "act_kv_latent",
                   "act_kv_rope", "act_vocab")
LOGICAL_AXES = frozenset(PARAM_AXES + ACTIVATION_AXES)

# `model.*` knobs of BOOST's optimizations and their defaults; a scheme lists those it acts on, and
# a non-default value under a scheme that ignores it is refused (config/config.py).
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
    layer_forward_elements: Callable[[ModelShape, int], int]
    # The backward's all-reduces per decoder layer (elements of each, per device, one entry per
    # partial sum) for `tokens` tokens per replica at a tp size: each input gradient that is a
    # partial sum over tp (docs/design.md, "Communication per layer, backward"); None where XLA
    # alone decides it (kv heads replicated because tp does not divide them).
    layer_backward_all_reduces: Callable[[ModelShape, int, int], tuple[int, ...] | None]
    summary: str
    # The latents the forward reduce-scatters per decoder layer (input elements of each, per device,
    # for `tokens` tokens per replica at a tp size): those split over tp (latent heads); the backward
    # all-gathers the same elements. Empty where every latent stays whole.
    layer_scattered: Callable[[ModelShape, int, int], tuple[int, ...]] = lambda m, tokens, tp: ()
    latent_heads: bool = False  # whether it lays model.attn_latent_heads out (each tp rank its own groups)

    def rules_for(self, n_kv_heads: int, tp: int, pp: int, latent_heads: int = 1) -> Rules:
        """The rules for a model and mesh: kv heads fewer than (or not divisible by) tp are replicated
        (GQA); under a pipeline the embedding, LM head and loss split their vocabulary over pp as well
        as tp, so each stage does 1/pp of the edges' work (docs/design.md section 9). Without latent
        heads the k and v latents are laid out as every latent."""
        rules = dict(self.rules)
        if latent_heads == 1:
            rules["act_kv_latent"] = rules.get("act_latent")
            rules["act_kv_rope"] = None  # one rotary key, on every rank
        if n_kv_heads % tp:
            rules.update(kv_heads=None, act_kv_heads=None)
        if pp > 1:
            rules.update(vocab=(TP, PP), act_vocab=(TP, PP))
        return MappingProxyType(rules)


# Every scheme splits the batch over dp and fsdp, the sequence of every activation over cp, the stacked
# layers over pipeline stages, shards each weight over fsdp on a dimension tp leaves alone
# (FSDP/ZeRO-3), and runs the embedding and LM head vocab-parallel over tp (and pp: `Scheme.rules_for`).
_COMMON = {"batch": (DP, FSDP), "seq": CP, "layers": PP, "vocab": TP, "table_embed": FSDP, "act_vocab": TP}
_COMMON_REQUIRES = (
    Requirement("train.batch_size", (DP, FSDP)),
    Requirement("model.vocab_size", (TP, PP), "vocab-parallel embedding and head, over tp and pipeline stages"),
    Requirement("model.vocab_size", (FSDP,)),
    Requirement("model.d_model", (FSDP,)),
)
_LOW_RANK = tuple(name for name, arch in ARCHS.items() if arch.low_rank)


def _megatron_elements(m: ModelShape, tokens: int) -> int:
    return tokens * 2 * m.d_model  # after o and after down


def _vanilla_elements(m: ModelShape, tokens: int) -> int:
    # Every projection's full output (decoupled RoPE: k's position-free part; its rotary keys' small
    # projection is replicated over tp, nothing to sum).
    dq, dkv, dk = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.n_kv_heads * (m.head_dim - m.attn_rope_dims)
    return tokens * (dq + dkv + dk + m.d_model + 2 * m.d_ff + m.d_model)


def _rotary_keys(m: ModelShape) -> int:
    """Decoupled RoPE's keys per token (model.attn_rope_dims d_r, one per latent head g): g d_r."""
    return m.attn_rope_dims * m.attn_latent_heads


def _btp_elements(m: ModelShape, tokens: int) -> int:
    # The rank-r latents only (a reduce-scatter counted at its input, as analysis/hlo.py counts it), and
    # decoupled RoPE's keys, whose row-parallel projection rides in q|k|v's collective.
    return tokens * (4 * m.attn_rank + 3 * m.mlp_rank + _rotary_keys(m))


def _partial_sums(split: dict[str, int], grouping: bool) -> int:
    """How many partial sums the GEMMs of one input leave, given each split projection's output width:
    one each, or with grouping one per width (the GEMMs stacked: q|k|v, GQA's q apart from k|v)."""
    return len(set(split.values())) if grouping else len(split)


def _attention_split(m: ModelShape, tp: int) -> dict[str, int] | None:
    """The output widths of q/k/v, column-parallel on heads; None where tp does not divide the kv
    heads: they are replicated (Scheme.rules_for) and the gradient of k and v, read by split q
    heads, is a partial sum XLA places itself (on k|v, or on their latents: no one analytic)."""
    if m.n_kv_heads % tp:
        return None
    return {"q": m.n_heads * m.head_dim, "k": m.n_kv_heads * (m.head_dim - m.attn_rope_dims),
            "v": m.n_kv_heads * m.head_dim}


def _megatron_backward(m: ModelShape, tokens: int, tp: int) -> tuple[int, ...] | None:
    # Column-parallel q/k/v and gate/up: each GEMM's input gradient a partial sum of [T, d].
    if (split := _attention_split(m, tp)) is None:
        return None
    attention = _partial_sums(split, m.grouping)
    mlp = _partial_sums({"gate": m.d_ff, "up": m.d_ff}, m.grouping)
    return (tokens * m.d_model,) * (attention + mlp)


def _vanilla_backward(m: ModelShape, tokens: int, tp: int) -> tuple[int, ...]:
    # Every A column-parallel (split on r): its input gradient a partial sum of the input's full width;
    # grouping stacks the A's of one input and rank (q|k|v, gate|up) into one GEMM. 3 x [T, d] +
    # [T, d_ff] at MHA llama shapes, as the authors' baseline (docs/design.md section 2).
    d = tokens * m.d_model
    qkv = _partial_sums(dict.fromkeys("qkv", m.attn_rank), m.grouping)
    gate_up = _partial_sums(dict.fromkeys(("gate", "up"), m.mlp_rank), m.grouping)
    return (d,) * qkv + (tokens * m.n_heads * m.head_dim,) + (d,) * gate_up + (tokens * m.d_ff,)


def _btp_scattered(m: ModelShape, tokens: int, tp: int) -> tuple[int, ...]:
    # Latent heads: each rank keeps its own groups of the k and v latents, so the forward
    # reduce-scatters them (one op under grouping, one each without) and the backward all-gathers
    # their gradients. The latents only, as `_btp_elements`: the online norm's statistic rides in the
    # first, one more column in each rank's share (tp columns in, one out).
    # Decoupled RoPE's keys, one per latent head, are scattered with them (with k's GEMM ungrouped).
    if m.attn_latent_heads == 1 or tp == 1:
        return ()
    rotary = _rotary_keys(m)
    if m.grouping:
        return (tokens * (2 * m.attn_rank + rotary),)
    return (tokens * m.attn_rank,) * 2 + ((tokens * rotary,) if rotary else ())


def _btp_backward(m: ModelShape, tokens: int, tp: int) -> tuple[int, ...] | None:
    # The latents' gradients, each a partial sum at its column-parallel B; grouping batches the B's of
    # equal width (GQA: B_q apart from B_k|B_v), one partial sum of their stacked latents. With latent
    # heads B_k and B_v read only the rank's own latents: no partial sum (`_btp_scattered`).
    r, q = m.attn_rank, m.mlp_rank
    if (split := _attention_split(m, tp)) is None:
        return None
    # Decoupled RoPE's one rotary key (g = 1) is replicated and read by every rank's kv heads: its
    # gradient a partial sum too (with latent heads each rank reads only its own groups' keys).
    rotary = (tokens * _rotary_keys(m),) if m.attn_rope_dims else ()
    if m.attn_latent_heads > 1 and tp > 1:
        split, rotary = {"q": split["q"]}, ()
    if not m.grouping:
        return (tokens * r,) * (len(split) + 1) + (tokens * q,) * 3 + rotary
    stacked = Counter(split.values()).values()  # B's per width
    return (*(tokens * n * r for n in stacked), tokens * r, tokens * 2 * q, tokens * q, *rotary)


SCHEMES: dict[str, Scheme] = {
    "megatron": Scheme(
        "megatron", archs=("dense",), knobs=("grouping",),
        # Column-parallel q/k/v/gate/up (split heads, d_ff), row-parallel o/down: attention and the
        # SwiGLU product run on local heads/columns, two [T, d] all-reduces per layer.
        rules=MappingProxyType({**_COMMON, "embed": FSDP, "heads": TP, "kv_heads": TP, "mlp": TP,
                                "act_heads": TP, "act_kv_heads": TP, "act_mlp": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.n_heads", (TP,)), Requirement("model.d_ff", (TP,))),
        layer_forward_elements=_megatron_elements,
        layer_backward_all_reduces=_megatron_backward,
        summary="q/k/v/gate/up column-parallel, o/down row-parallel: 2 all-reduces of [T, d] per layer",
    ),
    "vanilla": Scheme(
        "vanilla", archs=_LOW_RANK, knobs=("grouping",),
        # Megatron applied to each (A, B) pair: A split on r, B split on r, an all-reduce of the full
        # width output after every B; attention and the MLP product run replicated. With grouping
        # (the authors' baseline) A_q|A_k|A_v and A_gate|A_up run as one column-parallel GEMM each.
        rules=MappingProxyType({**_COMMON, "rank": TP, "embed": FSDP, "heads": FSDP, "kv_heads": FSDP, "mlp": FSDP,
                                "act_latent": TP, "act_kv_latent": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.attn_rank", (TP,)), Requirement("model.mlp_rank", (TP,)),
                  Requirement("model.n_heads*head_dim", (FSDP,)), Requirement("model.n_kv_heads*head_dim", (FSDP,)),
                  Requirement("model.d_ff", (FSDP,))),
        layer_forward_elements=_vanilla_elements,
        layer_backward_all_reduces=_vanilla_backward,
        summary="each (A, B) a Megatron chunk split on r: 7 all-reduces of [T, d or d_ff] per layer forward",
    ),
    "btp": Scheme(
        "btp", archs=_LOW_RANK, knobs=("norm", "grouping", "kernels"),
        # Bottleneck-aware TP: the residual stream stays sharded on d; every A is row-parallel (one
        # [T, r] all-reduce), every B column-parallel; latents replicated; r is never split. With
        # latent heads, k's and v's latents and the rows of their block-diagonal B's are split over tp
        # by groups (each rank its own kv heads' groups): a reduce-scatter instead of an all-reduce.
        rules=MappingProxyType({**_COMMON, "embed": TP, "heads": TP, "kv_heads": TP, "mlp": TP, "norm": TP,
                                "rank": FSDP, "latent_rows": TP, "latent_cols": FSDP, "rope_key": FSDP, "act_embed": TP,
                                "act_heads": TP, "act_kv_heads": TP, "act_mlp": TP, "act_kv_latent": TP,
                                "act_kv_rope": TP}),
        requires=(*_COMMON_REQUIRES, Requirement("model.n_heads", (TP,)), Requirement("model.d_ff", (TP,)),
                  Requirement("model.d_model", (TP,), "the residual is split on d"),
                  Requirement("model.attn_rank", (FSDP,)), Requirement("model.mlp_rank", (FSDP,)),
                  Requirement("model.n_kv_heads*head_dim/attn_latent_heads", (FSDP,),
                              "the columns of a latent head's block of B_k, B_v"),
                  Requirement("model.attn_rope_dims*attn_latent_heads", (FSDP,),
                              "the columns of decoupled RoPE's key projection")),
        layer_forward_elements=_btp_elements,
        layer_backward_all_reduces=_btp_backward,
        summary="residual split on d, A row-parallel, B column-parallel: 4 all-reduces of rank-r latents per layer",
        layer_scattered=_btp_scattered,
        latent_heads=True,
    ),
}


def default_scheme(arch: str) -> str:
    """`parallel.scheme=auto`: megatron for dense, btp for the low-rank archs."""
    return "btp" if ARCHS[arch].low_rank else "megatron"
