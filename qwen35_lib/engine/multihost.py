"""Beyond one host: the same sharded engine step as N processes joined by `jax.distributed`.

A TPU7x slice larger than 8 devices spans hosts, one JAX process per host, each driving only its own devices.
This runs that on one machine: 2 processes x 4 CPU devices on loopback (gloo, JAX's CPU default) form the same
8-device `('chip', 'core')` mesh as one process with 8 devices, and must give the same greedy tokens.

    python -m qwen35_lib.engine.multihost --process-id 0 --num-processes 2 --coordinator 127.0.0.1:PORT \
        --layout dp8_ep8 --routing replicate &
    python -m qwen35_lib.engine.multihost --process-id 1 --num-processes 2 --coordinator 127.0.0.1:PORT \
        --layout dp8_ep8 --routing replicate

Every process prints one JSON line, the last on its stdout (gloo writes its connection notes there too):
`{"process_id", "process_count", "devices", "local_devices", "cases": [{"layout", "routing", "fuse_allgather",
"hierarchical_rs", "output_ids": [[...], ...]}]}` (process 0's is the result; the others' must equal it).
`--case LAYOUT[:ROUTING[:FLAGS]]` (repeatable) runs several layouts in one launch. What makes it work:
1. every process builds the same config, the same random weights (seeded numpy, `host_weights`; `init_weights`
   would do too, a jitted seeded function, but compiling it costs each process seconds) and the same requests,
   so each can supply its own shards from its own copy;
2. `shard_weights` places each weight with `jax.make_array_from_callback` from the process's own copy (each
   process supplies only the shards its devices hold), and the engine places its step inputs the same way;
3. the sampled tokens are replicated on every device, so every process's scheduler sees the same tokens and
   makes the same next batch (one program, many controllers).
`--num-processes 1` runs the same cases in one process over all its devices (the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from qwen35_lib.plan import cli as plan_cli

FORCE_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_PROMPTS = ([3, 4, 5], [7, 8, 9, 10, 11], [200, 9, 31, 77, 2, 6, 40, 41, 42], [11])


def parse_case(text: str) -> dict:
    """`LAYOUT[:ROUTING[:FLAG,FLAG]]`, e.g. `dp8_ep8:replicate:fuse_allgather,hierarchical_rs`."""
    parts = text.split(":")
    flags = set(parts[2].split(",")) - {""} if len(parts) > 2 else set()
    unknown = flags - {"fuse_allgather", "hierarchical_rs"}
    if len(parts) > 3 or unknown:
        raise ValueError(f"case {text!r}: use LAYOUT[:ROUTING[:fuse_allgather,hierarchical_rs]]")
    return dict(layout=parts[0], routing=parts[1] if len(parts) > 1 and parts[1] else "replicate",
                fuse_allgather="fuse_allgather" in flags, hierarchical_rs="hierarchical_rs" in flags)


def _case(plan) -> dict:
    """A plan's placement (layout, routing, collective flags), as the cases name it."""
    return dict(layout=plan.layout, routing=plan.routing or "replicate", fuse_allgather=plan.fuse_allgather,
                hierarchical_rs=plan.hierarchical_rs)


def host_weights(config, seed: int = 0) -> dict:
    """Random weights as host (numpy) arrays, the same in every process, drawn like `init_weights` (normal(0.02)
    matrices, zero-centred norms, log U[1, 16] for A_log, U[-1/sqrt(K), 1/sqrt(K)] for the conv) but with
    numpy: nothing to compile (jitting `init_weights` costs each process seconds). Dense experts only."""
    import jax
    import numpy as np

    from qwen35_lib.weights import declare, is_info

    if config.expert_dtype:
        raise ValueError("host_weights makes dense weights: use expert_dtype=None")
    rng = np.random.default_rng(seed)

    def leaf(info):
        if info.init in ("zeros", "ones"):
            x = np.full(info.shape, float(info.init == "ones"), np.float32)
        elif info.init == "a_log":
            x = np.log(rng.uniform(1.0, 16.0, info.shape))
        elif info.init == "conv":
            bound = 1.0 / np.sqrt(info.shape[2])
            x = rng.uniform(-bound, bound, info.shape)
        else:
            x = 0.02 * rng.standard_normal(info.shape)
        return np.asarray(x, np.float32).astype(info.dtype)

    return jax.tree.map(leaf, declare(config), is_leaf=is_info)


def generate_cases(cases: list[dict], prompts, max_new_tokens: int = 4, model: str = "qwen3.5-tiny",
                   seed: int = 0) -> list[dict]:
    """Greedy output ids of `prompts` for each case on the `('chip', 'core')` mesh over all global devices.
    The same call in every process of a multi-process run (and in one process for the reference)."""
    import jax

    from qwen35_lib.config import get_config
    from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
    from qwen35_lib.plan import custom_stage, make_mesh

    mesh = make_mesh(jax.devices())
    ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=8, max_model_len=64)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    weights = host_weights(get_config(model, dtype="float32"), seed)  # identical in every process; any layout
    out = []
    config = get_config(model, dtype="float32")
    for case in cases:
        plan = custom_stage(case["layout"], case["routing"], case["fuse_allgather"], case["hierarchical_rs"], None)
        results = Engine(config, weights, ec, mesh=mesh, plan=plan).generate([list(p) for p in prompts], params)
        out.append({**case, "output_ids": [r.output_ids for r in results]})
    return out


def child_env(env: dict | None = None) -> dict:
    """`env` (default: this process's) for a process that sets its own CPU device count: without the forced
    host device count in XLA_FLAGS (a test runner's 8 devices would otherwise leak into each child)."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FORCE_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def initialize(coordinator: str, num_processes: int, process_id: int, local_devices: int, timeout_s: int = 120):
    """Join the distributed run with `local_devices` CPU devices in this process. Must run before anything
    initializes a JAX backend (importing jax is fine)."""
    import jax

    from qwen35_lib.devices import with_patient_collectives

    # read by XLA when the backend starts, which has not happened yet
    os.environ["XLA_FLAGS"] = with_patient_collectives(child_env().get("XLA_FLAGS", ""))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU default; explicit for clarity
    if num_processes > 1:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen35_lib.engine.multihost", description=__doc__.splitlines()[0])
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--coordinator", default="127.0.0.1:12355", metavar="HOST:PORT")
    p.add_argument("--local-devices", type=int, help="CPU devices in this process (default: 8 / --num-processes)")
    plan_cli.add_arguments(p, layout="dp8_ep8", devices=False)  # the mesh is every device of every process
    p.add_argument("--case", action="append", metavar="LAYOUT[:ROUTING[:FLAGS]]",
                   help="repeatable; replaces --layout/--routing/flags, e.g. dp8_ep8:replicate:fuse_allgather")
    p.add_argument("--model", default="qwen3.5-tiny")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    local = args.local_devices or 8 // args.num_processes
    initialize(args.coordinator, args.num_processes, args.process_id, local)

    import jax

    cases = [parse_case(c) for c in args.case] if args.case else [_case(plan_cli.from_args(args))]
    doc = dict(process_id=jax.process_index(), process_count=jax.process_count(), devices=len(jax.devices()),
               local_devices=len(jax.local_devices()),
               cases=generate_cases(cases, DEFAULT_PROMPTS, args.max_new_tokens, args.model, args.seed))
    print(json.dumps(doc), flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
