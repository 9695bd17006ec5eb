"""Collectives read from a compiled program's HLO text: which, how many, how many bytes, in which computation.

XLA names every collective op in the optimized HLO (`all-gather`, `reduce-scatter`, `all-to-all`,
`all-reduce`, `collective-permute`, and their async `-start` halves on TPU). The layer scan's body is a
computation of its own, so counting inside it gives the collectives of one layer group.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute", "ragged-all-to-all")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(KINDS) +
                 r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # e.g. "all-gather"
    computation: str  # the HLO computation it sits in
    bytes: int  # of its result (for an async start: of the value it produces)
    shape: str


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of an optimized HLO module, in text order (async pairs counted once, at the start)."""
    out, comp = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:  # a computation header: `%name (...) -> ... {`
            comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        m = _OP.match(line)
        if m and "-done" not in line.split("=")[1].split("(")[0]:
            shapes = _SHAPE.findall(m["shape"])
            # an async start returns (operands..., result): count the result; a plain op may return a tuple
            # (XLA:CPU's all-to-all: one buffer per peer): count them all
            size = lambda dtype, dims: int(np.prod([int(d) for d in dims.split(",") if d])) * _BYTES.get(dtype, 4)
            nbytes = size(*shapes[-1]) if m["start"] else sum(size(*sh) for sh in shapes)
            out.append(Collective(m["kind"], comp, nbytes, m["shape"]))
    return out


def layer_body(hlo_text: str) -> str | None:
    """The name of the layer scan's loop body: of the `while` bodies, the one whose computations (it and those
    it calls) hold the most collectives. None when there is no loop with collectives (XLA unrolls a scan of
    length 1: give the model two layer groups)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    ops = collectives(hlo_text)
    counts = {b: sum(c.computation in called(hlo_text, b) for c in ops) for b in bodies}
    return max(counts, key=counts.get) if counts and max(counts.values()) else None


def count(hlo_text: str, computation: str | None = None) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "bytes": b}} over the module, or one computation and the ones it calls."""
    names = called(hlo_text, computation) if computation else None
    out: dict[str, dict[str, int]] = {}
    for c in collectives(hlo_text):
        if names is None or c.computation in names:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            d["count"] += 1
            d["bytes"] += c.bytes
    return out


def called(hlo_text: str, root: str) -> set[str]:
    """`root` and every computation reachable from it (fusions, conditionals, nested loops)."""
    bodies: dict[str, str] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and "{" in line:
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            bodies[name] = ""
        elif name:
            bodies[name] += line + "\n"
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in seen or n not in bodies:
            continue
        seen.add(n)
        todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|"
                           r"false_computation)=\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)", bodies[n])
        todo = [t for item in todo for t in item.replace("%", "").split(", ")]
    return seen
