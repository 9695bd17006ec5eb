"""Where a jitted step's time goes, by model component, from a `jax.profiler` trace of XLA:CPU.

XLA:CPU records one trace event per executed thunk (fusion, dot, copy, while loop, ...) named by its HLO
instruction; the instruction's `op_name` metadata in the compiled HLO carries the `jax.named_scope` path the model
wraps around each block (`attention`, `gdn`, `moe`, `proj` around every projection, `lm_head`). So:

1. `op_names(hlo_text)`: instruction name -> op_name, from the compiled module's text;
2. `trace(fn, calls)`: run `fn` `calls` times under `jax.profiler`, return the per-thread event lists;
3. `component_times(events, names, module)`: each event's self time (its duration minus that of the HLO events
   nested in it on the same thread: a while loop's body thunks, recorded inside the loop's own event) summed per
   component (`component_of`), per execution of the module (events carry a `run_id`);
4. `breakdown(...)`: the mean per execution, in ms, with the floors of each component beside it.

Components: `dense matmuls` (every projection: attention and GDN in/out projections, router, shared expert, LM
head), `attention` (the rest of the attention block: norms, RoPE, the KV write, the paged or dense attention),
`GDN` (conv, gates, the delta rule, gated norm), `MoE` (routing, dispatch, the routed experts' grouped matmul,
combine), `sampling` (what the engine step does after the model), `other` (embedding, residual norms, cache
slot updates). An instruction without metadata (a copy XLA inserted) is charged to the event it runs inside, or
to `other` at the top level.

The thunk executor may run independent thunks at once, so the components can sum to a little more than the
execution's wall time; both are reported.
"""

from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict
from typing import Callable

import numpy as np

COMPONENTS = ("dense matmuls", "attention", "GDN", "MoE", "sampling", "other")
MODEL_SCOPE = "model"  # `ragged_forward` and `forward` run under this named scope


def component_of(op_name: str | None) -> str | None:
    """The component of an op_name path (None: no metadata, charged to the enclosing event)."""
    if not op_name:
        return None
    parts = op_name.split("/")
    if MODEL_SCOPE not in parts:
        return "sampling"
    if "proj" in parts or "lm_head" in parts:
        return "dense matmuls"
    for scope, name in (("moe", "MoE"), ("gdn", "GDN"), ("attention", "attention")):
        if scope in parts:
            return name
    return "other"


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"")


def op_names(hlo_text: str) -> dict[str, str]:
    """{instruction name: op_name} of every instruction with metadata in a compiled module's HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def trace(fn: Callable[[], object], calls: int = 3) -> list[list[dict]]:
    """Run `fn` (which must block until its results are ready) `calls` times under `jax.profiler`; returns the
    host plane's events, one list per thread, each event {name, start_ns, duration_ns, hlo_op, hlo_module,
    run_id} (hlo fields None for non-HLO events)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="qwen35_profile_") as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(calls):
                fn()
        path = sorted(glob.glob(f"{tmp}/plugins/profile/*/*.xplane.pb"))[-1]
        data = ProfileData.from_file(path)
        lines = []
        for plane in data.planes:
            if plane.name != "/host:CPU":
                continue
            for line in plane.lines:
                events = []
                for e in line.events:
                    stats = dict(e.stats)
                    events.append({"name": e.name, "start_ns": e.start_ns, "duration_ns": e.duration_ns,
                                   "hlo_op": stats.get("hlo_op"), "hlo_module": stats.get("hlo_module"),
                                   "run_id": stats.get("run_id")})
                if any(e["hlo_op"] for e in events):
                    lines.append(events)
        return lines


def component_times(lines: list[list[dict]], names: dict[str, str] | Callable[[int], dict[str, str]],
                    module: str | None = None) -> dict[int, dict[str, float]]:
    """{run_id: {component: self seconds}} over the HLO events of `module` (any module when None); `names` is
    `op_names`' map, or a function of the run_id giving it (executions of differently shaped programs).

    Self time: an event's duration minus its nested HLO events' (on the same thread); a nested event without
    metadata takes its parent's component."""
    names_of = names if callable(names) else (lambda _: names)
    runs: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for events in lines:
        hlo = [e for e in events if e["hlo_op"] and (module is None or e["hlo_module"] == module)]
        hlo.sort(key=lambda e: (e["start_ns"], -e["duration_ns"]))
        stack: list[dict] = []  # open events: {"end", "comp", "child_ns", "event"}
        for e in hlo:
            start, end = e["start_ns"], e["start_ns"] + e["duration_ns"]
            while stack and stack[-1]["end"] <= start:
                _close(stack.pop(), runs)
            comp = component_of(names_of(e["run_id"]).get(e["hlo_op"]))
            if comp is None:
                comp = stack[-1]["comp"] if stack else "other"
            if stack:
                stack[-1]["child_ns"] += e["duration_ns"]
            stack.append({"end": end, "comp": comp, "child_ns": 0.0, "event": e})
        while stack:
            _close(stack.pop(), runs)
    return {k: dict(v) for k, v in runs.items()}


def _close(frame: dict, runs) -> None:
    e = frame["event"]
    runs[e["run_id"]][frame["comp"]] += max(0.0, e["duration_ns"] - frame["child_ns"]) * 1e-9


def execution_walls(lines: list[list[dict]], module: str | None = None) -> dict[int, float]:
    """{run_id: seconds from the first HLO event's start to the last one's end} per execution of `module`."""
    span: dict[int, list[float]] = {}
    for events in lines:
        for e in events:
            if e["hlo_op"] and (module is None or e["hlo_module"] == module):
                lo, hi = span.get(e["run_id"], (float("inf"), 0.0))
                span[e["run_id"]] = [min(lo, e["start_ns"]), max(hi, e["start_ns"] + e["duration_ns"])]
    return {k: (hi - lo) * 1e-9 for k, (lo, hi) in span.items()}


def mean_ms(per_run: dict[int, dict[str, float]], runs: list[int] | None = None) -> dict[str, float]:
    """The mean over `runs` (default: all) of each component's seconds, in ms (every component present)."""
    runs = list(per_run) if runs is None else runs
    if not runs:
        return dict.fromkeys(COMPONENTS, 0.0)
    return {c: 1e3 * sum(per_run.get(r, {}).get(c, 0.0) for r in runs) / len(runs) for c in COMPONENTS}


def execution_order(lines: list[list[dict]], module: str) -> list[int]:
    """The run_ids of `module`'s executions in the order they started."""
    first: dict[int, float] = {}
    for events in lines:
        for e in events:
            if e["hlo_op"] and e["hlo_module"] == module:
                first[e["run_id"]] = min(first.get(e["run_id"], float("inf")), e["start_ns"])
    return sorted(first, key=first.get)


def module_name(hlo_text: str) -> str | None:
    """The `HloModule` name of a compiled module's text (what trace events call `hlo_module`)."""
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    return m.group(1) if m else None


def floor_row(name: str, ms: float, floor: dict | None) -> dict:
    """One component's measured ms beside its floors: bytes / bandwidth, FLOPs / peak, the larger, and the share
    of the measured time the floor is (`floor` holds "bytes_ms", "flops_ms"; None: no floor, e.g. host)."""
    row = {"component": name, "ms": ms}
    if floor:
        row |= floor
        row["floor_ms"] = max(floor["bytes_ms"], floor["flops_ms"])
        row["of_floor"] = row["floor_ms"] / ms if ms > 0 else None
    return row


def table_rows(rows: list[dict]) -> list[list]:
    """`format_table` rows of `floor_row` dicts."""
    out = []
    for r in rows:
        if "floor_ms" in r:
            out.append([r["component"], f"{r['ms']:.2f}", f"{r['bytes_ms']:.2f}", f"{r['flops_ms']:.2f}",
                        f"{100 * r['of_floor']:.0f}%" if r.get("of_floor") is not None else "-"])
        else:
            out.append([r["component"], f"{r['ms']:.2f}", "-", "-", "-"])
    return out


TABLE_HEADERS = ["component", "ms", "floor: bytes/BW ms", "floor: FLOPs/peak ms", "floor / ms"]


def summarize(per_run: dict[int, dict[str, float]], runs: list[int], floors: list[dict], walls: dict[int, float],
              host_ms: float | None = None, host_label: str = "host (measured run)") -> dict:
    """One step kind's profile: each component's mean ms over `runs` beside its mean floors (`floors`: one
    `roofline.component_floors` dict per run), the host row when given, and the whole step's floor (Σ of the
    components' floors) against the profiled executable's mean wall time."""
    ms = mean_ms(per_run, runs)
    mean_floor = {}
    for name in COMPONENTS:
        fs = [f[name] for f in floors if name in f]
        if fs:
            mean_floor[name] = {k: float(np.mean([f[k] for f in fs])) for k in ("bytes_ms", "flops_ms")}
    rows = [floor_row(c, ms[c], mean_floor.get(c)) for c in COMPONENTS]
    if host_ms is not None:
        rows.append(floor_row(host_label, host_ms, None))
    floor_ms = sum(r["floor_ms"] for r in rows if "floor_ms" in r)
    device_ms = 1e3 * float(np.mean([walls[r] for r in runs if r in walls])) if runs else 0.0
    return {"steps": len(runs), "rows": rows, "components_ms": sum(ms.values()), "executable_ms": device_ms,
            "floor_ms": floor_ms, "floor_of_executable": floor_ms / device_ms if device_ms else None,
            "floor_of_step": floor_ms / (device_ms + host_ms) if device_ms and host_ms is not None else None}


def print_summary(title: str, s: dict) -> None:
    """The table of one `summarize` result, with its totals line."""
    from qwen35_lib.bench.timing import format_table

    print(f"\n{title} ({s['steps']} profiled executions; ms per execution):")
    print(format_table(TABLE_HEADERS, table_rows(s["rows"])))
    line = (f"components sum {s['components_ms']:.2f} ms, executable wall {s['executable_ms']:.2f} ms (profiled); "
            f"floor of the whole step {s['floor_ms']:.2f} ms = {100 * (s['floor_of_executable'] or 0):.0f}% of the "
            "executable")
    if s.get("floor_of_step") is not None:
        line += f", {100 * s['floor_of_step']:.0f}% of executable + host"
    print(line)
    if s.get("top_ops"):
        print("the instructions with the most self time: " + "; ".join(
            f"{o['op']} {o['ms']:.2f} ms ({o['component']}: {_short(o['op_name'])})" for o in s["top_ops"][:5]))


def _short(op_name: str) -> str:
    """An op_name without the jit and layer-group prefix: `gdn/proj/dot_general`."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "layer_group")) and p != MODEL_SCOPE]
    return "/".join(parts) or "-"


def top_ops(lines: list[list[dict]], names: dict[str, str] | Callable[[int], dict[str, str]], module: str,
            runs: list[int], n: int = 8) -> list[dict]:
    """The `n` instructions with the most self time over `runs`, mean ms per execution: where a component's time
    sits ({"op", "op_name", "component", "ms"}; op_name "" for an instruction XLA added without metadata)."""
    names_of = names if callable(names) else (lambda _: names)
    keep = set(runs)
    total: dict[tuple, float] = defaultdict(float)
    for events in lines:
        hlo = sorted((e for e in events if e["hlo_op"] and e["hlo_module"] == module and e["run_id"] in keep),
                     key=lambda e: (e["start_ns"], -e["duration_ns"]))
        stack: list[list] = []  # [end, key, child_ns, duration]
        for e in hlo:
            while stack and stack[-1][0] <= e["start_ns"]:
                end, key, child, dur = stack.pop()
                total[key] += dur - child
            if stack:
                stack[-1][2] += e["duration_ns"]
            key = (e["hlo_op"], names_of(e["run_id"]).get(e["hlo_op"], ""))
            stack.append([e["start_ns"] + e["duration_ns"], key, 0.0, e["duration_ns"]])
        while stack:
            end, key, child, dur = stack.pop()
            total[key] += dur - child
    best = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    return [{"op": op, "op_name": name, "component": component_of(name) or "(no metadata)",
             "ms": 1e-6 * ns / max(1, len(runs))} for (op, name), ns in best]
