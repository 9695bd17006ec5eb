"""Checks read from a compiled TPU program's scheduled HLO (`compiled.as_text()`): weight copies in the layer
loop, and the order of the hierarchical reduce-scatter's async collectives.

A scheduled module lists each computation's instructions in the order they run (`is_scheduled=true`), and on
TPU a collective is an async pair, `<kind>-start` then `<kind>-done`: text order is schedule order.
"""

from __future__ import annotations

import dataclasses
import math
import re

from qwen35_lib.parallel.hlo import called, layer_body

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[\w\-]+)\((?P<args>.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    op: str  # e.g. "fusion", "copy", "reduce-scatter-start"
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # the result's (dtype, dims), one per tuple element
    computation: str
    line: str


def instructions(hlo_text: str, computations: set[str] | None = None) -> list[Instr]:
    """The instructions of the module (or of `computations`), in text order = schedule order per computation."""
    out, comp = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:
            comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        m = _INSTR.match(line)
        if m and (computations is None or comp in computations):
            shape = m["shape"].split("{", 1)[0] if not m["shape"].startswith("(") else m["shape"]
            arrays = tuple((dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape))
            out.append(Instr(m["name"], m["op"], arrays, comp, line))
    return out


def loop_body(hlo_text: str) -> set[str]:
    """The layer scan's body and every computation it calls (see `parallel.hlo.layer_body`)."""
    body = layer_body(hlo_text)
    if body is None:
        raise ValueError("no layer loop with collectives in this program: compile at least 2 layer groups "
                         "(XLA unrolls a scan of length 1)")
    return called(hlo_text, body)


def expert_weight_copies(hlo_text: str, local_experts: int, hidden: int, ffn: int) -> list[Instr]:
    """Copies and fusions in the layer loop whose result is an expert-weight tensor: FP8 or bf16, with the
    local expert count, the hidden size and the expert FFN size (or 2x it: gate | up) among its dims (a layer
    slice [E, D, 2, F], [E, F, D], a dequantized or relaid-out copy, or a copy of the whole stack)."""
    def weight_like(dtype: str, dims: tuple[int, ...]) -> bool:
        if dtype not in ("f8e4m3fn", "bf16") or local_experts not in dims or hidden not in dims:
            return False
        rest = list(dims)
        rest.remove(local_experts)
        rest.remove(hidden)
        return ffn in rest or 2 * ffn in rest

    return [i for i in instructions(hlo_text, loop_body(hlo_text)) if i.op in ("copy", "fusion")
            and any(weight_like(dt, dims) for dt, dims in i.arrays)]


@dataclasses.dataclass(frozen=True)
class AsyncOp:
    kind: str  # the collective: "reduce-scatter", "all-reduce", ...
    start: int  # schedule position of its start in the computation (a synchronous op: its own position)
    done: int  # of its done
    group_size: int  # devices per replica group (hierarchical RS: 2 for the `core` phase, 4 for `chip`)
    name: str
    how: str  # "async" (<kind>-start/-done), "sparsecore" (call-start/-done of an offloaded collective), "sync"


def collective_schedule(hlo_text: str, computation: str, kinds: tuple[str, ...]) -> list[AsyncOp]:
    """The `kinds` collectives of one computation (e.g. the layer loop body) in schedule order of their starts:
    async pairs `<kind>-start`/`-done`, SparseCore-offloaded ones (`call-start` of a computation holding the
    collective, async_execution_thread="sparsecore", then `call-done`), and synchronous ops."""
    instrs = instructions(hlo_text, {computation})
    pos = {i.name: n for n, i in enumerate(instrs)}
    bodies = {}  # called computation -> its collective instruction
    for i in instructions(hlo_text):
        if i.op in kinds or i.op.removesuffix("-start") in kinds:
            bodies.setdefault(i.computation, i)

    def done_of(i: Instr, op: str) -> Instr:
        d = next((d for d in instrs if d.op == op and re.search(rf"\(%{re.escape(i.name)}[,)]", d.line)), None)
        if d is None:
            raise ValueError(f"{i.name} has no {op} in {computation}")
        return d

    ops = []
    for i in instrs:
        if i.op in kinds:
            ops.append(AsyncOp(i.op, pos[i.name], pos[i.name], group_size(i.line), i.name, "sync"))
        elif i.op.endswith("-start") and i.op.removesuffix("-start") in kinds:
            d = done_of(i, i.op.replace("-start", "-done"))
            ops.append(AsyncOp(i.op.removesuffix("-start"), pos[i.name], pos[d.name], group_size(i.line), i.name,
                               "async"))
        elif i.op == "call-start":
            m = re.search(r"to_apply=%([\w.\-]+)", i.line)
            inner = bodies.get(m[1]) if m else None
            if inner is not None:
                d = done_of(i, "call-done")
                ops.append(AsyncOp(inner.op.removesuffix("-start"), pos[i.name], pos[d.name], group_size(inner.line),
                                   i.name, "sparsecore"))
    return ops


def group_size(line: str) -> int:
    """Devices per replica group of a collective's HLO line ({{0,1},{2,3}} or the iota form [4,2]<=[8])."""
    m = _GROUPS.search(line)
    if m is None:
        raise ValueError(f"no replica_groups in {line[:120]}")
    g = m[1]
    if g.startswith("{{"):
        return len(g[2:].split("}")[0].split(","))
    return int(g[1:].split("]")[0].split(",")[-1])


def ancestors(hlo_text: str, computation: str, name: str) -> set[str]:
    """The instructions of `computation` that `name` uses, directly or through others (its data dependencies)."""
    instrs = instructions(hlo_text, {computation})
    uses = {i.name: set(re.findall(r"%([\w.\-]+)", i.line.split("=", 1)[1].split("(", 1)[1])) for i in instrs}
    seen, todo = set(), list(uses.get(name, ()))
    while todo:
        n = todo.pop()
        if n not in seen and n in uses:
            seen.add(n)
            todo += uses[n]
    return seen


def rs_chains(hlo_text: str, computation: str) -> list[tuple[AsyncOp, AsyncOp]]:
    """The hierarchical reduce-scatter's micro-batches in `computation`: (phase 1 over `core`, phase 2 over `chip`)
    pairs, each phase 2 paired with the latest phase 1 it depends on, in schedule order of their phase 1."""
    ops = collective_schedule(hlo_text, computation, ("reduce-scatter",))
    first = [o for o in ops if o.group_size == 2]
    chains = []
    for second in (o for o in ops if o.group_size == 4):
        deps = ancestors(hlo_text, computation, second.name)
        mine = [o for o in first if o.name in deps]
        if not mine:
            raise ValueError(f"phase-2 reduce-scatter {second.name} depends on no phase-1 reduce-scatter")
        chains.append((max(mine, key=lambda o: o.start), second))
    return sorted(chains, key=lambda c: c[0].start)


def overlapped(chains: list[tuple[AsyncOp, AsyncOp]], micro_batches: int) -> list[bool]:
    """Per MoE layer (`micro_batches` consecutive chains): does micro-batch i+1's phase 1 start before micro-batch
    i's phase 2 is done, for some i (the two phases of different micro-batches in flight together)?"""
    layers = [chains[j:j + micro_batches] for j in range(0, len(chains), micro_batches)]
    return [any(b[0].start < a[1].done for a, b in zip(layer, layer[1:])) for layer in layers]


@dataclasses.dataclass(frozen=True)
class PoolOf:
    """What one cache pool looks like on a device: its dtype (HLO name, e.g. "f8e4m3fn"), the dims of one page or
    slot (its trailing dims, e.g. (256, 1024) for a KV page) and the pages or slots one layer holds."""

    dtype: str
    row: tuple[int, ...]
    rows_per_layer: int

    def holds_a_layer(self, dtype: str, dims: tuple[int, ...]) -> bool:
        """An array of this pool's rows, at least one layer's worth of them."""
        n = len(self.row)
        return (dtype == self.dtype and len(dims) > n and dims[-n:] == self.row
                and math.prod(dims[:-n]) >= self.rows_per_layer)


# ops that write a new array of what they read: a copy of it in HBM if the array is a cache pool
_COPYING = ("copy", "copy-start", "slice", "dynamic-slice", "select", "concatenate", "reshape", "transpose")
# the roots of a fusion that updates its operand in place (the buffer is aliased: a scatter or an update of a slice)
_IN_PLACE_ROOTS = ("scatter", "dynamic-update-slice")


def cache_pool_copies(hlo_text: str, pools: dict[str, PoolOf]) -> list[tuple[str, Instr]]:
    """(pool name, instruction) for every instruction of the layer loop that copies at least one layer's rows of a
    cache pool in HBM: an op of `_COPYING`, or a fusion not rooted in an in-place update, whose result holds them.
    Excluded: memory-space assignment's prefetches into VMEM (a result in memory space S(1): a pool small enough
    to sit in the 64 MiB of VMEM, only at test sizes), kernels (custom calls: a Pallas kernel's output is aliased
    to the pool it writes), views (bitcasts, tuple plumbing). The old protocol (a layer's pool sliced out of the
    stacked cache and written back) shows here as dynamic-slice, select and copy fusions of a layer's pool."""
    comps = _fusion_roots(hlo_text)
    out = []
    for i in instructions(hlo_text, loop_body(hlo_text)):
        if i.op not in _COPYING and i.op != "fusion":
            continue
        if i.op == "fusion" and comps.get(_called(i.line)) in _IN_PLACE_ROOTS:
            continue
        texts = _array_texts(i.line.split("=", 1)[1].split(f" {i.op}(", 1)[0])
        if i.op == "copy-start" and any("S(1)" in t for t in texts):  # (to, from, context): into or out of VMEM
            continue
        for (dt, dims), text in zip(i.arrays, texts):
            if "S(1)" in text:
                continue
            name = next((n for n, p in pools.items() if p.holds_a_layer(dt, dims)), None)
            if name is not None:
                out.append((name, i))
                break
    return out


def _array_texts(shape: str) -> list[str]:
    """Each array of a result's shape text with its layout (`f32[2]{0:T(8)S(1)}`), in order."""
    return re.findall(r"\w+\[[\d,]*\](?:\{[^}]*\})?", shape)


def _called(line: str) -> str:
    m = re.search(r"calls=%?([\w.\-]+)", line)
    return m[1] if m else ""


def _fusion_roots(hlo_text: str) -> dict[str, str]:
    """{computation: the op of its ROOT instruction}."""
    roots, comp = {}, ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:
            comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        elif line.lstrip().startswith("ROOT "):
            m = _INSTR.match(line)
            if m:
                roots[comp] = m["op"]
    return roots
