"""The speculative verify step compiled for TPU7x-8 at the serving shape, beside the cost model's memory for it.

    python -m qwen35_lib.aot verify [--model NAME] [--stage kernels] [--drafts 1,3] [--requests 512,...]
                                    [--groups N] [--json PATH]

Each entry is `sweep.compile_entry`'s decode step with k drafts a decode row (`aot.compile_step(...,
speculative_tokens=k)`: `engine.step.verify_step`, decode rows of k + 1 tokens, the GDN pools with k + 1 state
checkpoints a slot) under the stage's layout with the kernels the engine verifies with (`sweep.speculative_plan`:
the stage's GDN where it keeps the per-position checkpoints, the Pallas verify kernel under `kernels`, and the XLA
attention by items; the MoE and dense kernels the stage's), at `sweep.SERVING`'s pools of 9,216 tokens a request
for each of `--requests` (default 512). Entries are keyed "k drafts, N requests". Beside each, `model`: what
`costmodel.predict.resident_bytes_per_device` puts on a device for the same pools (weights, KV, GDN state with
its checkpoints, and the MTP head's weights and KV pool, which the verify step does not read and the compile
therefore does not hold), and `fits_with_head`: the compile's total plus the head's bytes within the usable HBM.
Resumable as the sweep: `--json` is rewritten after each entry, and entries already there are kept.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from qwen35_lib.aot import sweep


def model_bytes(cfg, stage: str, shape: sweep.ServingShape, drafts: int) -> dict[str, int]:
    """The cost model's per-device bytes of `stage` holding `shape`'s pools with `drafts` drafts a step
    (`costmodel.predict.resident_bytes_per_device` on TPU7x-8)."""
    from qwen35_lib.costmodel import specs
    from qwen35_lib.costmodel.predict import resident_bytes_per_device
    from qwen35_lib.plan import abstract_mesh, any_stage

    sp = specs.get("tpu7x-8")
    plan = any_stage(stage)
    ranks = plan.on_devices(sp.devices).bound(abstract_mesh(sp.devices), cfg).dp
    r = resident_bytes_per_device(cfg, sp, plan, -(-shape.requests // ranks), shape.context_len, shape.kv_dtype,
                                  shape.page_size, drafts)
    return {k: int(v) for k, v in r.items()}


def key(drafts: int, requests: int) -> str:
    return f"{drafts} drafts, {requests} requests"


def verify_sweep(model: str = "qwen3.5-397b-a17b", stage: str = "kernels", drafts=(1, 3), groups: int | None = None,
                 json_path=None, shape: sweep.ServingShape = sweep.SERVING, progress: bool = True,
                 overrides: dict | None = None, weight_layouts: str = "mxu", requests=None) -> dict:
    """The document of the module doc: {"model", "stage", "groups", "shape", "usable_bytes", "verify": {key(k, N):
    entry}} for each k of `drafts` and N of `requests` (default: `shape`'s)."""
    from qwen35_lib import aot

    cfg = sweep.serving_config(model, groups, **(overrides or {}))
    usable = sweep.usable_bytes()
    head = {"model": model, "stage": stage, "groups": cfg.num_groups, "overrides": dict(overrides or {}),
            "topology": aot.TPU7X_8, **sweep._versions(), "weight_layouts": weight_layouts,
            "shape": {k: v for k, v in vars(shape).items() if k != "requests"}, "usable_bytes": usable}
    doc = dict(head, verify={})
    path = pathlib.Path(json_path) if json_path else None
    if path is not None and path.exists():
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in head} == head:
            doc["verify"] = old.get("verify", {})
    mesh = aot.chip_core_mesh()
    for k, n in [(k, n) for n in (requests or [shape.requests]) for k in drafts]:
        if key(k, n) in doc["verify"]:
            continue
        t0 = time.perf_counter()
        if progress:
            print(f"aot verify: {stage} {key(k, n)} ...", file=sys.stderr, flush=True)
        at = sweep.dataclasses.replace(shape, requests=n)
        e = sweep.compile_entry(cfg, stage, "8k/1k decode", mesh, at, usable=usable,
                                weight_layouts=weight_layouts, speculative_tokens=k)
        e["requests"] = n
        m = model_bytes(cfg, stage, at, k)
        e["model"] = m
        head_bytes = m.get("mtp_weight_bytes", 0) + m.get("mtp_kv_bytes", 0)
        if e.get("total_bytes") is not None:
            e["fits_with_head"] = e["total_bytes"] + head_bytes <= usable
        e["wall_s"] = time.perf_counter() - t0
        doc["verify"][key(k, n)] = e
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1))
    return doc


def table(doc: dict) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    rows = [f"{doc['model']} {doc['stage']} verify step on {doc['topology']}, {doc['groups']} groups; usable "
            f"{gib(doc['usable_bytes'])} GiB",
            f"{'entry':>22} {'total':>7} {'args':>7} {'temp':>6} {'GDN':>6} {'model GDN':>9} {'head':>5} {'fits':>5} "
            f"{'+head':>5}"]
    for k, e in doc["verify"].items():
        m = e.get("model", {})
        rows.append(f"{k:>22} {gib(e.get('total_bytes')):>7} {gib(e.get('argument_bytes')):>7} "
                    f"{gib(e.get('temp_bytes')):>6} {gib(e['gdn_state_bytes']):>6} {gib(m.get('gdn_state_bytes')):>9} "
                    f"{gib(m.get('mtp_weight_bytes', 0) + m.get('mtp_kv_bytes', 0)):>5} {str(e.get('fits')):>5} "
                    f"{str(e.get('fits_with_head')):>5}" + (f"  {e['error'][:70]}" if "error" in e else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen35_lib.aot verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-397b-a17b")
    p.add_argument("--stage", default="kernels")
    p.add_argument("--drafts", default="1,3", help="comma-separated draft counts k (default: %(default)s)")
    p.add_argument("--groups", type=int, help="layer groups to compile (default: the model's own depth)")
    p.add_argument("--requests", default=str(sweep.SERVING.requests),
                   help="comma-separated concurrent requests over the slice (default: %(default)s)")
    p.add_argument("--json", help="write (and resume) the document here")
    a = p.parse_args(argv)
    try:
        drafts = [int(x) for x in a.drafts.split(",")]
    except ValueError:
        p.error(f"--drafts takes comma-separated integers, got {a.drafts!r}")
    if any(k < 1 for k in drafts):
        p.error(f"--drafts must be >= 1 each, got {a.drafts!r}")
    try:
        requests = [int(x) for x in a.requests.split(",")]
    except ValueError:
        p.error(f"--requests takes comma-separated integers, got {a.requests!r}")
    print(table(verify_sweep(a.model, a.stage, drafts, a.groups, a.json, requests=requests)))
    return 0
