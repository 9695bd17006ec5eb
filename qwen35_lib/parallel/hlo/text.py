"""The grammar of XLA's optimized HLO text that the readers share: an instruction line's parts, the computations and
what calls what, the bytes of a dtype, and the trip count of a counted loop that XLA:TPU's scheduled text leaves
unannotated (`counted_loop`)."""

from __future__ import annotations

import functools
import re

BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


# `%x = f32[2]{0} add(%a, %b), ...`: (ROOT, x, f32[2]{0}, add, %a, %b)
INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*?)\)(?:, |$)")


VAR = re.compile(r"%([\w.\-]+)")


FUSION_CALLS = re.compile(r"calls=%?([\w.\-]+)")


BODY = re.compile(r"body=%?([\w.\-]+)")


COND = re.compile(r"condition=%?([\w.\-]+)")


KNOWN_TRIPS = re.compile(r'known_trip_count":\{"n":"(\d+)"')


ENTRY = re.compile(r"^ENTRY %?([\w.\-]+)", re.M)


OP_NAME = re.compile(r'op_name="([^"]*)"')


def computations(hlo_text: str) -> dict[str, list[str]]:
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


CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
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
    return {n: [t for item in CALLS.findall("\n".join(lines)) for t in item.replace("%", "").split(", ")]
            for n, lines in computations(hlo_text).items()}


_INT = re.compile(r"-?\d+")


_INDEX = re.compile(r"index=(\d+)")


_INIT = re.compile(r"while\(%([\w.\-]+)\)")


def counted_loop(comps: dict[str, list[str]], where: str, line: str, cond: str, body: str,
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
                m = INSTR.match(ln)
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
    m = INSTR.match(root)
    if not m or m[4] != "compare" or "direction=LT" not in root:
        return None
    lhs, rhs = m[5].split(",")[:2]
    k, n = element(c, lhs), constant(c, rhs)
    init = _INIT.search(line)
    tup = resolve(w, init[1]) if init else None
    broot = next((ln for ln in comps.get(body, ()) if ln.lstrip().startswith("ROOT")), "")
    bm = INSTR.match(broot)
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

