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
import re

import numpy as np

from qwen35_lib.parallel.hlo.text import (
    BODY,
    BYTES,
    CALLS,
    COND,
    ENTRY,
    KNOWN_TRIPS,
    called,
    computations,
    counted_loop,
)

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute", "ragged-all-to-all")


# kind -> the bytes `step_counts` counts per device for one op
MOVED = {"all-gather": "output bytes (the gathered result)",
         "reduce-scatter": "input bytes (result bytes x the devices of its group)",
         "all-reduce": "operand bytes (= result bytes)",
         "all-to-all": "operand bytes (= result bytes: every buffer sent, its own share included)",
         "collective-permute": "operand bytes (= result bytes)",
         "ragged-all-to-all": "output buffer bytes"}


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(KINDS) +
                 r")(?P<start>-start)?\(")


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


_GROUPS = re.compile(r"replica_groups=(?:(?P<list>\{\{[\d,]*\}[^ ]*\})|\[(?P<iota>[\d,]+)\]<=|"
                     r"mesh\[(?P<mesh>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}|(?P<empty>\{\}))")


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
            size = lambda dtype, dims: int(np.prod([int(d) for d in dims.split(",") if d])) * BYTES.get(dtype, 4)
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
    bodies = set(BODY.findall(hlo_text))
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
    comps = computations(hlo_text)
    ops: dict[str, list[Collective]] = {}
    for c in collectives(hlo_text):
        ops.setdefault(c.computation, []).append(c)
    holds: dict[str, bool] = {}  # computation -> whether it, or one it calls, holds a collective

    def has(name: str) -> bool:
        if name not in holds:
            holds[name] = False  # the call graph is acyclic; this only stops a malformed text
            holds[name] = bool(ops.get(name)) or any(
                has(t) for line in comps.get(name, ()) for item in CALLS.findall(line)
                for t in item.replace("%", "").split(", "))
        return holds[name]

    runs: dict[str, int] = {}
    loop_defs: dict[str, dict] = {}  # `counted_loop`'s memo

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, ()):
            targets = [t for item in CALLS.findall(line) for t in item.replace("%", "").split(", ")]
            if not targets:
                continue
            if " while(" in line:
                body = BODY.search(line)[1]
                cond = COND.search(line)[1]
                trips = KNOWN_TRIPS.search(line) or counted_loop(comps, name, line, cond, body, loop_defs)
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

    visit(ENTRY.search(hlo_text)[1], 1)
    out: dict[str, dict[str, int]] = {}
    for name, times in runs.items():
        for c in ops.get(name, ()):
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += times
            d["bytes"] += times * c.moved
    return out

