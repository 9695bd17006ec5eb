"""`bench mtp`'s engine runs: the engine served with and without the MTP head's drafts on this CPU, timed, beside the
cost model's prediction of the same runs, and each of its programs alone beside the model's price of it (issue 54,
item 3; `bench.mtp`'s steps 6 and 7).

- `engine_speculation`: the two engines' timed runs, the CPU's specs measured before each round of them;
- `cpu_prediction`: `costmodel.predict` of those runs on the specs measured beside them;
- `step_ratios`: the decode, verify and draft programs, captured from untimed runs, timed alone, and priced.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib.config import Config


def engine_speculation(config: Config, weights: dict, head: dict, prompts: np.ndarray, new_tokens: int, k: int,
                       max_num_seqs: int = 16, precompile: bool = True, repeats: int = 3,
                       measure_specs: bool = True) -> dict:
    """The engine's greedy run of `prompts` [N, P] (`new_tokens` each, EOS ignored) without speculation and with `k`
    drafts a step from `head`, the same knobs otherwise (`max_num_seqs`, a budget of every decode row plus one
    prompt, pages for every sequence): each engine precompiled for the workload and run once untimed (programs a
    run steps with that the precompile's dry run did not foresee are compiled then, not while timed), then a fresh
    engine's `generate` timed, `repeats` times, the two engines alternating (a busy machine's load moves within
    seconds: one timed run each measured x0.57 and x0.73 in two runs of the same settings); each run's wall is the
    median of its `repeats`. Returns
    {"0": run, str(k): run, "speedup", "same_outputs", "acceptance_length"}, a run {"wall_s", "wall_s_each",
    "output_tokens", "output_tokens_per_s", "steps", "drafted", "accepted", "traces_while_timed"} (the counts of
    one timed run: greedy, each is the same); the acceptance length the engine
    counted: 1 + accepted drafts per verified row (k drafts a row). `precompile=False` leaves the compiling to the
    untimed run (greedy: the timed run steps through the same shapes; `traces_while_timed` says if it did not).
    `measure_specs`: this CPU's specs measured before each round (`cpu_bench.measure_now`), their median per figure
    returned as "cpu_specs" (what `cpu_prediction` prices with; else None: the process's cached measurement)."""
    from qwen35_lib.costmodel import cpu_bench
    from qwen35_lib.engine import Engine
    from qwen35_lib.engine.engine_config import EngineConfig
    from qwen35_lib.engine.sampling import SamplingParams

    N, P = prompts.shape
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    out, outputs, configs, walls, specs = {}, {}, {}, {0: [], k: []}, []
    for drafts in (0, k):
        configs[drafts] = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs * (k + 1) + P,
                                       max_model_len=P + new_tokens + k + 1, speculative_tokens=drafts)
        warm = Engine(config, weights, configs[drafts], mtp_weights=head if drafts else None)
        if precompile:
            warm.precompile([P] * N, new_tokens)
        warm.generate(prompts.tolist(), params)
    for _ in range(repeats):
        if measure_specs:
            specs.append(cpu_bench.measure_now())
        for drafts in (0, k):
            eng = Engine(config, weights, configs[drafts], mtp_weights=head if drafts else None)
            traces = eng.stats.traces
            start = time.perf_counter()
            res = eng.generate(prompts.tolist(), params)
            walls[drafts].append(time.perf_counter() - start)
            outputs[drafts] = [r.output_ids for r in res]
            n = sum(len(o) for o in outputs[drafts])
            wall = float(np.median(walls[drafts]))
            out[str(drafts)] = {"wall_s": wall, "wall_s_each": walls[drafts], "output_tokens": n,
                                "output_tokens_per_s": n / wall, "steps": eng.stats.steps,
                                "drafted": eng.stats.drafted, "accepted": eng.stats.accepted,
                                "traces_while_timed": max(out.get(str(drafts), {}).get("traces_while_timed", 0),
                                                          eng.stats.traces - traces)}
    run = out[str(k)]
    rows = run["drafted"] / k if run["drafted"] else 0
    return out | {"k": k, "max_num_seqs": max_num_seqs, "prompts": N, "prompt_len": P, "new_tokens": new_tokens,
                  "repeats": repeats, "cpu_specs": cpu_bench.median_of(specs) if specs else None,
                  "speedup": run["output_tokens_per_s"] / out["0"]["output_tokens_per_s"],
                  "same_outputs": outputs[0] == outputs[k],
                  "acceptance_length": 1 + run["accepted"] / rows if rows else None}


def cpu_prediction(config: Config, measured: dict) -> dict:
    """The cost model's prediction of `engine_speculation`'s two runs on this CPU: `costmodel.predict` on the measured
    `cpu` specs (`costmodel.cpu_bench`), one device under the engine's plan, the run's prompts, lengths (range ratio
    1), sequences and budget, no serving mechanisms (those are TPU servers'), with k drafts at the acceptance length
    the engine counted, on the specs measured beside the timed runs (`measured["cpu_specs"]`; None: this process's
    `cpu_bench.measure()`). Returns {"output_tokens_per_s": {"0", str(k)}, "speedup", "acceptance_length"}."""
    from qwen35_lib.costmodel import specs as specs_lib
    from qwen35_lib.costmodel.predict import predict
    from qwen35_lib.plan import SINGLE as plan

    k, A = measured["k"], measured["acceptance_length"] or 1.0
    common = dict(isl=measured["prompt_len"], osl=measured["new_tokens"], concurrency=measured["prompts"],
                  max_batched_tokens=measured["max_num_seqs"] * (k + 1) + measured["prompt_len"],
                  max_seqs=measured["max_num_seqs"], kv_dtype=None, page_size=16, num_prompts=measured["prompts"],
                  range_ratio=1.0, roofline=False, mechanisms="off")
    sp = specs_lib.get("cpu", measured.get("cpu_specs"))
    with_k = predict(config, sp, plan, **common, speculative_tokens=k, acceptance_length=min(A, k + 1.0))
    without = with_k["speculation"]["without"]["output_tokens_per_s"]
    return {"output_tokens_per_s": {"0": without, str(k): with_k["output_tokens_per_s"]},
            "speedup": with_k["output_tokens_per_s"] / without, "acceptance_length": A,
            "breakdown_s": with_k["breakdown_s"]}


def _copy(args: tuple) -> tuple:
    """The arrays of a program's arguments copied (its caches are donated), the rest as they are."""
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, args)


def _capture(programs: dict, name: str, fn, meta_arg: int, rows: int, width: int):
    """`fn` calling through, keeping a copy of its arguments (once, as `programs[name]`) at the first call whose
    decode region fills `rows` rows of `width` tokens and whose step holds no prompt token."""
    def call(*args):
        meta = args[meta_arg]
        if name not in programs and meta.decode_seq.shape[-1] == rows and \
                bool((np.asarray(meta.token_seq)[:, rows * width:] < 0).all()):
            kv = np.asarray(meta.kv_len)[0, :rows]
            programs[name] = (fn, _copy(args), int(meta.token_seq.shape[-1]), float(kv.mean()), int(kv.max()))
        return fn(*args)
    return call


def step_ratios(config: Config, weights: dict, head: dict, prompts: np.ndarray, new_tokens: int, k: int,
                max_num_seqs: int = 16, repeats: int = 9, cpu_specs: dict | None = None) -> dict:
    """Each program of `engine_speculation`'s runs alone beside the cost model's price of it: the decode step (no
    drafts), the verify step and the draft step (k drafts), each captured at the first step of an untimed greedy run
    of `prompts` whose decode rows fill the bucket of `max_num_seqs` and that holds no prompt token (its arguments
    copied), then run `repeats` times, the three interleaved, the first round dropped (warm-up), the median kept.
    Priced by `step_time` on the `cpu` specs (`cpu_specs`, else this process's measurement), one device, for the
    same batch (D decode rows at their mean and longest context, the step's T computed tokens, one logit row a
    sequence): the draft step is `mtp_costs.mtp_head`'s components, the verify step the rest of the speculative step.
    Returns {"decode" | "verify" | "draft": {"measured_s", "predicted_s", "measured_over_predicted", "tokens",
    "context"}}; a program never captured (a run too short to fill the bucket) is left out."""
    from unittest import mock

    from qwen35_lib.costmodel import mtp_costs, ops
    from qwen35_lib.costmodel import specs as specs_lib
    from qwen35_lib.costmodel.step import pricing, step_time
    from qwen35_lib.engine import Engine
    from qwen35_lib.engine import engine as engine_module
    from qwen35_lib.engine.engine_config import EngineConfig
    from qwen35_lib.engine.sampling import SamplingParams
    from qwen35_lib.plan import SINGLE as plan

    N, P = prompts.shape
    S, programs = max_num_seqs, {}
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for drafts in (0, k):
        ec = EngineConfig(max_num_seqs=S, max_num_batched_tokens=S * (k + 1) + P, max_model_len=P + new_tokens + k + 1,
                          speculative_tokens=drafts)
        eng = Engine(config, weights, ec, mtp_weights=head if drafts else None)
        if drafts:
            eng.draft_fn = _capture(programs, "draft", eng.draft_fn, 8, S, k + 1)
            verify = _capture(programs, "verify", engine_module.verify_step, 5, S, k + 1)
        else:
            eng.step_fn = _capture(programs, "decode", eng.step_fn, 5, S, 1)
            verify = engine_module.verify_step
        with mock.patch.object(engine_module, "verify_step", verify):
            eng.generate(prompts.tolist(), params)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (fn, args, *_) in programs.items():
            fresh = _copy(args)
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            jax.block_until_ready(fn(*fresh))
            times[name].append(time.perf_counter() - start)
    sp = specs_lib.get("cpu", cpu_specs)
    out = {}
    for name, (_, _, T, ctx, longest) in programs.items():
        batch = ops.Batch(decodes=S, decode_ctx=ctx, max_ctx=longest, padded_tokens=T, logit_rows=S,
                          drafts=0 if name == "decode" else k)
        total = step_time(config, sp, plan, batch, None, 16).seconds
        pr = pricing(config, sp, plan, None, 16)
        draft = sum(ops.seconds(c, sp) for c in mtp_costs.mtp_head(config, batch, pr).values())
        predicted = {"decode": total, "verify": total - draft, "draft": draft}[name]
        measured = float(np.median(times[name][1:] or times[name]))
        out[name] = {"measured_s": measured, "predicted_s": predicted, "measured_over_predicted": measured / predicted,
                     "tokens": T, "context": ctx}
    return out
