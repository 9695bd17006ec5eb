"""The kernel registry: four slots, each a named set of interchangeable implementations.

| slot         | protocol (see the XLA implementation for shapes)                                     |
|--------------|---------------------------------------------------------------------------------------|
| `attention`  | `AttentionKernels(dense, paged, write, paged_write)`: causal GQA over right-padded     |
|              | rows; over the paged KV cache for flat ragged tokens; the KV-cache write; optionally  |
|              | the write and the paged attention as one call                                         |
| `gdn`        | `GdnKernels(dense, ragged)`: the gated delta rule over rows; over a ragged batch      |
|              | with per-sequence state slots                                                         |
| `moe_matmul` | `fn(x_sorted, group_sizes, w_gate_up, w_down, fp8_block) -> y_sorted`: grouped SwiGLU  |
| `permute`    | `Permute(dispatch, combine)`: sort token copies by expert, and the weighted un-sort   |

`Config.<slot>_kernel` names the implementation; "auto" picks the default for the backend in use (the tables of
`qwen35_lib.plan.kernels`: each backend's defaults, and the kernel families of the stages). Every
implementation is checked against its slot's reference twin in the tests. Pallas kernels register here too.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, NamedTuple

import jax

from qwen35_lib.plan.kernels import BACKEND_DEFAULTS, CONFIG_FIELDS, SLOTS


class AttentionKernels(NamedTuple):
    dense: Callable  # (q [B,T,Hq,d], k, v [B,T,Hkv,d], lengths [B]) -> o [B,T,Hq,d]
    # (q [T,Hq,d], kv_pages [P,ps,2Hkv*d], kv_scales [P,2Hkv,ps] | None, page_table [S,n], token_seq [T],
    #  positions [T]) -> o [T,Hq,d]
    paged: Callable
    write: Callable  # (kv_pages, kv_scales, k [T,Hkv,d], v, page [T], offset [T]) -> (kv_pages, kv_scales)
    # optional: write then paged as one call, (q, k, v, kv_pages, kv_scales, page, offset, page_table, token_seq,
    # positions) -> (o, kv_pages, kv_scales); `model/attention.py` uses it when present, else write then paged
    paged_write: Callable | None = None


class GdnKernels(NamedTuple):
    dense: Callable  # (q, k [B,T,Hk,dk], v [B,T,Hv,dv], g, beta [B,T,Hv], state [B,Hv,dk,dv], chunk_size) -> (o, S)
    ragged: Callable  # (q, k, v, g, beta over flat tokens, state slots, conv..., batch metadata): see gdn_xla


_IMPLS: dict[str, dict[str, Any]] = {slot: {} for slot in SLOTS}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("qwen35_kernel_target", default=None)


@contextlib.contextmanager
def compile_target(backend: str):
    """Trace for `backend` (e.g. "tpu" for an ahead-of-time TPU compile on this CPU): "auto" kernels resolve for
    it, and Pallas kernels lower for real (Mosaic) instead of in interpret mode."""
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_backend() -> str:
    """The backend being traced for: `compile_target`'s, else the default backend."""
    return _TARGET.get() or jax.default_backend()


def pallas_interpret() -> bool:
    """Pallas TPU kernels run compiled when tracing for a TPU, and in interpret mode (numerics only) otherwise."""
    return target_backend() != "tpu"


def register(slot: str, name: str) -> Callable[[Any], Any]:
    """Decorator: `@register("moe_matmul", "ragged_dot")` adds an implementation to a slot."""
    if slot not in _IMPLS:
        raise ValueError(f"unknown kernel slot {slot!r}; slots are {SLOTS}")

    def add(impl: Any) -> Any:
        _IMPLS[slot][name] = impl
        return impl

    return add


def available(slot: str) -> tuple[str, ...]:
    _load_all()
    return tuple(_IMPLS[slot])


def resolve_name(slot: str, name: str, backend: str | None = None) -> str:
    """The implementation name that `name` means on `backend` ("auto" -> the backend's default)."""
    if name != "auto":
        return name
    backend = backend or target_backend()
    return BACKEND_DEFAULTS.get(backend, BACKEND_DEFAULTS["cpu"])[slot]


def get(slot: str, name: str = "auto", backend: str | None = None) -> Any:
    """The implementation of `slot` called `name`."""
    _load_all()
    if slot not in _IMPLS:
        raise ValueError(f"unknown kernel slot {slot!r}; slots are {SLOTS}")
    resolved = resolve_name(slot, name, backend)
    if resolved not in _IMPLS[slot]:
        raise ValueError(f"no {slot!r} kernel named {resolved!r}; available: {', '.join(_IMPLS[slot])}")
    return _IMPLS[slot][resolved]


def for_config(slot: str, config: Any) -> Any:
    """The implementation `config` selects for `slot` (field `<slot>_kernel`, "auto" by default)."""
    return get(slot, getattr(config, CONFIG_FIELDS[slot]))


def _load_all() -> None:
    """Import every implementation module (`kernels/*_xla.py`, `kernels/*_pallas.py`): importing registers them."""
    import importlib
    import pkgutil

    import qwen35_lib.kernels as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name.endswith(("_xla", "_pallas")):
            importlib.import_module(f"qwen35_lib.kernels.{mod.name}")
