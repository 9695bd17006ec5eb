"""The kernel registry: five slots, each a named set of interchangeable implementations.

| slot         | protocol (see the XLA implementation for shapes)                                     |
|--------------|---------------------------------------------------------------------------------------|
| `attention`  | `AttentionKernels(dense, paged, write, paged_write)`: causal GQA over right-padded     |
|              | rows; over the paged KV cache for flat ragged tokens; the KV-cache write; optionally  |
|              | the write and the paged attention as one call                                         |
| `gdn`        | `GdnKernels(dense, ragged)`: the gated delta rule over rows; over a ragged batch      |
|              | with per-sequence state slots                                                         |
| `moe_matmul` | `fn(x_sorted, group_sizes, w_gate_up, w_down, fp8_block) -> y_sorted`: grouped SwiGLU  |
| `permute`    | `Permute(dispatch, combine)`: sort token copies by expert, and the weighted un-sort   |
| `dense`      | `fn(x, w: LayerOf, contract, dtype) -> y`: a projection of one layer of a stacked     |
|              | weight (`kernels.stacked.LayerOf`); `reads_stacked` kernels take the whole stack      |

A serving plan names each slot's implementation (`ServingPlan.<slot>_kernel`), resolved for the platform it runs
on when it is bound (`plan.bind(mesh, config)`: "auto" -> the family's or the platform's default, the tables of
`qwen35_lib.plan.kernels`); the model asks for `for_plan(slot, plan)`. Every implementation is checked against
its slot's reference twin in the tests. Pallas kernels register here too, as a factory of the implementation for
a platform: compiled (Mosaic) on a TPU, interpret mode (numerics only) anywhere else.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, NamedTuple

import jax

from qwen35_lib.plan.kernels import BACKEND_DEFAULTS, SLOTS


class AttentionKernels(NamedTuple):
    dense: Callable  # (q [B,T,Hq,d], k, v [B,T,Hkv,d], lengths [B]) -> o [B,T,Hq,d]
    # (q [T,Hq,d], kv_pages [P,ps,2Hkv*d], kv_scales [P,2Hkv,ps] | None, page_table [S,n], token_seq [T],
    #  positions [T]) -> o [T,Hq,d]
    paged: Callable
    write: Callable  # (kv_pages, kv_scales, k [T,Hkv,d], v, page [T], offset [T]) -> (kv_pages, kv_scales)
    # optional: write then paged as one call, (q, k, v, kv_pages, kv_scales, page, offset, page_table, token_seq,
    # positions) -> (o, kv_pages, kv_scales); `model/attention.py` uses it when present, else write then paged
    paged_write: Callable | None = None
    # the pool keeps an 8-bit KV cache as uint32 words, four values a word along the minor dim
    # (`attention.xla.kv_words`): XLA:TPU scatters 8-bit rows only after relaying out the whole pool
    kv_words: bool = False


class GdnKernels(NamedTuple):
    dense: Callable  # (q, k [B,T,Hk,dk], v [B,T,Hv,dv], g, beta [B,T,Hv], state [B,Hv,dk,dv], chunk_size) -> (o, S)
    ragged: Callable  # (q, k, v, g, beta over flat tokens, state slots, conv..., batch metadata): see gdn.xla


_IMPLS: dict[str, dict[str, Any]] = {slot: {} for slot in SLOTS}
_PER_PLATFORM: set[tuple[str, str]] = set()  # (slot, name) registered as a factory `impl(platform: str)`


def pallas_interpret(platform: str | None = None) -> bool:
    """Pallas TPU kernels run compiled on a TPU and in interpret mode (numerics only) anywhere else; `platform`:
    the one a plan was bound for (default: JAX's default backend)."""
    return (platform or jax.default_backend()) != "tpu"


def register(slot: str, name: str, per_platform: bool = False) -> Callable[[Any], Any]:
    """Decorator: `@register("moe_matmul", "ragged_dot")` adds an implementation to a slot. per_platform: what is
    registered is a factory, `impl(platform: str)` -> the implementation for that platform (a Pallas kernel:
    interpret mode off a TPU; a native handler: called directly on the CPU, its XLA twin elsewhere), called by
    `get` for the platform asked."""
    if slot not in _IMPLS:
        raise ValueError(f"unknown kernel slot {slot!r}; slots are {SLOTS}")

    def add(impl: Any) -> Any:
        _IMPLS[slot][name] = impl
        if per_platform:
            _PER_PLATFORM.add((slot, name))
        return impl

    return add


@contextlib.contextmanager
def registered(slot: str, name: str, impl: Any) -> Iterator[Any]:
    """`impl` registered as `name` in `slot` inside a `with` block only (an experiment's kernel, a test's spy: other
    code lists `available(slot)` and would run it), the slot as before after it."""
    _load_all()  # the library's kernels first: loading them inside the block would replace `impl`
    before, factory = _IMPLS.get(slot, {}).get(name), (slot, name) in _PER_PLATFORM
    _PER_PLATFORM.discard((slot, name))
    register(slot, name)(impl)  # refuses an unknown slot
    try:
        yield impl
    finally:
        _IMPLS[slot].pop(name)
        if before is not None:
            register(slot, name, per_platform=factory)(before)


def available(slot: str) -> tuple[str, ...]:
    _load_all()
    return tuple(_IMPLS[slot])


def default_name(slot: str, platform: str | None = None) -> str:
    """The implementation of `slot` a plan that names none runs on `platform` (default: JAX's default backend)."""
    return BACKEND_DEFAULTS.get(platform or jax.default_backend(), BACKEND_DEFAULTS["cpu"])[slot]


def get(slot: str, name: str, platform: str | None = None) -> Any:
    """The implementation of `slot` called `name`, for `platform` (default: JAX's default backend)."""
    _load_all()
    if slot not in _IMPLS:
        raise ValueError(f"unknown kernel slot {slot!r}; slots are {SLOTS}")
    if name not in _IMPLS[slot]:
        raise ValueError(f"no {slot!r} kernel named {name!r}; available: {', '.join(_IMPLS[slot])}")
    impl = _IMPLS[slot][name]
    return impl(platform or jax.default_backend()) if (slot, name) in _PER_PLATFORM else impl


def check_plan(plan: Any) -> None:
    """Refuse a plan that names a kernel no slot has (before anything is traced): `get`'s one-line error, naming
    the slot's implementations."""
    for slot in SLOTS:
        get(slot, plan.kernel(slot), plan.platform)


def for_plan(slot: str, plan: Any) -> Any:
    """The implementation a serving plan runs in `slot` (`ServingPlan.kernel(slot)`, on the platform it was bound
    for)."""
    return get(slot, plan.kernel(slot), plan.platform)


IMPLEMENTATIONS = ("xla", "pallas", "native")  # kernels/<slot>/<name>.py: the modules that register


@functools.cache
def _load_all() -> None:
    """Import every implementation module (`kernels/<slot>/xla.py`, `pallas.py`, `native.py`): importing registers
    them. Once: the engine looks kernels up every step, and listing the package took about 1 ms a step under the
    profiler."""
    import importlib
    import pkgutil

    import qwen35_lib.kernels as pkg

    for folder in pkgutil.iter_modules(pkg.__path__):
        if folder.ispkg and folder.name != "native":  # native/: the C++ wing's build, no slot's implementation
            for mod in pkgutil.iter_modules([f"{pkg.__path__[0]}/{folder.name}"]):
                if mod.name in IMPLEMENTATIONS:
                    importlib.import_module(f"{pkg.__name__}.{folder.name}.{mod.name}")
