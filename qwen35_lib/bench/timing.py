"""Shared timing for the benchmarks: warm-up, interleaved repeats, medians, environment, results JSON.

Rules every benchmark follows (the machine may be shared and noisy):
- compare candidates side by side in one run, never absolute times across runs;
- warm up (compile) each candidate before timing it;
- interleave the candidates repeat by repeat, so drift and neighbours hit all of them alike;
- report the median of the repeats, and ratios.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
from tqdm import tqdm

from qwen35_lib.versions import installed_version


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call of one candidate: every repeat, and their median."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    def to_json(self) -> dict:
        return {"median_s": self.median, "min_s": self.min, "times_s": list(self.times)}


def block(result: Any) -> Any:
    """Wait until every JAX array in `result` is computed (torch on CPU is synchronous already)."""
    for leaf in jax.tree.leaves(result):
        if isinstance(leaf, jax.Array):
            leaf.block_until_ready()
    return result


def measure(candidates: dict[str, Callable[[], Any]], repeats: int = 3, warmup: int = 1, settle: int = 1,
            desc: str = "timing") -> tuple[dict[str, Timing], dict[str, Any]]:
    """Time zero-argument callables side by side.

    1. Warm up: call each candidate `warmup` times (compiles; at least once), keeping its last result.
    2. `repeats` rounds: each round visits every candidate, rotating the order from round to round; a visit makes
       `settle` untimed calls, then the timed one. Settling keeps one candidate's after-effects off the next
       one's time (seen: any XLA:CPU call right after a large `ragged_dot` takes ~130 ms longer).
    3. Returns ({name: Timing}, {name: the warm-up result}) so callers can check the outputs agree.
    A tqdm bar on stderr counts the calls.
    """
    names = list(candidates)
    outputs: dict[str, Any] = {}
    total = len(names) * (max(1, warmup) + repeats * (1 + settle))
    times: dict[str, list[float]] = {n: [] for n in names}
    with progress(total, desc) as bar:
        for name in names:
            for _ in range(max(1, warmup)):
                outputs[name] = block(candidates[name]())
                bar.update()
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                for _ in range(settle):
                    block(candidates[name]())
                    bar.update()
                start = time.perf_counter()
                block(candidates[name]())
                times[name].append(time.perf_counter() - start)
                bar.update()
    return {n: Timing(tuple(t)) for n, t in times.items()}, outputs


def warn_if_busy() -> float | None:
    """Print a warning to stderr when other processes keep the CPUs busy; returns the 1-minute load average.

    On a 2-core machine a neighbour's process slows thread-pooled runtimes (XLA, torch) by up to ~10x, and
    unevenly: such a run's ratios are not to be trusted.
    """
    load = _loadavg()
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load} on {os.cpu_count()} cores before the run: other processes are busy, "
              "timings will be noisy", file=sys.stderr)
    return load


# Other processes' mean CPU use (in cores) above which a ratio is withheld. transformers' `generate` on 2 torch
# threads is the sensitive side: with others at 0.3 of 2 cores it took 5.99 s where it takes 2.35-2.53 s with none
# (`bench engine`'s comparison, qwen3.5-mini 1k/1k, 8 requests), while our engine moved 3%.
OTHERS_MAX_CORES = 0.1


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has been busy (user, nice, system, irq, softirq, steal), from
    /proc/stat; None where there is none."""
    try:
        fields = pathlib.Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in fields[1:]]
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6, 7) if i < len(ticks))
    return busy / os.sysconf("SC_CLK_TCK")


class BusyMonitor:
    """Whether other jobs held the cores while a benchmark ran.

        with BusyMonitor() as load:
            ...  # the timed work
        doc["load"] = load.result()   # {"loadavg_1m_before", ..., "withhold_ratios": why or None}

    Records the 1-minute load average before and after, this process's CPU share (its CPU seconds over wall x
    cores) and the other processes' mean CPU use in cores (the machine's busy CPU seconds, /proc/stat, minus
    this process's, over the wall time). Ratios are withheld when the load before the run was above the core
    count or the others used more than `OTHERS_MAX_CORES` cores on average (the load after the run counts this
    process's own threads, so it is recorded, not judged).
    """

    def __enter__(self) -> BusyMonitor:
        self.cores = os.cpu_count() or 1
        self.load_before = _loadavg()
        self.wall0, self.own0, self.busy0 = time.perf_counter(), _own_cpu_seconds(), _busy_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.wall1, self.own1, self.busy1 = time.perf_counter(), _own_cpu_seconds(), _busy_cpu_seconds()
        self.load_after = _loadavg()

    def result(self) -> dict:
        wall = self.wall1 - self.wall0
        own = self.own1 - self.own0
        others = None
        if self.busy0 is not None and self.busy1 is not None and wall > 0:
            others = max(0.0, (self.busy1 - self.busy0 - own) / wall)
        why = None
        if self.load_before is not None and self.load_before > self.cores:
            why = f"the load average before the run was {self.load_before} on {self.cores} cores"
        elif others is not None and others > OTHERS_MAX_CORES:
            why = (f"other processes used {others:.2f} of the {self.cores} cores on average during the run "
                   f"(more than {OTHERS_MAX_CORES})")
        return {"cores": self.cores, "loadavg_1m_before": self.load_before, "loadavg_1m_after": self.load_after,
                "wall_s": wall, "cpu_share": own / (wall * self.cores) if wall > 0 else None,
                "others_cores": others, "withhold_ratios": why}


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def xla_cpu_threads() -> int:
    """Threads XLA:CPU runs a step's ops on: its intra-op pool spans every core of the process's CPU set."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ratio_text(value: float, load: dict, fmt: str = "{:.2f}x") -> str:
    """`value` formatted, or the reason it is withheld (`BusyMonitor.result`)."""
    why = load.get("withhold_ratios")
    return f"withheld ({why}; rerun on a quiet machine)" if why else fmt.format(value)


def progress(total: int, desc: str) -> tqdm:
    """A progress bar on stderr (the tables go to stdout)."""
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(**extra: Any) -> dict:
    """What a result was measured on: date, jax and its backend, CPU, cores, load now; `extra` adds fields."""
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or installed_version("jaxlib"),
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m_after": _loadavg(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),  # huge pages or not (`bench.__main__`)
        "native_isa": native_isa(),  # the native CPU kernels' variant that ran (`native.build.isa()`; None: XLA's)
    }
    env.update(extra)
    return env


def native_isa() -> str | None:
    """The ISA variant of the native CPU kernels this process runs (`kernels.native.build.isa()`; None: none runs, or
    they are off, `QWEN35_NATIVE=0`, or the backend is not the CPU)."""
    from qwen35_lib.kernels.native import build as native

    if jax.default_backend() != "cpu" or os.environ.get("QWEN35_NATIVE", "1") == "0":
        return None
    return native.isa()


def native_isa_text() -> str:
    """"x86-64-v3 (AVX2 + FMA, 16 registers of 8 floats)", or why the XLA kernels run instead."""
    from qwen35_lib.kernels.native import build as native

    if jax.default_backend() != "cpu":
        return f"off (backend {jax.default_backend()})"
    if os.environ.get("QWEN35_NATIVE", "1") == "0":
        return "off (QWEN35_NATIVE=0: the XLA kernels)"
    return native.describe() if native.isa() else f"none, the XLA kernels run ({native.isa_problem()})"


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def write_json(path: str | pathlib.Path, doc: dict) -> pathlib.Path:
    """Write `doc` as indented JSON, creating the parent folders; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def dict_table(rows: list[dict], keys) -> str:
    """`format_table` of dict rows: one column per key, in order."""
    return format_table(list(keys), [[r[k] for k in keys] for r in rows])


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 else f"{v:,.2f}"
    return str(v)
