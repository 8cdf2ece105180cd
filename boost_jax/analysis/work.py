"""Compute work of a compiled XLA program, per device: every GEMM (dot) with its shape and how often
it runs, and the bytes moved by the memory-bound instructions around them. The performance model
(`boost_jax/analysis/perf_model.py`) turns these into seconds.

GEMMs: each `dot` (standalone or inside a fusion) as (batch, m, n, k), FLOPs = 2 * batch * m * n * k,
and the matmuls of each cuDNN attention call (an XLA:GPU program's flash attention),
run trip_count times (the scanned decoder stack is one while loop, attention's query blocks a loop
inside it). A batched dot over a block of queries and its keys (m, n, k include one of
`attention_blocks`: a query block and the sequence length, or under context parallelism's ring one
device's 1/cp of it, or a causal block and the keys up to its end) is attention's score or value
matmul (`attention=True`): a GPU runs those inside a flash-attention kernel, so the model prices
them separately, at the share of their FLOPs a causal kernel does.

Memory-bound traffic: for each executed instruction that is not a GEMM, a collective or pure
bookkeeping, the bytes it reads plus the bytes it writes. Floating-point values are counted at the
program's compute width (`itemsize`): the CPU backend keeps f32 copies of bf16 elementwise work
that a GPU does not. Attention's [.., rows, s] scores (values of that shape made under its name
scope) and everything inside its query-block loop are left out (a flash-attention kernel keeps them
on chip), an in-place dynamic-update-slice counts only the slice it writes, and pure dtype
conversions, fills and layout copies are CPU artifacts that are left out. This part is the roughest
of the model: it follows XLA:CPU's fusion decisions, not a GPU's.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from boost_jax.analysis.hlo import KINDS, arrays, attr, callees, loop_contexts, nbytes, op_name, parse_module, users
from boost_jax.ops.attention import causal_blocks, query_rows

# Instructions that move no data of their own (or whose cost is accounted elsewhere).
# `copy` is a layout change or a copy XLA:CPU inserts around loop-carried scan stacks; a GPU's
# layout assignment differs, so copies are not priced.
_FREE = {"copy", "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
         "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "custom-call", "domain"}
# Pure dtype changes and fills: CPU artifacts of bf16 programs (XLA:CPU computes bf16 in f32).
_DTYPE_AND_FILL = {"convert", "bitcast", "broadcast", "constant", "reshape"}
SLICES = ("dynamic-slice", "slice", "gather")  # ops that read only the part of an operand they return
_COLLECTIVE_OPS = {f"{k}{s}" for k in KINDS for s in ("", "-start", "-done")}
# In an op_name: attention's name scope (`jax.named_scope("attention")` in ops/attention.py and
# ops/ring.py), under autodiff's jvp(...) and in names XLA merged (`a;b`); timeline.py reads it too.
ATTENTION_SCOPE = re.compile(r"(?:^|[/(;])attention[/)]")
_ATTENTION_LOOP = re.compile(r'op_name="[^"]*/attention/while"')  # its loop over query blocks
# cuDNN's fused attention on GPUs (model.attention=cudnn): one custom call per pass, whose matmuls are
# no dots in the HLO; the forward runs QK^T and PV, the backward recomputes QK^T and runs dV, dP, dQ, dK.
_CUDNN_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha\w*?(Backward)?"')
_CUDNN_MATMULS = {False: 2, True: 5}


@dataclass(frozen=True)
class Gemm:
    batch: int
    m: int
    n: int
    k: int
    trip_count: int  # executions per program run
    in_loop: bool  # inside the scanned decoder stack
    attention: bool  # attention's S x S score / value matmul
    op: str = ""  # the instruction that runs it (the dot, or the fusion it is in): a profile trace's op name
    causal_share: float = 0.5  # of an attention matmul's FLOPs, what a causal flash kernel does

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class Traffic:
    bytes: int  # per execution
    trip_count: int
    in_loop: bool


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(rf"{key}=\{{([\d,]*)\}}", attrs)
    return tuple(int(v) for v in m.group(1).split(",") if v) if m else ()


def _gemm(lhs: tuple[int, ...], rhs: tuple[int, ...], attrs: str, blocks: dict[tuple[int, int], float], trips: int,
          depth: int, op: str) -> Gemm:
    lb, lc, rb, rc = (_dims(attrs, k) for k in ("lhs_batch_dims", "lhs_contracting_dims",
                                                    "rhs_batch_dims", "rhs_contracting_dims"))
    batch = math.prod(lhs[i] for i in lb)
    k = math.prod(lhs[i] for i in lc)
    m = math.prod(s for i, s in enumerate(lhs) if i not in lb + lc)
    n = math.prod(s for i, s in enumerate(rhs) if i not in rb + rc)
    # Attention's matmuls (QK^T, PV and their gradients) pair a block of queries with its keys:
    # m, n, k hold one of `attention_blocks`.
    share = next((share for block, share in blocks.items() if Counter((m, n, k)) >= Counter(block)), None)
    named = "op_name=" in attrs  # XLA drops the name of a dot it rewrites
    if batch > 1 and share is not None and (not named or ATTENTION_SCOPE.search(op_name(attrs))):
        return Gemm(batch, m, n, k, trips, depth > 0, True, op, causal_share=share)
    return Gemm(batch, m, n, k, trips, depth > 0, False, op)


def _cudnn_attention(ins, trips: int, depth: int) -> list[Gemm]:
    """The matmuls of a cuDNN attention custom call, from its q and k operands' [B, S, H, D] shapes
    (`operand_layout_constraints`), at a causal kernel's half of their FLOPs under a causal mask."""
    backward = _CUDNN_ATTENTION.search(ins.attrs).group(1) is not None
    q, k = (dims for _, dims in arrays(re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", ins.attrs).group(1))[:2])
    share = 0.5 if re.search(r'mask_type"\s*:\s*"CAUSAL', ins.attrs) else 1.0
    gemm = Gemm(q[0] * q[2], q[1], k[1], q[3], trips, depth > 0, True, ins.name, causal_share=share)
    return [gemm] * _CUDNN_MATMULS[backward]


def _fusion_callers(comps) -> dict[str, tuple[str, str]]:
    """Each fusion body's caller: (its computation, the fusion instruction)."""
    return {attr(ins.attrs, "calls"): (c.name, ins.name) for c in comps.values() for ins in c.instrs.values()
            if ins.op == "fusion"}


def _executed(callers: dict[str, tuple[str, str]], comp: str, name: str) -> str:
    """The instruction that runs `name` of `comp`: the outermost fusion it is fused into, else itself."""
    while comp in callers:
        comp, name = callers[comp]
    return name


def _scaled_bytes(ins, itemsize: int, blocks: dict[tuple[int, int], float]) -> int | None:
    """Bytes of an instruction's value with floats at `itemsize`; None for attention's scores: a
    [.., rows, keys] value made under the `attention` name scope (a model dimension can equal the
    sequence length or the block, so the shape alone does not tell)."""
    scores = ATTENTION_SCOPE.search(op_name(ins.attrs)) is not None
    total = 0
    for dt, dims in arrays(ins.shape):
        if scores and len(dims) >= 2 and any(sorted(dims[-2:]) == sorted(block) for block in blocks):
            return None
        total += math.prod(dims) * itemsize if dt in ("f32", "bf16", "f16", "f64") else nbytes(dt, dims)
    return total


def operand_bytes(comp, ins, body, index: int, value_bytes: Callable) -> int | None:
    """Bytes an instruction (`body`: its fusion's computation, or None) reads from operand `index`,
    each value counted by `value_bytes`: only the slices it takes when the operand (e.g. the stacked
    weights of every layer) is used through slices alone."""
    full = value_bytes(comp.instrs[ins.operands[index]])
    if body is None:
        return full
    params = {p.name for p in body.instrs.values() if p.op == "parameter" and p.arg == str(index)}
    readers = [u for p in params for u in users(body, p)]
    if readers and all(u.op in SLICES and u.operands[0] in params for u in readers):
        return sum(value_bytes(u) or 0 for u in readers)
    return full


def attention_blocks(seq: int, query_block: int, cp: int = 1, group: int = 1) -> dict[tuple[int, int], float]:
    """The (rows, keys) of attention's score blocks as ops/attention.py runs them, each with the
    share of its FLOPs a causal flash kernel does: a block of `query_rows` queries against every key
    (or round a ring, 1/cp of them) half; plain causal block i of `causal_blocks`, against the keys
    up to its end, all but its diagonal square's upper half. `group`: a device's query heads per kv
    head (`context.query_group`), which the matmuls fold into a block's rows."""
    rows = query_rows(seq // cp, query_block)
    blocks = {(group * rows, kl): 0.5 for kl in {seq, seq // cp} if kl > 1}
    if cp == 1 and rows == seq:
        r = seq // causal_blocks(seq)
        blocks.update({(group * r, end): 1 - r / (2 * end) for end in range(r, seq + 1, r)})
    return blocks


def _attention_loops(comps) -> set[str]:
    """The computations attention's query-block loop runs, and everything they call."""
    todo = [c for comp in comps.values() for ins in comp.instrs.values()
            if ins.op == "while" and _ATTENTION_LOOP.search(ins.attrs) for c in callees(ins)]
    inside = set()
    while todo:
        name = todo.pop()
        if name in comps and name not in inside:
            inside.add(name)
            todo += [c for ins in comps[name].instrs.values() for c in callees(ins)]
    return inside


def analyze(hlo_text: str, *, seq: int, itemsize: int, query_block: int, cp: int = 1,
            group: int = 1, scatter_in_place: bool = False) -> tuple[list[Gemm], list[Traffic]]:
    """GEMMs and memory-bound traffic of a compiled module's text (`compiled.as_text()`);
    `query_block`: the program's `model.attention_query_block`; `cp`: its context parallelism
    (a device's queries are 1/cp of the sequence, its keys all of it or, round a ring, 1/cp);
    `group`: a device's query heads per kv head (`context.query_group`; 1 without GQA);
    `scatter_in_place`: a scatter writes its updates into its operand's buffer (a decode step's
    cache: each row's slot at its own position), so it moves the updates only, as an in-place
    dynamic-update-slice does."""
    blocks = attention_blocks(seq, query_block, cp, group)  # the dots' (G x rows, keys)
    # A score value keeps G apart ([.., G, rows, keys]) or, inside a fusion, folds it like the dots.
    scores = {**attention_blocks(seq, query_block, cp), **blocks}
    comps, entry, _ = parse_module(hlo_text)
    ctx = loop_contexts(comps, entry)
    fusion_bodies = {attr(ins.attrs, "calls") for c in comps.values() for ins in c.instrs.values() if ins.op == "fusion"}
    gemms, traffic, has_dot = [], [], set()
    callers = _fusion_callers(comps)
    for comp in comps.values():
        if comp.name not in ctx:
            continue
        depth, trips = ctx[comp.name][:2]
        for ins in comp.instrs.values():
            if ins.op == "dot":
                lhs, rhs = (arrays(comp.instrs[o].shape)[0][1] for o in ins.operands[:2])
                op = _executed(callers, comp.name, ins.name)
                gemms.append(_gemm(lhs, rhs, ins.attrs, blocks, trips, depth, op))
                has_dot.add(comp.name)
            elif ins.op == "custom-call" and _CUDNN_ATTENTION.search(ins.attrs):
                gemms += _cudnn_attention(ins, trips, depth)
    on_chip = _attention_loops(comps)
    for comp in comps.values():
        if comp.name not in ctx or comp.name in fusion_bodies or comp.name in on_chip:
            continue  # fusion bodies are priced as their fusion instruction
        depth, trips = ctx[comp.name][:2]
        for ins in comp.instrs.values():
            if ins.op in _FREE or ins.op in _COLLECTIVE_OPS or ins.op == "dot":
                continue
            body = comps.get(attr(ins.attrs, "calls") or "") if ins.op == "fusion" else None
            if body is not None and body.name in has_dot:
                continue  # a GEMM with its prologue/epilogue fused in
            # In place: (the instruction, its update's operand index), a dynamic-update-slice's or a scatter's.
            in_place = {"dynamic-update-slice": 1, **({"scatter": 2} if scatter_in_place else {})}
            if body is not None:
                ops = {i.op for i in body.instrs.values()} - {"parameter"}
                dus = next((i for i in body.instrs.values() if i.op in in_place), None)
            else:
                ops, dus = {ins.op}, (ins if ins.op in in_place else None)
            if ops <= _DTYPE_AND_FILL:
                continue  # a bf16 program on a GPU neither upcasts its values nor zero-fills scan stacks
            out = _scaled_bytes(ins, itemsize, scores)
            scaled = lambda v: _scaled_bytes(v, itemsize, scores)
            reads = [operand_bytes(comp, ins, body, i, scaled) for i, o in enumerate(ins.operands) if o in comp.instrs]
            if out is None or any(b is None for b in reads):
                continue
            if dus is not None:  # in place (into a scan stack, a cache): reads and writes the update only
                update = (body or comp).instrs[dus.operands[in_place[dus.op]]]
                moved = 2 * (_scaled_bytes(update, itemsize, scores) or 0)
            elif ins.op in SLICES:
                moved = 2 * out
            else:
                moved = out + sum(reads)
            traffic.append(Traffic(moved, trips, depth > 0))
    return gemms, traffic


def step_work(hlo_text: str, itemsize: int) -> dict[str, int]:
    """What one step of a decode program (model/decode.py's loop) does per device: the FLOPs of its
    GEMMs, the bytes its GEMMs read (both operands: the weights and the cached tokens), and the
    memory-bound instructions' bytes read and written. The loop's body only, once (the program does
    not know its trip count): what XLA does around the loop (the cache's layout changed on the way in
    and back on the way out) is paid once per call of CHUNK steps. One query per row attends to the
    cache with plain dots, no flash kernel: every instruction is priced, none taken for attention's
    on-chip work (seq 1 has no score blocks); the token's slots are written into the cache in place."""
    gemms, traffic = analyze(hlo_text, seq=1, itemsize=itemsize, query_block=1, scatter_in_place=True)
    gemms, traffic = [g for g in gemms if g.in_loop], [t for t in traffic if t.in_loop]
    return {"flops": sum(g.flops * g.trip_count for g in gemms),
            "gemm_read_bytes": sum(itemsize * g.batch * g.k * (g.m + g.n) * g.trip_count for g in gemms),
            "memory_bound_bytes": sum(t.bytes * t.trip_count for t in traffic)}
