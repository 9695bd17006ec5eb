"""Collectives read from a compiled program's HLO text: which, how many, how many bytes, in which computation.

XLA names every collective op in the optimized HLO (`all-gather`, `reduce-scatter`, `all-to-all`,
`all-reduce`, `collective-permute`, and their async `-start` halves on TPU). The layer scan's body is a
computation of its own, so counting inside it gives the collectives of one layer group.

`count` counts each op of the text once, with its result bytes. `step_counts` counts what one run of the program
executes per device: every op once per run of the computation holding it (a loop body times its trip count), in
bytes by the convention of its kind (`MOVED`), the convention `costmodel.traffic` states its formulas in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute", "ragged-all-to-all")
# kind -> the bytes `step_counts` counts per device for one op
MOVED = {"all-gather": "output bytes (the gathered result)",
         "reduce-scatter": "input bytes (result bytes x the devices of its group)",
         "all-reduce": "operand bytes (= result bytes)",
         "all-to-all": "operand bytes (= result bytes: every buffer sent, its own share included)",
         "collective-permute": "operand bytes (= result bytes)",
         "ragged-all-to-all": "output buffer bytes"}
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(KINDS) +
                 r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(?:(?P<list>\{\{[\d,]*\}[^ ]*\})|\[(?P<iota>[\d,]+)\]<=|"
                     r"mesh\[(?P<mesh>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}|(?P<empty>\{\}))")
# `%x = f32[2]{0} add(%a, %b), ...`: (ROOT, x, f32[2]{0}, add, %a, %b)
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*?)\)(?:, |$)")
_VAR = re.compile(r"%([\w.\-]+)")
_FUSION_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_COND = re.compile(r"condition=%?([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_ENTRY = re.compile(r"^ENTRY %?([\w.\-]+)", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # e.g. "all-gather"
    computation: str  # the HLO computation it sits in
    bytes: int  # of its result (for an async start: of the value it produces)
    shape: str
    group: int = 0  # devices in each of its replica groups (0: not read)

    @property
    def moved(self) -> int:
        """Bytes per device by the convention of its kind (`MOVED`)."""
        return self.bytes * self.group if self.kind == "reduce-scatter" else self.bytes


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of an optimized HLO module, in text order (async pairs counted once, at the start)."""
    out, comp = [], ""
    devices = _partitions(hlo_text)
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:  # a computation header: `%name (...) -> ... {`
            comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        m = _OP.match(line)
        if m and "-done" not in line.split("=")[1].split("(")[0]:
            shapes = _SHAPE.findall(m["shape"])
            # an async start returns (operands..., results..., scalar contexts...): count the results, the second
            # half once the scalars (a collective-permute-start's u32[] contexts) are set aside; a plain op may
            # return a tuple (XLA:CPU's all-to-all: one buffer per peer): count them all
            size = lambda dtype, dims: int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES.get(dtype, 4)
            if m["start"]:
                arrays = [sh for sh in shapes if sh[1]] or shapes[-1:]
                nbytes = sum(size(*sh) for sh in arrays[len(arrays) // 2:])
            else:
                nbytes = sum(size(*sh) for sh in shapes)
            out.append(Collective(m["kind"], comp, nbytes, m["shape"], group_size(line, devices)))
    return out


_PARTITIONS = re.compile(r"num_partitions=(\d+)")


def _partitions(hlo_text: str) -> int:
    m = _PARTITIONS.search(hlo_text[:4000])
    return int(m[1]) if m else 1


def group_size(line: str, devices: int) -> int:
    """Devices in each replica group of a collective's HLO line (`{{0,1},{2,3}}`, the iota form `[4,2]<=[8]`, the
    mesh form `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}`; none or `{}`: all `devices`)."""
    m = _GROUPS.search(line)
    if m is None or m["empty"]:
        return devices
    if m["list"]:
        return len(m["list"][2:].split("}")[0].split(","))
    if m["iota"]:
        return int(m["iota"].split(",")[-1])
    sizes = dict((k.strip("'"), int(v)) for k, v in (a.split("=") for a in m["mesh"].split(",")))
    return int(np.prod([sizes[a.strip().strip("'")] for a in m["axes"].split(",") if a.strip()]))


def layer_body(hlo_text: str) -> str | None:
    """The name of the layer scan's loop body: of the `while` bodies, the one whose computations (it and those
    it calls) hold the most collectives. None when there is no loop with collectives (XLA unrolls a scan of
    length 1: give the model two layer groups)."""
    bodies = set(_BODY.findall(hlo_text))
    ops = collectives(hlo_text)
    reach = {b: called(hlo_text, b) for b in bodies}
    counts = {b: sum(c.computation in reach[b] for c in ops) for b in bodies}
    return max(counts, key=counts.get) if counts and max(counts.values()) else None


def count(hlo_text: str, computation: str | None = None, moved: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "bytes": b}} over the module, or one computation and the ones it calls; b sums each
    op's result bytes, or with `moved` its bytes by the convention of its kind (`MOVED`)."""
    names = called(hlo_text, computation) if computation else None
    out: dict[str, dict[str, int]] = {}
    for c in collectives(hlo_text):
        if names is None or c.computation in names:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += c.moved if moved else c.bytes
    return out


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            bodies[name] = []
        elif name:
            bodies[name].append(line)
    return bodies


_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                    r"\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)")


def called(hlo_text: str, root: str) -> set[str]:
    """`root` and every computation reachable from it (fusions, conditionals, nested loops)."""
    graph = _call_graph(hlo_text)
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in seen or n not in graph:
            continue
        seen.add(n)
        todo += graph[n]
    return seen


@functools.lru_cache(maxsize=4)  # the text of one program is read many times in a row (`layer_body`, `count`)
def _call_graph(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: the computations its instructions call}."""
    return {n: [t for item in _CALLS.findall("\n".join(lines)) for t in item.replace("%", "").split(", ")]
            for n, lines in _computations(hlo_text).items()}


_INT = re.compile(r"-?\d+")
_INDEX = re.compile(r"index=(\d+)")
_INIT = re.compile(r"while\(%([\w.\-]+)\)")


def _counted_loop(comps: dict[str, list[str]], where: str, line: str, cond: str, body: str,
                  memo: dict | None = None) -> list[str] | None:
    """[_, trips] of a `while` without XLA's known_trip_count (TPU's scheduled text leaves it out) when it is a
    counted loop: an s32 tuple element k starts at constant 0, the body adds constant 1 to it, and the condition is
    `k < constant N` (copies and bitcasts looked through); else None. `memo`: {computation: its definitions}, kept
    between the loops of one text."""
    memo = {} if memo is None else memo

    def defs(comp: str) -> dict[str, tuple[str, str, str]]:  # {name: (op, operands, line)}
        if comp not in memo:
            memo[comp] = {}
            for ln in comps.get(comp, ()):
                m = _INSTR.match(ln)
                if m:
                    memo[comp][m[2]] = (m[4], m[5], ln)
        return memo[comp]

    def resolve(d: dict, name: str) -> tuple[str, str, str] | None:
        while name in d and d[name][0] in ("copy", "bitcast"):
            name = d[name][1].split(",")[0].strip().lstrip("%")
        return d.get(name)

    def constant(d: dict, name: str) -> int | None:
        r = resolve(d, name.strip().lstrip("%"))
        return int(r[1]) if r and r[0] == "constant" and _INT.fullmatch(r[1]) else None

    def element(d: dict, name: str) -> int | None:  # the tuple index a get-tuple-element of the parameter reads
        r = resolve(d, name.strip().lstrip("%"))
        m = _INDEX.search(r[2]) if r and r[0] == "get-tuple-element" else None
        return int(m[1]) if m else None

    c, b, w = defs(cond), defs(body), defs(where)
    root = next((ln for ln in comps.get(cond, ()) if ln.lstrip().startswith("ROOT")), "")
    m = _INSTR.match(root)
    if not m or m[4] != "compare" or "direction=LT" not in root:
        return None
    lhs, rhs = m[5].split(",")[:2]
    k, n = element(c, lhs), constant(c, rhs)
    init = _INIT.search(line)
    tup = resolve(w, init[1]) if init else None
    broot = next((ln for ln in comps.get(body, ()) if ln.lstrip().startswith("ROOT")), "")
    bm = _INSTR.match(broot)
    if k is None or n is None or tup is None or tup[0] != "tuple" or not bm or bm[4] != "tuple":
        return None
    start = constant(w, tup[1].split(",")[k])
    step = resolve(b, bm[5].split(",")[k].strip().lstrip("%"))
    if start != 0 or step is None or step[0] != "add":
        return None
    x, y = step[1].split(",")[:2]
    if not ({element(b, x), element(b, y)} >= {k} and 1 in (constant(b, x), constant(b, y))):
        return None
    return [line, str(n)]


def step_counts(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "bytes": b}}: the collectives one run of the module executes on each device, in bytes
    by the convention of each kind (`MOVED`).

    1. from the entry computation down, each computation is run a number of times: a `while` body its known trip
       count times per run of the loop (XLA's `known_trip_count`), its condition once more; a fusion, call or
       reducer once per use;
    2. each collective op counts once per run of its computation.
    A collective whose number of runs the text does not fix (inside a `conditional`, or a loop without a known
    trip count) is refused with a ValueError naming it: the count would depend on the data.
    """
    comps = _computations(hlo_text)
    ops: dict[str, list[Collective]] = {}
    for c in collectives(hlo_text):
        ops.setdefault(c.computation, []).append(c)
    holds: dict[str, bool] = {}  # computation -> whether it, or one it calls, holds a collective

    def has(name: str) -> bool:
        if name not in holds:
            holds[name] = False  # the call graph is acyclic; this only stops a malformed text
            holds[name] = bool(ops.get(name)) or any(
                has(t) for line in comps.get(name, ()) for item in _CALLS.findall(line)
                for t in item.replace("%", "").split(", "))
        return holds[name]

    runs: dict[str, int] = {}
    loop_defs: dict[str, dict] = {}  # `_counted_loop`'s memo

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, ()):
            targets = [t for item in _CALLS.findall(line) for t in item.replace("%", "").split(", ")]
            if not targets:
                continue
            if " while(" in line:
                body = _BODY.search(line)[1]
                cond = _COND.search(line)[1]
                trips = _KNOWN_TRIPS.search(line) or _counted_loop(comps, name, line, cond, body, loop_defs)
                if trips is None:
                    if has(body) or has(cond):
                        raise ValueError(f"collectives inside the loop {body!r}, whose trip count XLA does not know: "
                                         "their count depends on the data; move them out of the loop")
                    continue
                visit(body, times * int(trips[1]))
                visit(cond, times * (int(trips[1]) + 1))
            elif " conditional(" in line:
                if any(has(t) for t in targets):
                    raise ValueError(f"collectives inside a branch of a conditional ({', '.join(targets)}): their "
                                     "count depends on the data; move them out of the conditional")
            else:
                for t in targets:
                    visit(t, times)

    visit(_ENTRY.search(hlo_text)[1], 1)
    out: dict[str, dict[str, int]] = {}
    for name, times in runs.items():
        for c in ops.get(name, ()):
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += times
            d["bytes"] += times * c.moved
    return out


# ops that move no HBM bytes of their own (views, control, tuples) or whose work is counted inside what they call
_NO_BYTES = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call", "conditional",
             "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
_PARAM = re.compile(r"parameter\((\d+)\)")
_NAMED = re.compile(r"([\w.\-]+): ((?:\w+\[[\d,]*\][^,)]*)|\([^)]*\))")
BLOCKS = ("attention", "gdn", "moe", "embed", "lm_head", "sample", "other")


# `f32[8,128]{1,0:T(8,128)S(1)}`: (dtype, dims, memory space): an array of a layout without `S(n)` lives in HBM, one
# with S(1) in VMEM (XLA:TPU's memory-space assignment puts it there, prefetched and evicted by copy-start/-done
# pairs), S(2) in SMEM (the scaling book's "How to read an XLA op")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](?:\{[^}]*?(?:S\((\d+)\))?\})?")


def _shape_bytes(text: str) -> int:
    """The HBM bytes of the arrays in `text` (a shape, or a computation's parameters): those in another memory space
    (VMEM, SMEM) move no HBM bytes when read or written."""
    return sum(_BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims, space in _ARRAY.findall(text) if space in ("", "0"))


def _block(line: str) -> str:
    """The model block an op belongs to, from its op_name (the jax name stack: `closed_call/moe/...`)."""
    name = _OP_NAME.search(line)
    name = name[1] if name else ""
    for block in ("attention", "gdn", "moe"):
        if f"/{block}/" in name:
            return block
    if "lm_head" in name:
        return "lm_head"
    if "cond/" in name or "sample" in name:
        return "sample"
    if name.endswith("model/gather"):
        return "embed"
    return "other"


@dataclasses.dataclass(frozen=True)
class OpBytes:
    """One top-level op of a compiled program and the HBM bytes its runs move (`op_rows`)."""

    bytes: int  # read + written, times its runs
    runs: int  # how often it runs in one run of the program
    block: str  # `BLOCKS`, from its jax name
    op: str  # e.g. "fusion", "copy", "custom-call"
    name: str  # its HLO name
    shape: str  # its result
    jax_name: str  # its op_name metadata
    computation: str = ""  # the computation it sits in


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*?)\) -> ")
_CALL_TARGETS = re.compile(r"(?:to_apply|branch_computations|true_computation|false_computation)="
                           r"\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)")


@dataclasses.dataclass
class _Program:
    """What `op_rows` reads of one text, whatever its `trips`."""

    comps: dict[str, list[str]]  # `_computations`
    headers: dict[str, str]  # computation -> its parameters, `p: f32[2]{0}, q: s32[]`
    fused: set[str]  # computations called by fusions
    access: dict[str, tuple[list[int | None], int] | None]  # fused computation -> `_fused_access`
    defs: dict[str, dict]  # `_counted_loop`'s memo
    instrs: dict[str, tuple | None]  # line -> `_top_level_instr`, as `op_rows` reads them


@functools.lru_cache(maxsize=2)  # `costmodel.compiled.text_side` reads each text twice (its loops, then their trips)
def _program(hlo_text: str) -> _Program:
    comps = _computations(hlo_text)
    headers = {m[1]: m[2] for line in hlo_text.split("\n") if (m := _HEADER.match(line))}
    fused = {t for lines in comps.values() for ln in lines if " fusion(" in ln for t in _FUSION_CALLS.findall(ln)}
    access: dict = {}  # filled with nested fusions on the way
    for n in fused & comps.keys():
        if n not in access:
            access[n] = _fused_access(comps[n], headers.get(n, ""), comps, headers, access)
    return _Program(comps, headers, fused, access, {}, {})


def _top_level_instr(line: str) -> tuple | None:
    """(name, shape, op, shape bytes, operands, fusion's computation, block, jax name) of an instruction line."""
    m = _INSTR.match(line)
    if not m:
        return None
    _, var, shape, op, args = m.groups()
    jax_name = _OP_NAME.search(line)
    return (var, shape, op, _shape_bytes(shape), _VAR.findall(args),
            _FUSION_CALLS.search(line)[1] if op == "fusion" else None, _block(line), jax_name[1] if jax_name else "")


def op_rows(hlo_text: str, trips: dict[str, int] | None = None) -> tuple[list[OpBytes], list[str]]:
    """The HBM bytes one run of the program moves per device, op by op, as the text states them, costliest first,
    and the loop bodies counted once (their trip count unknown). Every top-level op (of the entry, loop bodies and
    called computations, not inside a fusion) reads its operands and writes its result (an async pair once: the
    start's operands, the done's result), times the runs of its computation (a `while` body its known trip count,
    `trips[body]` when given, else once; a `conditional` its costliest branch, since one runs). A fusion that only
    slices an operand reads the slices, and one that updates a buffer in place (a root `dynamic-update-slice` or
    `scatter`) writes the update (`_fused_access`); a gather XLA:TPU offloads to the SparseCore (an async call,
    OFFLOAD_GATHER) reads the rows it gathers, not its whole table. Only HBM counts: an array XLA:TPU placed in VMEM
    or SMEM (a layout with S(1) or S(2)) moves no bytes, so a prefetch into VMEM reads HBM once and the ops reading it
    there nothing.

    This, not XLA:TPU's `cost_analysis()["bytes accessed"]`, is the compile's count to compare a model with: that
    counts a `while` body once, and a reduction's input and a dot's right operand five times
    (`aot.validate.xla_bytes_accessed_factors`, measured on single-op programs)."""
    prog = _program(hlo_text)
    comps, headers, fused, access = prog.comps, prog.headers, prog.fused, prog.access
    once: list[str] = []

    def visit(name: str, times: int, runs: dict[str, int]) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, ()):
            if " while(" in line:
                body = _BODY.search(line)[1]
                known = _KNOWN_TRIPS.search(line) or _counted_loop(comps, name, line, _COND.search(line)[1], body,
                                                                 prog.defs)
                n = int(known[1]) if known else (trips or {}).get(body)
                if n is None and body not in once:
                    once.append(body)
                visit(body, times * (n or 1), runs)
            elif " call(" in line or " conditional(" in line:
                targets = [t for item in _CALL_TARGETS.findall(line) for t in item.replace("%", "").split(", ")
                           if t not in fused]
                if " conditional(" in line and len(targets) > 1:  # one branch runs: the costliest
                    def total(t: str) -> int:
                        r: dict[str, int] = {}
                        visit(t, 1, r)
                        return sum(row.bytes for row in rows_of(r))
                    targets = [max(targets, key=total)]
                for t in targets:
                    visit(t, times, runs)

    def rows_of(runs: dict[str, int]) -> list[OpBytes]:
        out = []
        for name, times in runs.items():
            sizes = {p: _shape_bytes(s) for p, s in _NAMED.findall(headers.get(name, ""))}
            for line in comps.get(name, ()):
                if line not in prog.instrs:
                    prog.instrs[line] = _top_level_instr(line)
                if prog.instrs[line] is None:
                    continue
                var, shape, op, nbytes, operands, callee, block, jax_name = prog.instrs[line]
                sizes[var] = 0 if op.endswith("-start") else nbytes
                if op in _NO_BYTES:
                    continue
                write = sizes[var]
                if op.endswith("-done"):
                    read = 0
                elif op == "call-start" and _OFFLOAD_GATHER in line:  # reads the rows it gathers, not its table
                    table = sizes.get(operands[0], 0) if operands else 0  # 0: in VMEM, its rows read there
                    read = (_gathered_bytes(shape) if table else 0) + sum(sizes.get(a, 0) for a in operands[1:])
                elif op == "fusion" and (acc := access.get(callee)):
                    reads, write = acc
                    read = sum(sizes.get(a, 0) if r is None else r for a, r in zip(operands, reads))
                else:
                    read = sum(sizes.get(a, 0) for a in operands)
                out.append(OpBytes(times * (read + write), times, block, op, var, shape, jax_name, name))
        return out

    runs: dict[str, int] = {}
    visit(_ENTRY.search(hlo_text)[1], 1, runs)
    return sorted(rows_of(runs), key=lambda r: -r.bytes), once


_OFFLOAD_GATHER = '"offload":"OFFLOAD_GATHER"'  # an async call XLA:TPU runs on the SparseCore as a gather


def _gathered_bytes(shape: str) -> int:
    """The bytes of the rows an offloaded gather's start gathers: its result, the first array after its operands'
    tuple (`((bf16[8704,4096]{..}, s32[87040]{..}, token[]), bf16[87040,4096]{..})` -> the [87040, 4096] rows),
    wherever it is placed (each row is read from the table)."""
    depth = 0
    for i, ch in enumerate(shape):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 1 and ch == ")":  # the operands' tuple closed
            m = _ARRAY.search(shape, i + 1)
            return _BYTES.get(m[1], 0) * math.prod(int(d) for d in m[2].split(",") if d) if m else 0
    return 0


def op_bytes(hlo_text: str, trips: dict[str, int] | None = None) -> dict[str, object]:
    """`op_rows` summed by block: {"bytes": {block: bytes}, "loops_counted_once": [body names]}. Blocks follow the
    op's jax name (`BLOCKS`; a fusion XLA left unnamed falls in "other")."""
    rows, once = op_rows(hlo_text, trips)
    out = dict.fromkeys(BLOCKS, 0)
    for r in rows:
        out[r.block] += r.bytes
    return {"bytes": out, "loops_counted_once": once}


def _fused_access(lines: list[str], header: str, comps: dict | None = None, headers: dict | None = None,
                  memo: dict | None = None) -> tuple[list[int | None], int] | None:
    """How much of each operand a fusion reads, and what it writes, when that is less than whole: a parameter used
    only through slices (`slice`, `dynamic-slice`, `gather`) reads what they take; the buffer a root
    `dynamic-update-slice` or `scatter` updates in place is not read, and only the update is written. A parameter
    is followed through views of it: `bitcast`s and the nested in-place relayouts XLA:TPU wraps around a sliced or
    updated stacked array (a one-operand fusion with `output_to_operand_aliasing`); a nested fusion that slices
    its first operand (`comps`, `headers`: the program's computations) is a slice of it. ([bytes read per operand,
    None: whole], bytes written), or None when the fusion reads and writes whole arrays. `memo`: {computation:
    its answer}, filled with the nested fusions'."""
    memo = {} if memo is None else memo
    params = [p for p, _ in _NAMED.findall(header)]
    defs, users = {}, {}
    for ln in lines:
        m = _INSTR.match(ln)
        if not m:
            continue
        root, var, shape, op, args = m.groups()
        ops_ = _VAR.findall(args)
        view = op == "bitcast" or (op == "fusion" and len(ops_) == 1 and "output_to_operand_aliasing" in ln)
        inner_reads = None  # a nested fusion: the bytes it reads of each operand it only slices
        if op == "fusion" and not view and comps is not None:
            inner = _FUSION_CALLS.search(ln)[1]
            if inner not in memo:
                memo[inner] = _fused_access(comps.get(inner, []), (headers or {}).get(inner, ""), comps, headers, memo)
            acc = memo[inner]
            inner_reads = acc[0] if acc else None
        defs[var] = (op, shape, ops_, bool(root), view, inner_reads)
        for i, a in enumerate(ops_):
            users.setdefault(a, []).append((var, i))
    pnames = {}
    for var, d in defs.items():
        if d[0] == "parameter":
            idx = _PARAM.search(next(ln for ln in lines if f"%{var} =" in ln))
            pnames[int(idx[1])] = var
    root = next(((v, d) for v, d in defs.items() if d[3]), None)
    if root is None:
        return None

    def uses(var: str) -> list[tuple[str, int]]:  # (user, operand index), through views of `var`
        out = []
        for u, j in users.get(var, []):
            out += uses(u) if defs[u][4] else [(u, j)]
        return out

    in_place = write = None
    if root[1][0] in ("dynamic-update-slice", "scatter"):  # operands: buffer, (indices,) update
        buf, upd = root[1][2][0], root[1][2][1 if root[1][0] == "dynamic-update-slice" else -1]
        while buf in defs and defs[buf][4]:
            buf = defs[buf][2][0]
        if defs.get(buf, ("",))[0] == "parameter":
            in_place = buf
            write = _shape_bytes(defs[upd][1]) if upd in defs else None
    reads: list[int | None] = []
    changed = write is not None
    for i in range(len(params) or len(pnames)):
        p = pnames.get(i)
        us = uses(p) if p else []
        sliced = {(u, j): _shape_bytes(defs[u][1]) if defs[u][0] in ("slice", "dynamic-slice", "gather") and j == 0
                  else defs[u][5][j] for u, j in us
                  if (defs[u][0] in ("slice", "dynamic-slice", "gather") and j == 0) or
                  (defs[u][5] is not None and j < len(defs[u][5]) and defs[u][5][j] is not None)}
        updated = p is not None and p == in_place and all(u == root[0] and j == 0 for u, j in us
                                                          if (u, j) not in sliced)
        if us and (updated or len(sliced) == len(us)):
            reads.append(sum(sliced.values()))
            changed = True
        else:
            reads.append(None)
    if not changed:
        return None
    return reads, write if write is not None else _shape_bytes(root[1][1])
