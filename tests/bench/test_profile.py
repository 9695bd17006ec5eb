"""The benchmarks' per-component profile (`bench.profile`), its floors (`bench.roofline.step_components`) and the
load monitor that withholds ratios (`bench.timing.BusyMonitor`). Structure and arithmetic only, no timing."""

import jax
import jax.numpy as jnp
import pytest

from qwen35_lib.bench import profile as prof


def test_op_names_are_classified_by_their_scopes():
    c = prof.component_of
    assert c("jit(engine_step)/model/layer_group_0/gdn/proj/dot_general") == "dense matmuls"
    assert c("jit(forward_prepared)/model/lm_head/btd,dv->btv/dot_general") == "dense matmuls"
    assert c("jit(engine_step)/model/layer_group_1/moe/while/body/dynamic_slice") == "MoE"
    assert c("jit(engine_step)/model/layer_group_1/gdn/while/body/mul") == "GDN"
    assert c("jit(engine_step)/model/layer_group_1/attention/while") == "attention"
    assert c("jit(engine_step)/model/layer_group_1/add") == "other"
    assert c("jit(engine_step)/argmax") == "sampling"  # after the model
    assert c(None) is None and c("") is None  # no metadata: the enclosing event's component


def test_a_traced_program_is_split_into_its_scopes():
    @jax.jit
    def f(a, b):
        with jax.named_scope("model"):
            with jax.named_scope("proj"):
                c = a @ b
            with jax.named_scope("moe"):
                def body(i, x):
                    return jnp.tanh(x) @ b
                c = jax.lax.fori_loop(0, 3, body, c)
        return jnp.argmax(c, axis=-1)

    a = jnp.ones((64, 64), jnp.float32) / 64
    text = f.lower(a, a).compile().as_text()
    names = prof.op_names(text)
    module = prof.module_name(text)
    assert module == "jit_f" and any("/moe/" in n for n in names.values())
    lines = prof.trace(lambda: jax.block_until_ready(f(a, a)), calls=2)
    per_run = prof.component_times(lines, names, module)
    runs = prof.execution_order(lines, module)
    assert len(runs) == 2 and set(per_run) == set(runs)
    ms = prof.mean_ms(per_run, runs)
    assert set(ms) == set(prof.COMPONENTS) and ms["dense matmuls"] > 0 and ms["MoE"] > 0
    walls = prof.execution_walls(lines, module)
    floors = {"dense matmuls": {"bytes_ms": 0.001, "flops_ms": 0.002}}
    s = prof.summarize(per_run, runs, [floors] * 2, walls, host_ms=0.5)
    assert [r["component"] for r in s["rows"]] == [*prof.COMPONENTS, "host (measured run)"]
    dense = s["rows"][0]
    assert dense["floor_ms"] == pytest.approx(0.002) and dense["of_floor"] == pytest.approx(0.002 / dense["ms"])
    assert s["floor_ms"] == pytest.approx(0.002) and s["executable_ms"] > 0
    top = prof.top_ops(lines, names, module, runs, n=3)
    assert len(top) == 3 and top[0]["ms"] >= top[-1]["ms"] > 0
    assert {o["component"] for o in prof.top_ops(lines, names, module, runs, n=50)} >= {"dense matmuls", "MoE"}


def test_self_time_excludes_nested_events_and_unnamed_ones_take_the_parent():
    ev = lambda op, start, dur: {"name": op, "start_ns": start, "duration_ns": dur, "hlo_op": op, "hlo_module": "m",
                                 "run_id": 7}
    lines = [[ev("while.1", 0, 100), ev("dot.2", 10, 30), ev("copy.3", 50, 20), ev("add.4", 200, 5)]]
    names = {"while.1": "jit(s)/model/moe/while", "dot.2": "jit(s)/model/moe/proj/dot_general",
             "add.4": "jit(s)/model/add"}
    t = prof.component_times(lines, names, "m")[7]
    assert t["MoE"] == pytest.approx((100 - 30 - 20 + 20) * 1e-9)  # the loop's self time + the unnamed copy
    assert t["dense matmuls"] == pytest.approx(30e-9) and t["other"] == pytest.approx(5e-9)
