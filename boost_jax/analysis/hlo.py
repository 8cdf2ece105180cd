"""Communication audit: every collective in a compiled XLA program, its payload and how often it runs.

`collectives(hlo_text)` parses the text of `jax.jit(f).lower(*args).compile().as_text()`;
`audit(fn, *args)` does the jit/lower/compile for you (pass `jax.ShapeDtypeStruct`s with shardings
and nothing is allocated); `summarize` totals a list of them.

Byte conventions (`Collective.bytes`, per device, per execution):
  all-reduce          the operand (= result) size
  all-gather          the OUTPUT (gathered) size
  reduce-scatter      the INPUT size (= result size x group_size)
  all-to-all          the operand (= result) size
  collective-permute  the operand (= result) size
Combined collectives (XLA's combiners merge independent ops into one op with a tuple shape, and the
CPU backend emits all-to-all as one tuple op of group_size pieces) count as ONE collective, since
one op is issued: `bytes` sums the parts, `parts` lists each (dtype, shape), `dtype`/`shape` are
those of the first part. Async pairs (`all-reduce-start`/`-done`, ...) count once, under the base
kind, read from the `-done` (the result shape) plus the `-start` (its attributes); a collective
wrapped by a generic `async-start` is found in its wrapped computation.

bf16 upcasts: XLA's CPU backend runs AllReducePromotion, which rewrites a bf16 all-reduce or
reduce-scatter into convert->f32, an f32 collective, convert->bf16, and renames its reduction
computation `<name>_promoted`; a bf16 collective-permute or all-gather it moves as f32 behind a
widening convert (alone, or ending the fusion that made the value). The program (and a GPU) moves
bf16, so such collectives are reported with `dtype="bf16"`, `bytes` at 2 bytes/element, `upcast_from="f32"` (the dtype the backend
actually moved) and `bytes_as_compiled` at f32. The input-side convert is often fused away (into a
producer that computes in f32), so the signals used are the `_promoted` name plus, per part of a
combined op, the convert back to the narrow type that follows the result.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# AllReducePromotion's (from, to) pairs: CPU promotes bf16->f32, GPU s16->s32 and u16->u32.
_PROMOTED_FROM = {"f32": "bf16", "s32": "s16", "u32": "u16"}
# Attributes naming computations whose instructions run as part of the caller. to_apply only
# counts for `call`: on collectives, reduces, ... it is a scalar reduction function.
_CALLEE_ATTRS = ("calls", "body", "condition", "true_computation", "false_computation")
# The JAX name of an op of a gradient's backward pass (its metadata op_name).
_BACKWARD = re.compile(r'op_name="[^"]*\btranspose\(')


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    dtype: str  # element type as communicated by the program (bf16 even if the backend upcast it)
    shape: tuple[int, ...]  # result shape (first part for a combined op)
    bytes: int  # payload per device per execution, see the module docstring
    replica_groups: str  # canonical explicit form "{{0,1,2,3},{4,5,6,7}}"; permutes: source_target_pairs
    group_size: int  # devices per group (2 for a point-to-point collective-permute)
    computation: str  # HLO computation containing the op
    loop_depth: int  # number of enclosing while loops (0 = top level)
    trip_count: int  # product of the known trip counts of the enclosing while loops
    upcast_from: str | None  # dtype the backend actually moved when it upcast the op (e.g. "f32")
    trip_count_known: bool = True  # False if some enclosing while had no known_trip_count (taken as 1)
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (dtype, shape) of each part, as communicated
    bytes_as_compiled: int = 0  # payload at the dtypes of the compiled HLO
    name: str = ""  # instruction name, e.g. "all-reduce.3"
    backward: bool = False  # made by the backward pass: JAX names those ops transpose(jvp(...))
    conditional: bool = False  # inside a branch of a conditional: runs on the steps that take it only


@dataclass
class _Instr:
    name: str
    shape: str  # e.g. "f32[16,64]{1,0}" or "(f32[16,64]{1,0}, f32[16,32]{1,0})"
    op: str
    operands: list[str]  # names of the operand instructions
    arg: str  # the operand list as printed (a parameter's number)
    attrs: str  # everything after the operand list


@dataclass
class _Comp:
    name: str
    instrs: dict[str, _Instr] = field(default_factory=dict)


_BRACKET_RE = re.compile(r"[(){}\[\]]")
_DEPTH = {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i] (the regex skips the text between brackets)."""
    depth = 0
    for m in _BRACKET_RE.finditer(s, i):
        depth += _DEPTH[m.group()]
        if depth == 0:
            return m.end()
    raise ValueError(f"unbalanced: {s[i:i + 80]}")


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{$")
# Instructions as compiled modules print them: "%name = shape op(%operand, ...), attr=..., ...".
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.groups()
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = rest[: rest.index("(")]
    close = _balanced(rest, len(op))
    arg = rest[len(op) + 1: close - 1]
    return _Instr(name, shape, op, _OPERAND_RE.findall(arg), arg, rest[close:])


def parse_module(text: str) -> tuple[dict[str, _Comp], str, int]:
    """Computations by name, the entry's name, and the device count (num_partitions x replicas)."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        if cur is None:
            m = _COMP_RE.match(line.strip())
            if m:
                cur = comps.setdefault(m.group(2), _Comp(m.group(2)))
                entry = m.group(2) if m.group(1) else entry
        elif line.strip() == "}":
            cur = None
        elif ins := _parse_instr(line):
            cur.instrs[ins.name] = ins
    header = re.search(r"^HloModule.*$", text, re.M)
    header = header.group() if header else ""
    n_dev = math.prod(int(v) for v in re.findall(r"(?:num_partitions|replica_count)=(\d+)", header))
    return comps, entry or next(iter(comps)), n_dev


_ATTR_VALUE = r"=%?([\w.\-]+)"  # after `key`: a name, the `%` optional


@functools.cache
def _attr_re(key: str) -> re.Pattern:
    return re.compile(rf"\b{key}{_ATTR_VALUE}")


def attr(attrs: str, key: str) -> str | None:
    m = _attr_re(key).search(attrs)
    return m.group(1) if m else None


_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


def op_name(attrs: str) -> str:
    """An instruction's JAX name (its metadata op_name): "" when XLA made the instruction up."""
    m = _OP_NAME.search(attrs)
    return m.group(1) if m else ""


# One pass over an instruction's attributes finds all its callee keys (a search per key was most of
# the time `loop_contexts` took on a llama-7b module).
_CALLEE_RE = re.compile(rf"\b({'|'.join(_CALLEE_ATTRS)}|to_apply){_ATTR_VALUE}")


def callees(ins: _Instr) -> list[str]:
    """The computations an instruction runs (a while's body and condition, a fusion's, a call's)."""
    found: dict[str, str] = {}
    for m in _CALLEE_RE.finditer(ins.attrs):
        found.setdefault(m.group(1), m.group(2))
    keys = _CALLEE_ATTRS + (("to_apply",) if ins.op == "call" else ())
    names = [found[k] for k in keys if k in found]
    if m := re.search(r"branch_computations=\{([^}]*)\}", ins.attrs):
        names += re.findall(r"%?([\w.\-]+)", m.group(1))
    return names


def loop_contexts(comps: dict[str, _Comp], entry: str) -> dict[str, tuple[int, int, bool, bool]]:
    """(loop_depth, trip_count, trip_count_known, in a conditional's branch) of each computation
    reachable from the entry.

    After XLA's call-graph flattening each computation has one call site, so first visit wins.
    A while condition is treated like its body (it actually runs once more)."""
    ctx, todo = {entry: (0, 1, True, False)}, [entry]
    while todo:
        name = todo.pop()
        depth, trips, known, branch = ctx[name]
        for ins in comps[name].instrs.values():
            inner = (depth, trips, known, branch or ins.op == "conditional")
            if ins.op == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                inner = (depth + 1, trips * int(m.group(1) if m else 1), known and m is not None, branch)
            for callee in callees(ins):
                if callee in comps and callee not in ctx:
                    ctx[callee] = inner
                    todo.append(callee)
    return ctx


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) leaves of an HLO shape string; layouts ({1,0}) are skipped."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in re.findall(r"([a-z]\w*)\[([\d,]*)\]", shape)]


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
    return math.ceil(math.prod(dims) * bits / 8)


def canonical_groups(groups: str) -> str:
    """Explicit "{{0,1},{2,3}}" form of replica groups given explicitly, in iota form
    "[2,4]<=[4,2]T(1,0)" (iota over the bracketed dims, transposed, reshaped to [groups, size]) or
    in mesh form "mesh['a'=2,'b'=4] {'b'}" (devices in iota order over the mesh; one group per
    position along the axes not listed)."""
    if mm := re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", groups.strip()):
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mm.group(1))}
        axes, names = re.findall(r"'([^']+)'", mm.group(2)), list(sizes)
        ids = np.arange(math.prod(sizes.values())).reshape([sizes[n] for n in names])
        order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
        ids = ids.transpose(order).reshape(-1, math.prod(sizes[a] for a in axes))
        return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in ids.tolist()) + "}"
    m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", groups.strip())
    if not m:
        return re.sub(r"\s+", "", groups)
    out, dims, perm = ([int(v) for v in g.split(",")] if g else None for g in m.groups())
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm or range(len(dims)))
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in ids.reshape(out).tolist()) + "}"


def _groups(attrs: str, kind: str, n_dev: int) -> tuple[str, int]:
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=(\{[{}\d,\s]*\})", attrs)
        return (canonical_groups(m.group(1)) if m else "", 2)
    m = re.search(r"replica_groups=(\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                  r"|mesh\[[^\]]*\]\s*\{[^}]*\})", attrs)
    groups = canonical_groups(m.group(1)) if m else "{}"
    if groups == "{}":  # empty = one group of every device
        return groups, n_dev
    return groups, len(re.match(r"\{\{([\d,]*)\}", groups).group(1).split(","))


def users(comp: _Comp, name: str) -> list[_Instr]:
    return [i for i in comp.instrs.values() if name in i.operands]


def _narrowed_to(comps: dict[str, _Comp], comp: _Comp, ins: _Instr, index: int) -> str | None:
    """Dtype that part `index` of the tuple-shaped `ins` is converted to right after the collective,
    looking through its get-tuple-element and into the fusion that consumes it."""
    gtes = [u.name for u in users(comp, ins.name)
            if u.op == "get-tuple-element" and attr(u.attrs, "index") == str(index)]
    for gte in gtes:
        for user in users(comp, gte):
            if user.op == "convert":
                return arrays(user.shape)[0][0]
            fused = comps.get(attr(user.attrs, "calls") or "")
            if user.op != "fusion" or fused is None:
                continue
            k = str(user.operands.index(gte))
            for param in (p for p in fused.instrs.values() if p.op == "parameter" and p.arg == k):
                for conv in (u for u in users(fused, param.name) if u.op == "convert"):
                    return arrays(conv.shape)[0][0]
    return None


_LAYOUT_ONLY = ("bitcast", "copy", "transpose", "reshape")


def _widened_from(comps: dict[str, _Comp], comp: _Comp, ins: _Instr) -> str | None:
    """Dtype the operand of `ins` had before a widening convert, followed by nothing but layout ops
    (bitcast, copy, transpose, reshape), made it: how XLA:CPU moves a bf16 all-gather or
    collective-permute as f32 (the convert alone, or ending a fusion that computes in f32 and rounds
    to bf16 first)."""
    src = comp.instrs.get(ins.operands[0]) if ins.operands else None
    fused = comps.get(attr(src.attrs, "calls") or "") if src is not None and src.op == "fusion" else None
    where = fused if fused is not None else comp
    node = list(fused.instrs.values())[-1] if fused is not None else src  # the ROOT prints last
    while node is not None and node.op in _LAYOUT_ONLY and node.operands:
        node = where.instrs.get(node.operands[0])
    if node is None or node.op != "convert" or not node.operands or node.operands[0] not in where.instrs:
        return None
    return arrays(where.instrs[node.operands[0]].shape)[0][0]


def _collective(comps: dict[str, _Comp], comp: _Comp, ins: _Instr, ctx: dict, n_dev: int) -> Collective | None:
    """The Collective for a sync op or an async -done op (attributes read from its -start)."""
    kind = ins.op.removesuffix("-done")
    if kind not in KINDS or (ins.op != kind and not ins.operands):
        return None
    attrs = comp.instrs[ins.operands[0]].attrs if ins.op != kind else ins.attrs
    groups, size = _groups(attrs, kind, n_dev)
    compiled = arrays(ins.shape)
    promoted = "_promoted" in (attr(attrs, "to_apply") or "")
    parts = []
    for i, (dt, dims) in enumerate(compiled):
        orig = _PROMOTED_FROM.get(dt) if promoted else None
        # A lone op is promoted by definition; a combined one may mix promoted and genuine f32
        # parts, so each part must be converted back to the narrow type after the collective.
        if orig and ins.shape.startswith("(") and _narrowed_to(comps, comp, ins, i) != orig:
            orig = None
        if kind in ("collective-permute", "all-gather") and dt in _PROMOTED_FROM and \
                _widened_from(comps, comp, ins) == _PROMOTED_FROM[dt]:
            orig = _PROMOTED_FROM[dt]
        parts.append((orig or dt, dims))
    scale = size if kind == "reduce-scatter" else 1
    depth, trips, known, branch = ctx[comp.name]
    return Collective(
        kind=kind, dtype=parts[0][0], shape=parts[0][1],
        bytes=scale * sum(nbytes(dt, dims) for dt, dims in parts),
        replica_groups=groups, group_size=size, computation=comp.name, loop_depth=depth,
        trip_count=trips, trip_count_known=known,
        upcast_from=next((c for (c, _), (p, _) in zip(compiled, parts) if c != p), None),
        parts=tuple(parts), bytes_as_compiled=scale * sum(nbytes(dt, dims) for dt, dims in compiled),
        name=ins.name, backward=_BACKWARD.search(attrs) is not None, conditional=branch)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of an HLO module's text (reachable from ENTRY), in textual order. Ops whose
    groups hold one device (left behind for a mesh axis of size 1) move nothing and are skipped."""
    comps, entry, n_dev = parse_module(hlo_text)
    ctx = loop_contexts(comps, entry)
    return [c for comp in comps.values() if comp.name in ctx for ins in comp.instrs.values()
            if (c := _collective(comps, comp, ins, ctx, n_dev)) and c.group_size > 1]


def summarize(cols: list[Collective], *, in_loop: bool | None = None) -> dict:
    """{"count", "bytes", "by_kind": {kind: {"count", "bytes"}}}.

    in_loop=True: only collectives inside while bodies, each counted once (one loop iteration, e.g.
    one decoder layer of a scanned stack); False: only top-level ones; None: all of them, each
    counted trip_count times (one execution of the program)."""
    out = {"count": 0, "bytes": 0, "by_kind": defaultdict(lambda: {"count": 0, "bytes": 0})}
    for c in cols:
        if in_loop is not None and (c.loop_depth > 0) != in_loop:
            continue
        n = c.trip_count if in_loop is None else 1
        for d in (out, out["by_kind"][c.kind]):
            d["count"] += n
            d["bytes"] += n * c.bytes
    out["by_kind"] = dict(out["by_kind"])
    return out


def audit(fn, *args, **kwargs) -> list[Collective]:
    """Collectives of `jax.jit(fn)` compiled for these arguments (arrays or ShapeDtypeStructs)."""
    return collectives(jax.jit(fn).lower(*args, **kwargs).compile().as_text())
