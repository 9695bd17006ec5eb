"""The ahead-of-time helpers that need no libtpu (TPU7x compiles are tests/integration/test_tpu_compile.py's):
the chip-major mesh, the weight and scale layouts asked of the compiler, the refused layout option, and the
resident bytes of a placed model against the sum of its shards (compiled for the 8 CPU devices)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_lib import aot, get_config
from qwen35_lib.engine.cache import CacheShape
from qwen35_lib.plan import get_layout
from qwen35_lib.weights import declare, is_info

ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _sds(shape, dtype=jnp.bfloat16, sharding=ONE):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.fixture(scope="module")
def mesh():
    return aot.chip_core_mesh(jax.devices())


def test_chip_core_mesh_is_chip_major():
    mesh = aot.chip_core_mesh(jax.devices())
    assert dict(mesh.shape) == {"chip": 4, "core": 2}
    np.testing.assert_array_equal([[d.id for d in row] for row in mesh.devices], np.arange(8).reshape(4, 2))


def test_mxu_format_tiles_bf16_16x128_and_puts_the_hidden_dim_second_minor():
    w_q = aot.mxu_format(_sds((1, 3, 64, 16, 32)), hidden=64)  # [G, L, D, heads, d]
    assert w_q.format.layout.major_to_minor == (0, 1, 3, 2, 4) and w_q.format.layout.tiling == ((16, 128), (2, 1))
    w_o = aot.mxu_format(_sds((1, 3, 16, 32, 64)), hidden=64)  # D last: order kept
    assert w_o.format.layout.major_to_minor == (0, 1, 2, 3, 4)
    for unchanged in (_sds((1, 3, 64, 16, 32), jnp.float32), _sds((64,)), _sds((1, 3, 64, 8, 32)),
                      _sds((16, 64), sharding=NamedSharding(aot.chip_core_mesh(jax.devices()), P(None, "core")))):
        assert aot.mxu_format(unchanged, hidden=64) is unchanged  # not bf16, rank 1, 8 rows, split over the mesh


def test_scale_format_tiles_as_the_grouped_matmul_reads():
    gate_up = aot.scale_format(_sds((1, 2, 8, 4, 2, 2), jnp.float32), "w_gate_up").format.layout
    assert gate_up.major_to_minor == tuple(range(6)) and gate_up.tiling == ((2, 128),)
    down = aot.scale_format(_sds((1, 2, 8, 2, 4), jnp.float32), "w_down").format.layout
    assert down.major_to_minor == (0, 1, 2, 4, 3) and down.tiling == ((8, 128),)  # last two dims swapped


def test_an_unknown_weight_layout_is_refused(mesh):
    cfg = get_config("qwen3.5-tiny")
    with pytest.raises(ValueError, match="weight_layouts must be 'default' or 'mxu', got 'tiled'"):
        aot.compile_step(cfg, get_layout("dp8_ep8"), mesh, requests=8, context_len=32, decode=1,
                         weight_layouts="tiled")


def test_resident_bytes_are_the_references(mesh):
    """The compile's argument bytes are the reference's (`costmodel.traffic.resident_bytes`: every declared weight and
    cache leaf over the ways the plan splits it)."""
    from qwen35_lib.costmodel import traffic

    cfg = get_config("qwen3.5-tiny")
    plan = get_layout("dp8_ep8").bind(mesh, cfg)
    shape = CacheShape(ranks=8, num_pages=5, page_size=16, num_slots=3)
    got, refused = aot.resident_bytes(cfg, plan, shape, mesh)
    ref = traffic.resident_bytes(plan, cfg, shape)
    assert refused is None and got == sum(ref.values())
    assert ref["weights"] < sum(i.nbytes for i in jax.tree.leaves(declare(cfg), is_leaf=is_info))  # experts split



def _baseline_pools() -> dict:  # in `aot_subprocess`'s child (libtpu): {pool: [dtype, row, rows a layer]}
    from qwen35_lib.aot import sweep
    from qwen35_lib.parallel.shardings import placed_config
    from qwen35_lib.plan import any_stage

    cfg = sweep.serving_config("qwen3.5-397b-a17b")
    tpu = aot.chip_core_mesh()
    plan = any_stage("baseline").bind(tpu, cfg)
    pools = aot.cache_pools(placed_config(cfg, plan, tpu), plan, tpu, sweep.cache_shape(sweep.SERVING, plan, tpu))
    return {name: [p.dtype, list(p.row), p.rows_per_layer] for name, p in pools.items()}


@pytest.mark.tpu_compile  # the tpu7x:2x2x1 description (libtpu, in a child process); nothing is compiled
def test_cache_pools_are_each_pool_as_its_own_sharding_splits_it():
    # the TP baseline at the serving shape: the GDN pools split by heads 8 ways, each device one of the duplicated KV
    # heads (the XLA attention's pool as uint32 words). Each pool is paired with its own sharding by name: in the
    # sorted order of the tree's leaves they did not line up, and the sweep's check failed on the TP baseline
    from qwen35_lib.aot.sweep import serving_config
    from tests import aot_subprocess

    cfg = serving_config("qwen3.5-397b-a17b")
    pools = aot_subprocess.run({"pools": (_baseline_pools,)})["pools"]
    assert pools["state"] == ["bf16", [cfg.gdn_num_v_heads // 8, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim], 513]
    assert pools["conv_v"] == ["bf16", [cfg.gdn_conv_kernel - 1, cfg.gdn_num_v_heads // 8, cfg.gdn_v_head_dim], 513]
    assert pools["kv"] == ["u32", [256, 2 * cfg.head_dim // 4], 512 * 36 + 1]


class _Lowered(Exception):
    """Raised by a stand-in `engine_step.lower` with what `compile_step` handed it (nothing compiled)."""


def test_compile_step_lowers_the_pools_for_requests_as_abstract_cache_declares_them(mesh, monkeypatch):
    # the step's caches are `CacheShape.for_requests` of its requests and context (each rank's sequences' pages +
    # the null page, a slot each + the null slot), built by `abstract_cache`: computed here as anywhere else
    from qwen35_lib.engine import step as engine_module
    from qwen35_lib.engine.cache import abstract_cache, kv_words_for

    class Step:
        @staticmethod
        def lower(config, plan, weights, cache, *rest):
            raise _Lowered(config, plan, cache, rest)

    monkeypatch.setattr(engine_module, "engine_step", Step)
    cfg = get_config("qwen3.5-tiny")
    with pytest.raises(_Lowered) as got:
        aot.compile_step(cfg, get_layout("dp8_ep8"), mesh, requests=10, context_len=40, decode=2, page_size=8,
                         kv_dtype="float8_e4m3fn")
    config, plan, cache, (tokens, meta, _) = got.value.args
    shape = CacheShape.for_requests(10, 40, ranks=8, page_size=8, kv_dtype="float8_e4m3fn",
                                    kv_words=kv_words_for(plan))
    assert plan.kv_dtype == "float8_e4m3fn"  # compile_step's kv_dtype, bound into the plan
    assert (shape.num_pages, shape.num_slots) == (11, 3)  # 2 sequences a rank of 5 pages, + the null page / slot
    assert cache == abstract_cache(config, shape, plan, mesh)
    assert aot.serving_pools(plan, 10, 40, 8) == shape  # the one home of these pools (the sweep's `cache_shape` too)
    assert aot.serving_pools(plan, 10, 40, 8, verify=3) == dataclasses.replace(shape, verify=3)
    assert meta.page_table.shape == (8, 2, 5) and meta.slot.shape == (8, 2)
