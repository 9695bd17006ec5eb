"""`predict()`: throughput of a model on a system under a stage, for a workload at a concurrency.

1. specs of the system (`specs.get`), the stage (or a custom layout/routing), the serving setup: the token budget
   is one rule for every stage (`token_budget`): the slice's budget of tpu-inference's Qwen3.5 recipe at its
   DP 8 (`max-num-batched-tokens = max(ISL / DP_SIZE, 1024)` per rank, server.sh at b85a5eb05), split over the
   stage's ranks, so a stage's gain is never a scheduling difference; sequences the same way (`seq_budget`: the
   recipe's 64 a rank at its DP 8, 512 for the slice, over the stage's ranks); 10 x CONC prompts (InferenceX's
   bench.sh `num_prompts = 10 x CONC`);
2. memory (`memory`): weights per device under the layout, then how many requests of ISL + OSL tokens fit per rank
   (KV + GDN state); a model whose weights do not fit is reported so (`fits: False`) with no throughput;
3. the scheduler simulation (`schedule.simulate`, or `lockstep.lockstep` for DP ranks) with the step-time model
   (`step.step_time`), and the same schedule at the roofline bound (`ideal=True`);
4. whole-slice output and total (input + output) tokens/s, per chip, the step-time breakdown by component; with
   `band` or `explain`, the schedule re-timed under other mechanisms (`band`).
The prediction never reads published measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import numpy as np

from qwen35_lib import hardware as hw
from qwen35_lib.config import Config, get_config
from qwen35_lib.costmodel import assumptions, ops
from qwen35_lib.costmodel import specs as specs_lib
from qwen35_lib.costmodel.assumptions import Mechanisms, admit_lag, dp_dispatch
from qwen35_lib.costmodel.band import band_of, explain_of
from qwen35_lib.costmodel.lockstep import lockstep, price
from qwen35_lib.costmodel.memory import (
    engine_pools,
    request_bytes_per_device,
    resident_bytes_per_device,
    weight_bytes_per_device,
)
from qwen35_lib.costmodel.play import Speculation
from qwen35_lib.costmodel.retime import retimed_many
from qwen35_lib.costmodel.schedule import simulate
from qwen35_lib.costmodel.specs import Specs
from qwen35_lib.costmodel.step import bind_to, step_times
from qwen35_lib.plan import ServingPlan, any_stage

KV_DTYPES = tuple(ops.ITEMSIZE)  # float8_e4m3fn: one byte + a float32 scale per token and head


LOCKSTEP_RUNNING = 256  # ranks played in lockstep up to this many running requests each (the play grows with it);
# beyond, every rank's step is about its whole token budget, so the ranks are balanced and one rank stands for all
RECIPE_DP = 8  # the data-parallel size of tpu-inference's Qwen3.5 DP8_EP recipe, whose budget rule every stage uses
RECIPE_SOURCE = ("https://github.com/vllm-project/tpu-inference/blob/b85a5eb05bffa13f772d3916b8d54cac60bd7953/tests/e2e/"
                 "benchmarking/inferencex/qwen3.5/server.sh (MAX_NUM_BATCHED_TOKENS = max(ISL / DP_SIZE, 1024))")


RECIPE_MAX_SEQS = 64  # --max-num-seqs=64 of the recipe's server.sh: per rank under its DP scheduler
PROMPTS_PER_CLIENT = 10  # InferenceX's bench.sh: --num-prompts = 10 x CONC (the published runs' setup)


def seq_budget(dp: int) -> int:
    """Running sequences per rank: the recipe's slice figure RECIPE_DP x RECIPE_MAX_SEQS over `dp` ranks."""
    return max(1, RECIPE_DP * RECIPE_MAX_SEQS // dp)


def token_budget(isl: int, dp: int) -> int:
    """Tokens per step per rank: the recipe's slice budget RECIPE_DP x max(ISL / RECIPE_DP, 1024) over `dp` ranks
    (8k/1k and 1k/8k: 8,192 tokens a step for the slice under every stage)."""
    return max(1, RECIPE_DP * max(isl // RECIPE_DP, 1024) // dp)


def serving_model(name: str = "qwen3.5-397b-a17b", **changes: Any) -> Config:
    """The real serving configuration: FP8 (e4m3, block-scaled) experts and a bf16 GDN state (README: the FP8 checkpoint
    is the one that fits a TPU7x-8 with room for the caches)."""
    base = dict(expert_dtype="float8_e4m3fn", gdn_state_dtype="bfloat16")
    base.update(changes)
    return get_config(name, **base)




def predict(model: str | Config = "qwen3.5-397b-a17b", hardware: str | Specs = "tpu7x-8",
            stage: str | ServingPlan = "kernels", isl: int = 8192, osl: int = 1024, concurrency: int = 512, *,
            max_batched_tokens: int | None = None, max_seqs: int | None = None,
            kv_dtype: str | None = "float8_e4m3fn", page_size: int = 256,
            num_prompts: int | None = None, range_ratio: float = 0.8, seed: int = 0, roofline: bool = True,
            overlap: bool = True, mechanisms: str | Mechanisms = "nominal", band: bool = False,
            explain: bool = False, speculative_tokens: int = 0, acceptance_length: float | None = None) -> dict:
    """Predicted serving throughput (see the module doc). Returns a JSON-able dict:
    `output_tokens_per_s`, `total_tokens_per_s` (whole slice), `..._per_chip`, `breakdown_s` (per step, mean),
    `breakdown_fraction`, `roofline_total_tokens_per_s`, `fraction_of_roofline`, `median_ttft_s`,
    `median_tpot_s` (time to first token; per output token after the first), `fits`, the setup used.
    A stage whose plan sets `kv_dtype` / `gdn_state_dtype` uses those; else `kv_dtype` and the model's.
    `mechanisms`: "nominal" (every labelled assumption of data/costmodel_assumptions.json at its value: ranks in
    lockstep, padding, overlap, host time, ...), "off" (the model without them: balanced ranks, serial
    collectives), or a `Mechanisms`. `band`: also `band` (the one-at-a-time extremes of the swept assumptions and
    their joint corners, `band_of`); `explain`: also `explain` (`explain_of`).
    `speculative_tokens` k > 0: speculative decoding with the MTP head (`speculation_of`): each decoding sequence
    verifies k drafts a step (k + 1 query tokens through every layer, the head's draft step, the GDN checkpoints:
    `ops.Batch.drafts`) and emits `acceptance_length` tokens a step (None: the labelled assumption
    `assumptions.acceptance_length(k)`); the checkpoints, the head's weights and its KV pool enter the memory check;
    the document gains `speculation` (the setup, its assumption and the gain over k = 0, with its band over the
    assumption's range when `band`)."""
    check_arguments(isl=isl, osl=osl, concurrency=concurrency, max_batched_tokens=max_batched_tokens,
                    max_seqs=max_seqs, kv_dtype=kv_dtype, page_size=page_size, num_prompts=num_prompts,
                    range_ratio=range_ratio)
    k = _drafts(speculative_tokens)
    spec = Speculation(k, acceptance_length if acceptance_length is not None and k else
                       assumptions.acceptance_length(k))  # checks 1 <= A <= k + 1
    cfg = serving_model(model) if isinstance(model, str) else model
    sp = specs_lib.get(hardware) if isinstance(hardware, str) else hardware
    st = any_stage(stage)
    lay = bind_to(st, cfg, sp, kv_dtype)  # the one binding: every step below reads this plan
    kv_dtype = lay.kv_dtype  # the bound plan's cache dtypes: a plan that names them decides them
    cfg = cfg.replace(gdn_state_dtype=lay.gdn_state_dtype)
    budget = max_batched_tokens if max_batched_tokens is not None else token_budget(isl, lay.dp)
    seqs = max_seqs if max_seqs is not None else seq_budget(lay.dp)
    num_prompts = num_prompts if num_prompts is not None else PROMPTS_PER_CLIENT * concurrency
    usable = sp.usable_hbm_bytes
    w = weight_bytes_per_device(cfg, sp, lay)
    per_req = request_bytes_per_device(cfg, sp, lay, isl + osl, kv_dtype, page_size, k)
    fixed = sum(resident_bytes_per_device(cfg, sp, lay, 1, isl + osl, kv_dtype, page_size, k).values()) - per_req
    # (weights, the null page and the null slot)
    # requests one rank can hold: a DP device holds its own; a TP device holds a share of every request
    max_running = hw.capacity(usable - fixed, per_req)
    doc: dict[str, Any] = dict(
        model=cfg.name, hardware=sp.name, stage=st.name, layout=lay.layout, routing=st.routing,
        fuse_allgather=st.fuse_allgather, hierarchical_rs=st.hierarchical_rs, kernels=st.kernels,
        isl=isl, osl=osl, range_ratio=range_ratio, concurrency=concurrency, dp=lay.dp, tp=lay.tp, chips=sp.chips,
        devices=sp.devices,
        max_batched_tokens_per_rank=budget, max_seqs_per_rank=seqs, kv_dtype=kv_dtype or cfg.dtype,
        weight_bytes_per_device=w, usable_hbm_bytes_per_device=usable, request_bytes_per_device=per_req,
        max_running_per_rank=max_running, fits=max_running >= 1)
    if k:
        doc["speculation"] = speculation_of(cfg, sp, lay, spec, acceptance_length is None, isl + osl, kv_dtype,
                                            page_size)
    if not doc["fits"]:
        doc["reason"] = (f"weights need {w / 2**30:.1f} GiB per device of {usable / 2**30:.1f} GiB usable, leaving no "
                         f"room for one request of {isl + osl} tokens ({per_req / 2**30:.2f} GiB)")
        return doc

    mech = _mechanisms(mechanisms)
    doc["mechanisms"] = "off" if mech == Mechanisms.off() else dataclasses.asdict(mech)
    pools = engine_pools(cfg, sp, lay, min(max_running, seqs), isl + osl, kv_dtype, page_size, k)
    doc["cache_pool_bytes_per_layer"] = dataclasses.asdict(pools)

    fn = _StepTimer(cfg, sp, lay, kv_dtype, page_size, overlap, mech, pools)
    use_lockstep = functools.partial(_use_lockstep, dp=lay.dp, limit=min(seqs, max_running, budget + 1))
    doc["dp_lockstep_applied"] = use_lockstep(mech)
    if use_lockstep(mech):
        ls = lockstep(isl, osl, concurrency, lay.dp, budget, seqs, max_running, num_prompts, seed, range_ratio,
                      padding=mech.token_padding, dispatch=dp_dispatch(mech),
                      admit_lag=admit_lag(mech), spec=spec)
        sim = price(ls, fn(False))
    else:
        sim = simulate(fn(False), isl, osl, concurrency, lay.dp, budget, seqs, max_running, num_prompts, seed,
                       range_ratio, admit_lag(mech), spec)
    doc.update(
        requests_per_rank=sim.requests, played_requests_per_rank=sim.played,
        output_tokens_per_s=sim.output_tokens_per_s, total_tokens_per_s=sim.total_tokens_per_s,
        output_tokens_per_s_per_chip=sim.output_tokens_per_s / sp.chips,
        total_tokens_per_s_per_chip=sim.total_tokens_per_s / sp.chips,
        seconds=sim.seconds, steps=sim.steps, mean_step_s=sim.seconds / sim.steps,
        mean_decode_batch=sim.mean_decode_batch, mean_running_per_rank=sim.mean_running,
        median_ttft_s=sim.median_ttft_s, median_tpot_s=sim.median_tpot_s,
        median_itl_s=sim.median_itl_s, p99_itl_s=sim.p99_itl_s,
        breakdown_s={k: v / sim.steps for k, v in sim.breakdown.items()},
        breakdown_fraction={k: v / sim.seconds for k, v in sim.breakdown.items()})
    if roofline:
        ideal = simulate(fn(True), isl, osl, concurrency, lay.dp, budget, seqs, max_running, num_prompts, seed,
                         range_ratio, admit_lag(mech), spec)
        doc.update(roofline_total_tokens_per_s=ideal.total_tokens_per_s,
                   roofline_output_tokens_per_s=ideal.output_tokens_per_s,
                   fraction_of_roofline=sim.total_tokens_per_s / ideal.total_tokens_per_s)

    def rerun(m: Mechanisms):  # the same schedule (step times do not change it), re-timed
        if use_lockstep(m):
            return price(lockstep(isl, osl, concurrency, lay.dp, budget, seqs, max_running, num_prompts, seed,
                                  range_ratio, padding=m.token_padding,
                                  dispatch=dp_dispatch(m), admit_lag=admit_lag(m),
                                  spec=spec), fn(False, m))
        return simulate(fn(False, m), isl, osl, concurrency, lay.dp, budget, seqs, max_running, num_prompts, seed,
                        range_ratio, admit_lag(m), spec)

    if band:
        doc["band"] = band_of(sim, mech, rerun)
    if explain:
        doc["explain"] = explain_of(sim, mech, rerun)
    if k:
        again = dict(model=cfg, hardware=sp, stage=st, isl=isl, osl=osl, concurrency=concurrency,
                     max_batched_tokens=max_batched_tokens, max_seqs=max_seqs, kv_dtype=kv_dtype, page_size=page_size,
                     num_prompts=num_prompts, range_ratio=range_ratio, seed=seed, roofline=False, overlap=overlap,
                     mechanisms=mech)
        _speculation_gain(doc, again, k, band=band and acceptance_length is None)
    return doc


class _StepTimer:
    """`fn(ideal, m)`: a schedule's distinct steps timed at once (`StepsFn`) under mechanisms `m` (default: the
    prediction's), with the GDN layers' fixed time added (`layer_fixed`). The nominal mechanisms' components are kept
    by schedule ({batches: {component: seconds [n]}}, without `layer_fixed`'s time), so that the band's rescaled ends
    re-time them (`retimed_many`) instead of pricing them again (a rescaled mechanism never changes the schedule)."""

    def __init__(self, cfg: Config, sp: Specs, lay, kv_dtype: str | None, page_size: int, overlap: bool,
                 mech: Mechanisms, pools):
        self.cfg, self.sp, self.lay, self.kv_dtype, self.page_size = cfg, sp, lay, kv_dtype, page_size
        self.overlap, self.mech, self.pools = overlap, mech, pools
        self.nominal: dict[tuple[ops.Batch, ...], dict[str, np.ndarray]] = {}
        self.n_gdn = ops.sizes(cfg)["n_gdn"] if sp.kind == "tpu" else 0

    def layer_fixed(self, parts: dict[str, np.ndarray], m: Mechanisms) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The step's seconds and components with the GDN layers' fixed time (`gdn_layer_fixed_s` a layer, on a
        TPU) added to `gdn_core`: a time below the roofline, which the ideal schedule leaves out."""
        if self.n_gdn and m.gdn_layer_fixed_s:
            parts = dict(parts, gdn_core=parts["gdn_core"] + self.n_gdn * m.gdn_layer_fixed_s)
        return sum(parts.values()), parts

    def __call__(self, ideal: bool, m: Mechanisms | None = None):
        m = self.mech if m is None else m

        def run(batches: tuple[ops.Batch, ...]):
            if not ideal and m is not self.mech and batches in self.nominal:
                fast = retimed_many(self.cfg, self.sp, self.lay, batches, self.nominal[batches], self.mech, m)
                if fast is not None:
                    return self.layer_fixed(fast, m)
            secs, parts = step_times(self.cfg, self.sp, self.lay, batches, self.kv_dtype, self.page_size, ideal=ideal,
                                     overlap=self.overlap, mech=m, pools=self.pools)
            if not ideal and m is self.mech:
                self.nominal[batches] = parts
            return (secs, parts) if ideal else self.layer_fixed(parts, m)
        return run


def _use_lockstep(m: Mechanisms, dp: int, limit: int) -> bool:
    """The ranks played in lockstep: with `dp_lockstep`, DP > 1 and at most LOCKSTEP_RUNNING requests a rank
    (beyond, a rank fills its budget every step)."""
    return m.dp_lockstep and dp > 1 and limit <= LOCKSTEP_RUNNING


def _speculation_gain(doc: dict, again: dict, k: int, band: bool) -> None:
    """`doc["speculation"]` gains the prediction without drafts (`again`: the same setup) and the output gain over
    it; with `band`, the gain at the acceptance assumption's two ends, which widen `doc["band"]`."""
    base = predict(**again)
    s = doc["speculation"]
    s["without"] = {key: base.get(key) for key in ("output_tokens_per_s", "total_tokens_per_s", "median_tpot_s",
                                                    "max_running_per_rank")}

    def gain(r: dict) -> float | None:
        return r["output_tokens_per_s"] / base["output_tokens_per_s"] if r.get("fits") and base.get("fits") else None

    s["output_gain"] = gain(doc)
    if not band:
        return
    ends = {end: predict(**again, speculative_tokens=k, acceptance_length=assumptions.acceptance_length(k, end))
            for end in ("low", "high")}  # the assumption's range, the other assumptions nominal
    s["output_gain_band"] = [gain(ends["low"]), gain(ends["high"])]
    tot = [doc["band"]["total_tokens_per_s"][0], doc["band"]["total_tokens_per_s"][1],
           *(e["total_tokens_per_s"] for e in ends.values())]
    doc["band"]["total_tokens_per_s"] = [min(tot), max(tot)]
    doc["band"]["high_over_low"] = max(tot) / min(tot)
    doc["band"]["extremes"] += [dict(assumption=assumptions.ACCEPTANCE, end=end, value=s[f"acceptance_{end}"],
                                     total_tokens_per_s=e["total_tokens_per_s"], median_tpot_s=e["median_tpot_s"],
                                     median_ttft_s=e["median_ttft_s"]) for end, e in ends.items()]


def speculation_of(cfg: Config, sp: Specs, lay, spec: Speculation, assumed: bool, tokens: int,
                   kv_dtype: str | None, page_size: int) -> dict:
    """The speculative setup of a prediction: drafts, the acceptance length (and the assumption it comes from when
    `assumed`, with its range at these drafts), and what speculation adds to one device's memory for one request
    of `tokens` tokens (its GDN checkpoints and its pages of the head's KV pool) and once (the head's weights)."""
    rec = assumptions.records()[assumptions.ACCEPTANCE]
    k = spec.drafts
    (one, two), (one_k, two_k) = ([resident_bytes_per_device(cfg, sp, lay, n, tokens, kv_dtype, page_size, d)
                                   for n in (1, 2)] for d in (0, k))
    out = dict(speculative_tokens=k, acceptance_length=spec.acceptance,
               acceptance_source="assumption" if assumed else "given",
               mtp_weight_bytes_per_device=one_k["mtp_weight_bytes"],
               gdn_checkpoint_bytes_per_request=(two_k["gdn_state_bytes"] - one_k["gdn_state_bytes"])
               - (two["gdn_state_bytes"] - one["gdn_state_bytes"]),
               mtp_kv_bytes_per_request=two_k["mtp_kv_bytes"] - one_k["mtp_kv_bytes"])
    if assumed:
        out.update(assumption=assumptions.ACCEPTANCE, assumption_source=rec["source"], assumption_quote=rec["quote"],
                   assumption_drafts=rec["drafts"], acceptance_low=assumptions.acceptance_length(k, "low"),
                   acceptance_high=assumptions.acceptance_length(k, "high"))
    return out


def _drafts(speculative_tokens) -> int:
    if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, numbers.Integral) or \
            speculative_tokens < 0:
        raise ValueError(f"speculative_tokens={speculative_tokens!r} (--speculative-tokens): drafts a sequence "
                         "verifies a step must be an integer >= 0")
    return int(speculative_tokens)


def _mechanisms(m: str | Mechanisms) -> Mechanisms:
    if isinstance(m, Mechanisms):
        return m
    if m == "nominal":
        return Mechanisms.nominal()
    if m == "off":
        return Mechanisms.off()
    raise ValueError(f"mechanisms={m!r}: use 'nominal', 'off' or an assumptions.Mechanisms")




POSITIVE = {"isl": "input tokens per request", "osl": "output tokens per request",
            "concurrency": "requests in flight", "max_batched_tokens": "token budget per step per DP rank",
            "max_seqs": "running sequences per DP rank", "page_size": "tokens per KV-cache page",
            "num_prompts": "requests in the benchmark"}


def check_arguments(**values: Any) -> None:
    """`predict`'s workload and serving arguments: counts are integers >= 1 (None: the default, where there is
    one); `kv_dtype` one of `KV_DTYPES` or None (the model's dtype)."""
    for name, value in values.items():
        if name == "range_ratio":
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
                raise ValueError(f"range_ratio={value!r} (--range-ratio): lengths are drawn from [r L, L]; "
                                 "r must be in (0, 1]")
            continue
        if name == "kv_dtype":
            if value is not None and value not in KV_DTYPES:
                raise ValueError(f"kv_dtype={value!r} is not a KV-cache dtype; use one of {', '.join(KV_DTYPES)}")
            continue
        if value is None and name in ("max_batched_tokens", "max_seqs", "num_prompts"):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            flag = f" (--{name.replace('_', '-')})" if name not in ("page_size", "num_prompts") else ""
            raise ValueError(f"{name}={value!r}{flag}: {POSITIVE[name]} must be an integer >= 1")


__all__ = ["KV_DTYPES", "PROMPTS_PER_CLIENT", "RECIPE_DP", "RECIPE_MAX_SEQS", "check_arguments", "predict",
           "request_bytes_per_device", "resident_bytes_per_device", "seq_budget", "serving_model", "token_budget",
           "weight_bytes_per_device"]
