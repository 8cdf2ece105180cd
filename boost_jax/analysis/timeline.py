"""Where a traced train step's time goes: the JAX profiler's Chrome trace, read op by op.

`classify(hlo_text)` puts each instruction of a compiled train step in a category, from its op kind
and its JAX name (`metadata={op_name=...}`, the name stack of the traced function):
  collectives  all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute (+ async halves)
  optimizer    ops outside the gradient (no `jvp(` / `transpose(` in the name): the update, the
               gradient norm and clipping, the metrics
  attention    ops under the model's `attention` name scope: scores, mask, softmax, their matmuls
  loss         gradient ops outside the layer scan (no `while` in the name): embedding, final norm,
               LM head and cross-entropy, forward and backward
  gemm         the layers' other dots / convolutions (alone, fused, or a matmul custom call)
  copies       data movement only: copy, transpose, (dynamic-)slice / update-slice, concatenate, ...
  elementwise  every other fusion or op (norms, activations, reductions, loop bookkeeping)
  other        loops and conditionals (never timed: their events enclose their body's) and ops the
               module does not have (none expected)
The rules read the layer scan as the only loop of the gradient, so pipelines and micro-batch
accumulation (which add loops around the layers) are refused by the caller.

`gemm_layout` tells a dot's layout: `forward`, `input_grad` (g @ W.T) or `weight_grad` (x.T @ g,
einsum('bsd,bsr->dr')). `op_bytes(hlo_text)` counts the bytes each executed instruction reads and
writes, the memory side of `bench profile`'s roofline.

`op_seconds(events, module)` splits each device's traced time among the ops running on it: where
ops overlap (the CPU runtime runs independent thunks on several threads) each gets an equal share,
so a device's ops add up to its busy time. A time when no op's event is open goes to the ops
launched before it whose results came after it (the runtime's `end: <op>` events): the CPU
runtime's asynchronous matmuls, which would otherwise read as gaps.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from boost_jax.analysis.hlo import KINDS, arrays, attr, loop_contexts, nbytes, op_name, parse_module
from boost_jax.analysis.work import ATTENTION_SCOPE, SLICES, Gemm, operand_bytes

CATEGORIES = ("gemm", "attention", "elementwise", "loss", "optimizer", "collectives", "copies", "other")
_COLLECTIVES = {f"{k}{s}" for k in KINDS for s in ("", "-start", "-done")}
# Their events enclose their body's ops (a CPU `call` runs inline, as one op of its own).
_CONTAINERS = {"while", "conditional"}
_GEMMS = {"dot", "convolution"}
_MOVES = {"copy", "copy-start", "copy-done", "transpose", "bitcast", "reshape", "broadcast", "slice",
          "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "parameter", "constant", "tuple",
          "get-tuple-element"}
_MATMUL_TARGET = re.compile(r"gemm|matmul|cublas", re.I)
_ATTENTION_TARGET = re.compile(r"fmha|flash|attention", re.I)  # cuDNN's fused attention on GPU
_SCALAR = re.compile(r"^[a-z]\w*\[\]")
LAYOUTS = ("forward", "input_grad", "weight_grad")
# Bookkeeping that moves no data, loops (their body's ops are counted) and the second halves of
# asynchronous pairs (their first half is).
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "domain", "copy-done", *_CONTAINERS, *(f"{k}-done" for k in KINDS)}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> its update operand; operand 0 is updated in place


@dataclass(frozen=True)
class Op:
    opcode: str
    category: str
    op_name: str  # the JAX name ("" when XLA made the instruction up)


def module_name(hlo_text: str) -> str:
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    if not m:
        raise ValueError("no HloModule header in the HLO text")
    return m.group(1)


def classify(hlo_text: str) -> dict[str, Op]:
    """Each instruction's category, by name (instruction names are unique in a module)."""
    comps, _, _ = parse_module(hlo_text)

    def body_ops(comp_name: str) -> set[str]:
        """The op kinds on arrays inside a fused computation, nested fusions included (scalar index
        arithmetic of a dynamic slice is no work of its own)."""
        ops = set()
        for ins in comps[comp_name].instrs.values():
            if not _SCALAR.match(ins.shape):
                ops.add(ins.op)
            if (inner := attr(ins.attrs, "calls")) and inner in comps:
                ops |= body_ops(inner)
        return ops

    out = {}
    for comp in comps.values():
        for ins in comp.instrs.values():
            name = op_name(ins.attrs)
            target = m.group(1) if (m := re.search(r'custom_call_target="([^"]*)"', ins.attrs)) else ""
            kinds = body_ops(callee) if ins.op == "fusion" and (callee := attr(ins.attrs, "calls")) else {ins.op}
            out[ins.name] = Op(ins.op, _category(ins.op, kinds, name, target), name)
    return out


def gemm_layout(op_name: str, g: Gemm, tokens: int) -> str:
    """A dot's layout (`op_name`: its JAX name; `tokens`: the rows a layer sees per device). The
    backward pass's ops are named `transpose(...)`, less the forward it recomputes
    (`rematted_computation`). Of those, a weight gradient contracts the tokens and keeps none: its
    output is a weight's [d_in, d_out]. The operands' dims cannot tell, as XLA transposes either
    operand beforehand. A weight dim equal to `tokens` reads as an input gradient."""
    if "transpose(" not in op_name or "rematted_computation" in op_name:
        return "forward"
    return "weight_grad" if g.k == tokens and tokens not in (g.m, g.n) else "input_grad"


def op_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes each executed instruction reads plus writes per run of the module (times its loops'
    trips), at the compiled dtypes: an operand used only through slices counts the slices, an
    in-place update (dynamic-update-slice, scatter) the update it reads and writes."""
    comps, entry, _ = parse_module(hlo_text)
    ctx = loop_contexts(comps, entry)
    bodies = {attr(ins.attrs, "calls") for c in comps.values() for ins in c.instrs.values() if ins.op == "fusion"}
    return {ins.name: ctx[c.name][1] * _moved(comps, c, ins)
            for c in comps.values() if c.name in ctx and c.name not in bodies
            for ins in c.instrs.values() if ins.op not in _NO_BYTES}


def _value_bytes(ins) -> int:
    return sum(nbytes(dt, dims) for dt, dims in arrays(ins.shape))


def _moved(comps, comp, ins) -> int:
    if ins.op in SLICES:
        return 2 * _value_bytes(ins)
    body = comps.get(attr(ins.attrs, "calls") or "") if ins.op == "fusion" else None
    operands = [i for i, o in enumerate(ins.operands) if o in comp.instrs]
    update = next((i for i in (body.instrs.values() if body else [ins]) if i.op in _IN_PLACE), None)
    if update is None:
        return _value_bytes(ins) + sum(operand_bytes(comp, ins, body, i, _value_bytes) for i in operands)
    # In place: writes the update, reads every operand but the buffer it updates.
    written = _value_bytes((body or comp).instrs[update.operands[_IN_PLACE[update.op]]])
    buffer = update.operands[0]
    reads = [i for i in operands if buffer not in (ins.operands[i], _parameter(body, i))]
    return written + sum(operand_bytes(comp, ins, body, i, _value_bytes) for i in reads)


def _parameter(body, index: int) -> str | None:
    """The name of a fusion body's parameter `index` (None outside a fusion)."""
    if body is None:
        return None
    return next((p.name for p in body.instrs.values() if p.op == "parameter" and p.arg == str(index)), None)


def _category(op: str, kinds: set[str], name: str, target: str) -> str:
    if op in _COLLECTIVES:
        return "collectives"
    if op in _CONTAINERS:
        return "other"
    if name and "jvp(" not in name and "transpose(" not in name:
        return "optimizer"
    if ATTENTION_SCOPE.search(name) or (op == "custom-call" and _ATTENTION_TARGET.search(target)):
        return "attention"
    if name and "while" not in name:
        return "loss"
    if kinds & _GEMMS or (op == "custom-call" and _MATMUL_TARGET.search(target)):
        return "gemm"
    if kinds <= _MOVES:
        return "copies"
    return "elementwise"


def read_trace(trace_dir: Path) -> tuple[Path, list[dict]]:
    """The Chrome trace `jax.profiler.trace` wrote under `trace_dir` (the newest run) and its events."""
    paths = sorted(Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        return paths[-1], json.load(f)["traceEvents"]


@dataclass
class DeviceTime:
    """One device's traced ops: seconds per instruction, and how its steps were laid out in time."""

    ops: dict[str, float]  # instruction name -> seconds it held the device (shared where ops overlap)
    busy_s: float  # time with at least one op running
    span_s: float  # first op start to last op end, all steps


def op_seconds(events: list[dict], module: str, ops: dict[str, Op]) -> dict[str, DeviceTime]:
    """Per device (its ordinal, or the trace's process on a GPU), the time of each op of `module`
    (`ops`: its `classify`). A loop or conditional is no op of its own: its event encloses its
    body's, and the time between those is the runtime's, a gap. An op the CPU runtime runs
    asynchronously (its Eigen matmuls) returns before its work is done: its event covers the launch,
    and the runtime's `end: <op>` event comes when its result is ready."""
    containers = {name for name, op in ops.items() if op.opcode in _CONTAINERS}
    runs: dict[str, list[tuple[float, float, str]]] = defaultdict(list)  # op -> (start, stop, device)
    ends: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if a.get("hlo_module") == module and "hlo_op" in a and a["hlo_op"] not in containers:
            dev = str(a.get("device_ordinal", e.get("pid")))
            runs[a["hlo_op"]].append((e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6, dev))
        elif e.get("name", "").startswith("end: "):
            ends[e["name"][len("end: "):]].append(e["ts"] * 1e-6)
    per_dev: dict[str, list[Interval]] = defaultdict(list)
    for op, op_runs in runs.items():
        done = iter(sorted(ends.get(op, ())))
        end = next(done, None)
        for start, stop, dev in sorted(op_runs):
            # End events carry no device: each run takes the first end at or after its start.
            while end is not None and end < start:
                end = next(done, None)
            per_dev[dev].append(Interval(start, stop, op, stop if end is None else max(stop, end)))
            end = next(done, None)
    return {dev: _sweep(iv) for dev, iv in per_dev.items()}


@dataclass(frozen=True)
class Interval:
    start: float
    stop: float  # the end of the op's event
    op: str
    done: float  # its `end:` event: later than `stop` when the op ran on after its launch returned


def _sweep(intervals: list[Interval]) -> DeviceTime:
    """One device's op intervals -> each op's time: overlaps shared equally; a time when no op's
    event is open goes to the ops launched before it whose results came after it (asynchronous work,
    shared equally), else it is a gap. (An `end:` event can also come late for an op that finished
    early, so it only ever fills time no other op claims.)"""
    edges = sorted({t for iv in intervals for t in (iv.start, iv.stop, iv.done)})
    starts, stops = defaultdict(list), defaultdict(list)
    for i, iv in enumerate(intervals):
        starts[iv.start].append(i)
        stops[iv.stop].append(i)
    ops: dict[str, float] = defaultdict(float)
    active: set[int] = set()
    waiting: set[int] = set()  # launched and returned, result not yet reported
    busy = 0.0
    for t0, t1 in zip(edges, edges[1:]):
        waiting = {i for i in waiting if intervals[i].done > t0} | {
            i for i in stops[t0] if intervals[i].done > t0}
        active = {i for i in active if intervals[i].stop > t0} | set(starts[t0])
        share = active or waiting
        if not share:
            continue
        for i in share:
            ops[intervals[i].op] += (t1 - t0) / len(share)
        busy += t1 - t0
    span = max(iv.done for iv in intervals) - min(iv.start for iv in intervals)
    return DeviceTime(dict(ops), busy, span)
