"""The HBM bytes a compiled program's HLO text states, op by op (`op_rows`) and by model block (`op_bytes`): what a
cost model's bytes are compared with."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from qwen35_lib.parallel.hlo.text import (
    BODY,
    BYTES,
    COND,
    ENTRY,
    FUSION_CALLS,
    INSTR,
    KNOWN_TRIPS,
    OP_NAME,
    VAR,
    computations,
    counted_loop,
)

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
    return sum(BYTES.get(dt, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims, space in _ARRAY.findall(text) if space in ("", "0"))


def block(line: str) -> str:
    """The model block an op belongs to, from its op_name (the jax name stack: `closed_call/moe/...`)."""
    name = OP_NAME.search(line)
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

    comps: dict[str, list[str]]  # `computations`
    headers: dict[str, str]  # computation -> its parameters, `p: f32[2]{0}, q: s32[]`
    fused: set[str]  # computations called by fusions
    access: dict[str, tuple[list[int | None], int] | None]  # fused computation -> `_fused_access`
    defs: dict[str, dict]  # `counted_loop`'s memo
    instrs: dict[str, tuple | None]  # line -> `_top_level_instr`, as `op_rows` reads them


@functools.lru_cache(maxsize=2)  # `costmodel.compiled.text_side` reads each text twice (its loops, then their trips)
def _program(hlo_text: str) -> _Program:
    comps = computations(hlo_text)
    headers = {m[1]: m[2] for line in hlo_text.split("\n") if (m := _HEADER.match(line))}
    fused = {t for lines in comps.values() for ln in lines if " fusion(" in ln for t in FUSION_CALLS.findall(ln)}
    access: dict = {}  # filled with nested fusions on the way
    for n in fused & comps.keys():
        if n not in access:
            access[n] = _fused_access(comps[n], headers.get(n, ""), comps, headers, access)
    return _Program(comps, headers, fused, access, {}, {})


def _top_level_instr(line: str) -> tuple | None:
    """(name, shape, op, shape bytes, operands, fusion's computation, block, jax name) of an instruction line."""
    m = INSTR.match(line)
    if not m:
        return None
    _, var, shape, op, args = m.groups()
    jax_name = OP_NAME.search(line)
    return (var, shape, op, _shape_bytes(shape), VAR.findall(args),
            FUSION_CALLS.search(line)[1] if op == "fusion" else None, block(line), jax_name[1] if jax_name else "")


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
    once: list[str] = []
    runs: dict[str, int] = {}
    _visit(prog, ENTRY.search(hlo_text)[1], 1, runs, trips or {}, once)
    return sorted(_rows(prog, runs), key=lambda r: -r.bytes), once


def _visit(prog: _Program, name: str, times: int, runs: dict[str, int], trips: dict[str, int], once: list[str]
           ) -> None:
    """Add `times` runs of computation `name` and of what it calls to `runs` (`op_rows`' rule); loop bodies whose
    trips nothing gives go to `once`."""
    runs[name] = runs.get(name, 0) + times
    for line in prog.comps.get(name, ()):
        if " while(" in line:
            body = BODY.search(line)[1]
            known = KNOWN_TRIPS.search(line) or counted_loop(prog.comps, name, line, COND.search(line)[1], body,
                                                             prog.defs)
            n = int(known[1]) if known else trips.get(body)
            if n is None and body not in once:
                once.append(body)
            _visit(prog, body, times * (n or 1), runs, trips, once)
        elif " call(" in line or " conditional(" in line:
            targets = [t for item in _CALL_TARGETS.findall(line) for t in item.replace("%", "").split(", ")
                       if t not in prog.fused]
            if " conditional(" in line and len(targets) > 1:  # one branch runs: the costliest
                targets = [max(targets, key=lambda t: _branch_bytes(prog, t, trips, once))]
            for t in targets:
                _visit(prog, t, times, runs, trips, once)


def _branch_bytes(prog: _Program, branch: str, trips: dict[str, int], once: list[str]) -> int:
    r: dict[str, int] = {}
    _visit(prog, branch, 1, r, trips, once)
    return sum(row.bytes for row in _rows(prog, r))


def _rows(prog: _Program, runs: dict[str, int]) -> list[OpBytes]:
    """Every top-level op of the computations in `runs`, with the bytes its runs read and write."""
    out = []
    for name, times in runs.items():
        sizes = {p: _shape_bytes(s) for p, s in _NAMED.findall(prog.headers.get(name, ""))}
        for line in prog.comps.get(name, ()):
            if line not in prog.instrs:
                prog.instrs[line] = _top_level_instr(line)
            if prog.instrs[line] is None:
                continue
            var, shape, op, nbytes, operands, callee, block, jax_name = prog.instrs[line]
            sizes[var] = 0 if op.endswith("-start") else nbytes
            if op in _NO_BYTES:
                continue
            read, write = _read_write(line, op, shape, operands, prog.access.get(callee) if callee else None, sizes,
                                      sizes[var])
            out.append(OpBytes(times * (read + write), times, block, op, var, shape, jax_name, name))
    return out


def _read_write(line: str, op: str, shape: str, operands: list[str], access, sizes: dict[str, int], write: int
                ) -> tuple[int, int]:
    """(bytes read, bytes written) of one op: an async done reads nothing; an offloaded gather reads the rows it
    gathers; a fusion that slices or updates in place what `_fused_access` says; any other op its operands."""
    if op.endswith("-done"):
        return 0, write
    if op == "call-start" and _OFFLOAD_GATHER in line:  # reads the rows it gathers, not its table
        table = sizes.get(operands[0], 0) if operands else 0  # 0: in VMEM, its rows read there
        return (_gathered_bytes(shape) if table else 0) + sum(sizes.get(a, 0) for a in operands[1:]), write
    if op == "fusion" and access:
        reads, write = access
        return sum(sizes.get(a, 0) if r is None else r for a, r in zip(operands, reads)), write
    return sum(sizes.get(a, 0) for a in operands), write


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
            return BYTES.get(m[1], 0) * math.prod(int(d) for d in m[2].split(",") if d) if m else 0
    return 0


def op_bytes(hlo_text: str, trips: dict[str, int] | None = None) -> dict[str, object]:
    """`op_rows` summed by block: {"bytes": {block: bytes}, "loops_counted_once": [body names]}. Blocks follow the
    op's jax name (`BLOCKS`; a fusion XLA left unnamed falls in "other")."""
    rows, once = op_rows(hlo_text, trips)
    out = dict.fromkeys(BLOCKS, 0)
    for r in rows:
        out[r.block] += r.bytes
    return {"bytes": out, "loops_counted_once": once}


def _updated_in_place(root: tuple[str, tuple], defs: dict) -> tuple[str | None, int | None]:
    """(the parameter a root `dynamic-update-slice` or `scatter` updates in place, through views of it; the bytes of
    its update), or (None, None)."""
    if root[1][0] not in ("dynamic-update-slice", "scatter"):  # operands: buffer, (indices,) update
        return None, None
    buf, upd = root[1][2][0], root[1][2][1 if root[1][0] == "dynamic-update-slice" else -1]
    while buf in defs and defs[buf][4]:
        buf = defs[buf][2][0]
    if defs.get(buf, ("",))[0] != "parameter":
        return None, None
    return buf, _shape_bytes(defs[upd][1]) if upd in defs else None


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
        m = INSTR.match(ln)
        if not m:
            continue
        root, var, shape, op, args = m.groups()
        ops_ = VAR.findall(args)
        view = op == "bitcast" or (op == "fusion" and len(ops_) == 1 and "output_to_operand_aliasing" in ln)
        inner_reads = None  # a nested fusion: the bytes it reads of each operand it only slices
        if op == "fusion" and not view and comps is not None:
            inner = FUSION_CALLS.search(ln)[1]
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

    in_place, write = _updated_in_place(root, defs)
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

