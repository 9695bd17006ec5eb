"""What every notebook does before and after its chapter, as two calls.

    devices, SIZE, mesh = notebook.setup()    # after the install line, before anything starts JAX's backend
    notebook.save_results("dp_ep", record)    # last cell: the figures the chapter quotes

Each notebook opens with one install line, for Colab: where `qwen35_lib` does not import, it pip-installs the library
from GitHub (`$QWEN35_REPO`: a fork) with its `reference` extra; where it imports (an install, `make playbook`, CI) or
from a checkout's notebooks/ folder (whose library it puts on the path) it installs nothing. That line cannot see the
runtime, so `setup` brings the JAX plugin an accelerator needs (`jax_plugin_requirement`), and only to a library
installed from git (`installed_from_git`: the install line's own install), never to a checkout or a `make` venv.

`setup` probes the accelerator (in a child process, so that this one can still choose its backends), decides where
each kind of work runs (`select_runtime`, a pure function of the platform, its device count and kind), starts JAX
accordingly and prints it in one line; `runtime()` is the record it chose. Where work runs (the twins and kernels
column is the kernel chapter's side by side, `setup(prefer_accelerator=True)`):

| runtime                                  | parallel layouts        | XLA twins | Pallas TPU kernels          |
|------------------------------------------|-------------------------|-----------|-----------------------------|
| no accelerator (a laptop, CI)            | 8 simulated CPU devices | CPU       | interpret mode, beside them |
| TPU with fewer than 8 devices (Colab's)  | 8 simulated CPU devices | TPU       | compiled by Mosaic, on it   |
| TPU with 8 devices or more               | the TPU's devices       | TPU       | compiled by Mosaic, on it   |
| GPU with fewer than 8 devices            | 8 simulated CPU devices | GPU       | interpret mode, beside them |
| GPU with 8 devices or more               | the GPU's devices       | GPU       | interpret mode, beside them |

Everywhere, with libtpu installed, the Pallas kernels and the serving steps are also compiled for TPU7x ahead of
time. On an accelerator with fewer devices than the layouts need, a layout chapter runs on the CPU alone
(`jax_platforms="cpu"`), as it does on a laptop; the kernel chapter, which needs no layout, holds both backends,
the accelerator first (`"tpu,cpu"` or `"cuda,cpu"`: JAX's default backend, so `jax.default_backend()`, the kernel
registry's "auto" and Pallas' interpret-or-compile choice all follow it) and the simulated CPU devices beside it
(`jax.devices("cpu")`). The size is "tpu" when the layouts run on a TPU, "cpu" otherwise, `$QWEN35_SIZE`
overriding. `save_results` writes `record` as `<name>.json` under `$QWEN35_RESULTS_DIR` when the playbook builder
set it, and does nothing otherwise.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any, NamedTuple

from qwen35_lib.versions import DISTRIBUTION, installed_version

RESULTS_ENV = "QWEN35_RESULTS_DIR"
SIZE_ENV = "QWEN35_SIZE"
SIZES = ("cpu", "tpu")
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")  # TPU VMs (two drivers), NVIDIA
ACCELERATORS = ("none", "tpu", "gpu")
JAX_PLATFORM = {"tpu": "tpu", "gpu": "cuda"}  # accelerator -> its name in `jax_platforms` (NVIDIA nodes only)
AOT_TARGET = "tpu7x:2x2x1"  # what the ahead-of-time compiles target (qwen35_lib.aot), on every runtime


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where each kind of work runs on this runtime (`select_runtime`). Platforms are "cpu", "tpu" or "gpu"."""

    accelerator: str  # "none", "tpu" or "gpu"
    accelerator_devices: int  # 0 without an accelerator
    device_kind: str  # the accelerator's (e.g. "TPU v5 lite"), "" without one
    layouts: str  # platform of the devices the parallel layouts run on ("cpu": simulated CPU devices)
    layout_devices: int
    twins: str  # platform the XLA twins run on (the kernel chapter's side by side)
    pallas: str  # "compiled" (Mosaic, on the TPU) or "interpret" (numerics only, on the twins' platform)
    jax_platforms: str | None  # what setup sets before JAX starts (None: JAX's own choice, or $JAX_PLATFORMS)
    size: str  # "tpu" when the layouts run on a TPU, else "cpu"
    description: str  # the one line setup prints

    @property
    def simulated(self) -> bool:
        """The layouts run on simulated CPU devices."""
        return self.layouts == "cpu"

    @property
    def kernels(self) -> str:
        """Where the kernel chapter's XLA twins and Pallas kernels run, in words (a clause of `description`)."""
        where = "the CPU" if self.twins == "cpu" else f"the {self.twins.upper()}"
        if self.pallas == "compiled":
            return f"XLA twins and Pallas kernels (compiled by Mosaic) on {where}"
        return f"XLA twins on {where}, Pallas TPU kernels in interpret mode beside them (numerics only, not a speed)"


def select_runtime(accelerator: str, devices: int = 0, device_kind: str = "", *, cpu_devices: int = 8,
                   prefer_accelerator: bool = False) -> Runtime:
    """Where each kind of work runs, from the accelerator JAX found ("none", "tpu", "gpu"), its device count and
    kind. Pure: nothing is probed or started.

    1. Layouts: on the accelerator's devices when it has at least `cpu_devices`, else on `cpu_devices` simulated
       CPU devices (no accelerator, or a one-chip Colab runtime), JAX's default backend then being the CPU.
    2. XLA twins: on the accelerator when JAX's default backend is the accelerator: with enough devices, or with
       `prefer_accelerator` (the kernel chapter, which needs no layout devices: JAX then holds the accelerator as
       its default backend and the simulated CPU devices beside it, `jax.devices("cpu")`). Else on the CPU.
    3. Pallas TPU kernels: compiled by Mosaic and run on the TPU where the twins run on one; elsewhere in interpret
       mode (numerics only) beside their twins. Every runtime also compiles them for `AOT_TARGET` ahead of time
       (with libtpu), whatever its devices.
    4. `jax_platforms`: untouched (None) without an accelerator or with enough devices; else "cpu" (a layout
       chapter: the CPU only, as before), or the accelerator then the CPU (`prefer_accelerator`).
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator {accelerator!r}: use one of {', '.join(ACCELERATORS)}")
    if accelerator == "none" and devices:
        raise ValueError(f"no accelerator but {devices} accelerator devices: pass accelerator='tpu' or 'gpu'")
    if accelerator != "none" and devices < 1:
        raise ValueError(f"a {accelerator} runtime with {devices} devices: pass accelerator='none' instead")
    name = accelerator.upper()
    enough = accelerator != "none" and devices >= cpu_devices
    on_accelerator = enough or (accelerator != "none" and prefer_accelerator)
    layouts, layout_devices = (accelerator, devices) if enough else ("cpu", cpu_devices)
    twins = accelerator if on_accelerator else "cpu"
    pallas = "compiled" if twins == "tpu" else "interpret"
    jax_platforms = None
    if accelerator != "none" and not enough:
        jax_platforms = f"{JAX_PLATFORM[accelerator]},cpu" if prefer_accelerator else "cpu"
    found = "no accelerator" if accelerator == "none" else f"{device_kind or name} x {devices}"
    if enough:
        where = f"layouts on the {devices} {name} devices"
    else:
        fewer = "" if accelerator == "none" else f" (fewer than {cpu_devices} {name} devices)"
        where = f"layouts on {cpu_devices} simulated CPU devices{fewer}"
    record = Runtime(accelerator, devices, device_kind, layouts, layout_devices, twins, pallas, jax_platforms,
                     "tpu" if layouts == "tpu" else "cpu", "")
    idle = accelerator != "none" and not on_accelerator
    unused = f"; the {name} itself serves the kernel chapter (05)" if idle else ""
    description = f"{found}: {where}; {record.kernels}{unused}; compiled for {AOT_TARGET} too, ahead of time (libtpu)"
    return dataclasses.replace(record, description=description)


_RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    """The record `setup` chose (a RuntimeError before it ran)."""
    if _RUNTIME is None:
        raise RuntimeError("notebook.setup() has not run yet: call it first (it chooses the runtime)")
    return _RUNTIME


def has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


PROBE = ("import json, jax; d = jax.devices(); "
         "print(json.dumps([d[0].platform, len(d), d[0].device_kind]))")


def probe_accelerator() -> tuple[str, int, str]:
    """(accelerator, devices, device kind) JAX finds on this machine: ("none", 0, "") without one. Probed in a
    child process so that this one can still choose its backends; the child inherits $JAX_PLATFORMS, so
    `JAX_PLATFORMS=cpu` means no accelerator."""
    if not has_accelerator():
        return "none", 0, ""
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    lines = probe.stdout.strip().splitlines()
    try:
        platform, count, kind = json.loads(lines[-1]) if lines and not probe.returncode else (None, 0, "")
    except ValueError:
        platform, count, kind = None, 0, ""
    if platform is None:
        print(f"the accelerator did not start JAX ({(probe.stderr.strip().splitlines() or ['no message'])[-1]}); "
              "running on the CPU")
        return "none", 0, ""
    if platform not in JAX_PLATFORM:
        print(f"an accelerator is present but JAX starts {platform} (no plugin for it, or $JAX_PLATFORMS chose "
              "another backend); running on the CPU")
        return "none", 0, ""
    return platform, int(count), str(kind)


def accelerator_device_count() -> int:
    """Devices JAX finds on this machine's accelerator (0: none)."""
    return probe_accelerator()[1]


class Setup(NamedTuple):
    """What `setup` gives a chapter: `devices, SIZE, mesh = notebook.setup()`."""

    devices: list  # the devices the chapter's layouts run on
    size: str  # "cpu" or "tpu"
    mesh: Any  # those devices as the ('chip', 'core') mesh (`plan.make_mesh`)


def installed_from_git() -> bool:
    """The library was pip-installed from a git URL (the notebooks' install line, on Colab): its PEP 610 record
    (`direct_url.json`) names a VCS. False for a checkout on the path, an editable install (`make`) or none."""
    try:
        record = importlib.metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    try:
        return "vcs_info" in json.loads(record or "{}")
    except ValueError:
        return False


def jax_plugin_requirement(accelerator: str, *, prefer_accelerator: bool = False) -> str | None:
    """The pip requirement that gives this runtime's accelerator the JAX plugin the installed jax pins, or None when
    it is there already or not needed. Pure but for reading installed versions.

    1. A TPU: `jax[tpu]==V`, unless libtpu is installed at the version jax's `tpu` extra pins (`libtpu==0.0.42.*`).
    2. A GPU, for the kernel chapter (`prefer_accelerator`, the XLA twins on the GPU): `jax[tpu,cuda12]==V` (libtpu for
       the TPU7x compiles, the CUDA plugin), unless both are at the pinned versions. The layout chapters leave a GPU to
       JAX as it is.
    3. No accelerator: None.
    """
    jax_version = installed_version("jax")
    if accelerator == "none" or jax_version is None or (accelerator == "gpu" and not prefer_accelerator):
        return None
    pins = [r for r in importlib.metadata.requires("jax") or [] if r.startswith("libtpu") and "tpu" in r]
    pin = re.match(r"libtpu\s*==\s*([\w.*]+)", pins[0]) if pins else None
    libtpu = installed_version("libtpu")
    ok = libtpu is not None and (pin is None or fnmatch.fnmatch(libtpu, pin.group(1)))
    if accelerator == "gpu":
        ok = ok and installed_version("jax-cuda12-plugin") == jax_version
    extras = "tpu" if accelerator == "tpu" else "tpu,cuda12"
    return None if ok else f"jax[{extras}]=={jax_version}"


def install_jax_plugin(*, prefer_accelerator: bool = False) -> str | None:
    """Where the library came from git (`installed_from_git`, the install line on Colab) and an accelerator lacks its
    JAX plugin (`jax_plugin_requirement`), pip-install it, before JAX starts; the requirement installed, or None."""
    if not installed_from_git() or not has_accelerator():
        return None
    accelerator = "gpu" if glob.glob(ACCELERATOR_NODES[-1]) else "tpu"
    requirement = jax_plugin_requirement(accelerator, prefer_accelerator=prefer_accelerator)
    if requirement is None:
        return None
    print(f"a {accelerator.upper()} runtime: pip install {requirement} (the JAX plugin of the pinned jax)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)
    return requirement


def _inline_figures() -> None:
    """`%matplotlib inline` in a notebook kernel (figures under their cell); nothing elsewhere (tests, scripts)."""
    if importlib.util.find_spec("IPython") is None or importlib.util.find_spec("matplotlib") is None:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        shell.run_line_magic("matplotlib", "inline")


def setup(cpu_devices: int = 8, *, prefer_accelerator: bool = False) -> Setup:
    """`(devices, size, mesh)`: the devices the chapter's layouts run on, the size, and those devices as the
    `('chip', 'core')` mesh, after choosing and starting the runtime (`runtime()`).

    1. On a library installed from git (Colab), the accelerator's JAX plugin (`install_jax_plugin`).
    2. The runtime (`select_runtime`): an accelerator with at least `cpu_devices` devices runs the layouts; with fewer
       (a one-device Colab runtime) or none, `cpu_devices` simulated CPU devices do, and an accelerator stays usable
       beside them (JAX's default backend with `prefer_accelerator`, for the kernel chapter). A RuntimeError when JAX
       already started a CPU backend with another count (the kernel must be restarted).
    3. The mesh (`plan.make_mesh` over the layout devices) and, in a notebook kernel, `%matplotlib inline`.
    """
    global _RUNTIME
    install_jax_plugin(prefer_accelerator=prefer_accelerator)
    import jax

    from qwen35_lib.devices import simulate_cpu_devices
    from qwen35_lib.plan import make_mesh

    rt = select_runtime(*probe_accelerator(), cpu_devices=cpu_devices, prefer_accelerator=prefer_accelerator)
    if rt.accelerator != "none" and rt.simulated:
        print(f"{rt.accelerator_devices} accelerator device(s), fewer than the {cpu_devices} this chapter's layouts "
              f"place work on: they run on {cpu_devices} simulated CPU devices at CPU size instead")
    if rt.jax_platforms:
        jax.config.update("jax_platforms", rt.jax_platforms)
    if rt.simulated:
        simulate_cpu_devices(cpu_devices)  # collectives wait for a slow simulated device instead of aborting
    devices = jax.devices("cpu") if rt.simulated else jax.devices()
    if rt.simulated and len(devices) != cpu_devices:
        raise RuntimeError(f"JAX started with {len(devices)} CPU devices, not {cpu_devices}: restart the kernel and "
                           "run notebook.setup() before anything else uses JAX")
    size = os.environ.get(SIZE_ENV) or rt.size
    if size not in SIZES:
        raise ValueError(f"${SIZE_ENV}={size!r}: use one of {', '.join(SIZES)}")
    _RUNTIME = rt
    mesh = make_mesh(devices)
    _inline_figures()
    print(f"{len(devices)} x {devices[0].device_kind}; size: {size}; mesh {dict(mesh.shape)}")
    print(rt.description)
    return Setup(devices, size, mesh)


def save_results(name: str, record: dict[str, Any]) -> pathlib.Path | None:
    """`record` as `$QWEN35_RESULTS_DIR/<name>.json` (the path), or None when the variable is unset."""
    folder = os.environ.get(RESULTS_ENV)
    if not folder:
        return None
    path = pathlib.Path(folder, f"{name}.json")
    path.write_text(json.dumps(record, indent=2))
    return path


# -- claims: a comparison a chapter states, checked by the run (DESIGN principle 7) --

CLAIMS_FILE = "claims"  # `$QWEN35_RESULTS_DIR/claims.json`: every claim the notebook checked, quoted `{{ claim: }}`
_CLAIMS: dict[str, dict[str, Any]] = {}
_NAME = re.compile(r"^[A-Za-z_][\w\-]*$")


class ClaimFailed(AssertionError):
    """A comparison the chapter states does not hold in this run: the notebook (and `make playbook`) fails."""


def _number(value: Any) -> Any:
    """A JSON-able scalar (numpy and JAX scalars to Python's)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if item is None:
        raise TypeError(f"a claim's value must be a number or a string, not {type(value).__name__}")
    return item()


def claim(name: str, statement: str, holds: bool, relation: str = "", **values: Any) -> dict[str, Any]:
    """Check one comparison a chapter states and record it; the record.

        notebook.claim("gdn_small", "GDN adds {gdn:.0f} ms where attention saves {attn:.0f}", gdn < attn,
                       "gdn < attn", gdn=g, attn=a)

    1. `statement` is the sentence as the chapter shows it (a clause, no final period), its `{field:spec}` fields
       filled from `values` (`str.format`): the run's numbers, never typed ones; `relation` says what was compared.
       `values` may not be empty: results.json records every claim with the figures it compared.
    2. The record `{statement, text, holds, relation, values}` joins this kernel's claims and, when the playbook
       builder runs the notebook, `$QWEN35_RESULTS_DIR/claims.json` (every claim so far, a failing one included):
       `results.json` keeps them, and a chapter renders one as `{{ claim: NN.name }}` (playbook/claims.py).
    3. It prints `claim NAME holds: TEXT`, or raises ClaimFailed naming the claim when it does not hold: the cell
       fails, so does the notebook, its test and `make playbook`.
    """
    if not _NAME.match(name):
        raise ValueError(f"claim name {name!r}: letters, digits, '_' and '-' only")
    if not values:
        raise ValueError(f"claim {name!r} records no values: pass the run's figures it compares as keywords")
    values = {k: _number(v) for k, v in values.items()}
    try:
        text = statement.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"claim {name!r}: its statement does not format with {sorted(values)}: {e!r}") from None
    record = dict(statement=statement, text=text, holds=bool(holds), relation=relation, values=values)
    _CLAIMS[name] = record
    folder = os.environ.get(RESULTS_ENV)
    if folder:
        pathlib.Path(folder, f"{CLAIMS_FILE}.json").write_text(json.dumps(_CLAIMS, indent=2))
    if not holds:
        raise ClaimFailed(f"claim {name!r} does not hold ({relation or 'false'}; {values}): {text}")
    print(f"claim {name} holds: {text}")
    return record


def claims() -> dict[str, dict[str, Any]]:
    """The claims this kernel checked, by name (the content of claims.json)."""
    return dict(_CLAIMS)


def claim_greater(name: str, statement: str, factor: float = 1.0, **values: Any) -> dict[str, Any]:
    """`claim` that the first keyword value is more than `factor` times the second (Python keeps keyword order):
    `claim_greater("attn_first", "attention ({a:.0f}) costs more than the MoE ({m:.0f})", a=attn, m=moe)`. Later
    keyword values are context for the statement."""
    (a, x), (b, y) = list(values.items())[:2]
    relation = f"{a} > {b}" if factor == 1.0 else f"{a} > {factor:g} x {b}"
    return claim(name, statement, x > factor * y, relation, **values)


def claim_largest(name: str, statement: str, parts: dict[str, float], largest: str, **context: Any
                  ) -> dict[str, Any]:
    """`claim` that `parts[largest]` is the largest of `parts` (its fields: each part's name, and `context`)."""
    top = max(parts, key=parts.get)
    relation = f"{largest} is the largest of {', '.join(parts)} (largest: {top})"
    return claim(name, statement, top == largest, relation, **parts, **context)


def claim_within(name: str, statement: str, lo: float, hi: float, **values: Any) -> dict[str, Any]:
    """`claim` that the first keyword value lies in [lo, hi]; the bounds are fields `lo` and `hi` too."""
    key, x = next(iter(values.items()))
    return claim(name, statement, lo <= x <= hi, f"{lo:g} <= {key} <= {hi:g}", lo=lo, hi=hi, **values)


def add_totals(gain: dict[str, Any], workloads: tuple[str, ...] = ("8k/1k", "1k/8k")) -> dict[str, Any]:
    """A `stage_gain` record with each workload's component total (`ms_per_1k_tokens_total`, and
    `previous_ms_per_1k_tokens_total` where it has a previous stage): the sum of every component the cost model
    charges, the cache copies included, which is one over the throughput (checked: a chapter's table adds up)."""
    for wl in workloads:
        row = gain[wl]
        for prefix, rate in (("", "total_tokens_per_s"), ("previous_", "previous_total_tokens_per_s")):
            if f"{prefix}ms_per_1k_tokens" not in row:
                continue
            total = sum(row[f"{prefix}ms_per_1k_tokens"].values())
            if abs(total - 1e6 / row[rate]) > 1e-6 * total:
                raise AssertionError(f"{gain['stage']} {wl}: the components sum to {total} ms per 1,000 tokens, not "
                                     f"one over the throughput ({1e6 / row[rate]}): a component is missing")
            row[f"{prefix}ms_per_1k_tokens_total"] = total
    return gain


def answer(exercise: int | str, text: str, **values: Any) -> str:
    """Show the numeric answer to exercise `exercise`, folded (`<details>`) so a reader tries first, its figures
    from this run: `text` formatted with `values` (`str.format`). In a notebook it displays as HTML (the rendered
    notebook and Colab fold it), elsewhere it prints; the text is returned."""
    import html as html_

    shown = text.format(**{k: _number(v) for k, v in values.items()})
    summary = f"Answer to exercise {exercise}, computed by this run"
    try:
        from IPython.display import display
    except ImportError:
        print(f"{summary}: {shown}")
        return shown
    display({"text/plain": f"{summary}: {shown}",
             "text/html": f"<details><summary>{html_.escape(summary)}</summary><p>{html_.escape(shown)}</p></details>"},
            raw=True)
    return shown
