"""The labelled assumptions of the serving mechanisms (data/costmodel_assumptions.json) and the `Mechanisms` record
the step-time model reads.

Every record has a source URL, a quote or figure from it, a nominal value and a low-high range fixed before any
comparison (`check`: a record missing one is an error). `Mechanisms.nominal()` is every value at its nominal;
`Mechanisms.off()` is the old model (no mechanism: ranks balanced, collectives serial, no host time).
`extremes()` lists the one-at-a-time variations of the band: (name, end, Mechanisms) for each 'range' record.
"""

from __future__ import annotations

import dataclasses
import functools

from qwen35_lib import data

FILE = "costmodel_assumptions.json"
KINDS = ("range", "derived", "computed", "setup", "option")  # derived: set from measured data, swept like a range;
# option: read only where an option asks for it (predict --speculative-tokens), which sweeps its range itself
SWEPT = ("range", "derived")
REQUIRED = ("mechanism", "kind", "source", "quote", "value", "low", "high", "range_fixed")


@functools.cache
def records() -> dict[str, dict]:
    """{name: record} of data/costmodel_assumptions.json, each checked (`check`)."""
    table = data.read_json(FILE)["assumptions"]
    for name, rec in table.items():
        check(name, rec)
    return dict(table)


def check(name: str, rec: dict) -> None:
    """A record names its source (a URL), a quote, a nominal value and a range holding it."""
    missing = [k for k in REQUIRED if k not in rec or rec[k] in ("", None)]
    if missing:
        raise ValueError(f"{FILE} assumption {name!r} lacks {', '.join(missing)}: every mechanism needs a source URL, "
                         "a quote, a value and a low-high range fixed before comparison")
    if not str(rec["source"]).startswith("https://"):
        raise ValueError(f"{FILE} assumption {name!r}: source {rec['source']!r} is not a URL; cite where it was read")
    if rec["kind"] not in KINDS:
        raise ValueError(f"{FILE} assumption {name!r}: kind {rec['kind']!r} is not one of {', '.join(KINDS)}")
    if rec["kind"] in (*SWEPT, "option") and not rec["low"] <= rec["value"] <= rec["high"]:
        raise ValueError(f"{FILE} assumption {name!r}: value {rec['value']} lies outside its range "
                         f"[{rec['low']}, {rec['high']}]")


@dataclasses.dataclass(frozen=True)
class Mechanisms:
    """The mechanism values one prediction uses (names as the records')."""

    dp_lockstep: bool = False
    dp_batch_prefill: bool = False  # the DP scheduler holds new requests until dp of them wait (with dp_lockstep)
    token_padding: bool = False
    gmm_tile_rows: int = 0  # 0: ideal rows
    fp8_allgather: bool = False
    async_scheduling: bool = False  # host work overlaps the device step: only host_step_overhead_s stays on it
    host_step_overhead_s: float = 0.0
    host_step_time_sync_s: float = 0.0  # the whole host turnaround a step, with async_scheduling off
    expert_imbalance: float = 1.0
    collective_overlap: float = 0.0
    fused_combine_overlap: float = 0.0  # fused_ep: the fraction of the grouped matmul its combine hides behind
    sparsecore_permute: float = 1.0
    attention_kernel_efficiency: float | None = None  # None: the HBM efficiency of every read
    mixed_step_attention: float = 1.0
    matmul_efficiency: float | None = None  # None: the specs' own
    hbm_efficiency: float | None = None
    ici_efficiency: float | None = None
    onehot_permute_threshold: int = 0  # production's MoE permutes by one-hot matmuls while N·k <= this (0: never)
    moe_row_overhead_s: float = 0.0  # seconds a routed row of the slice costs every device (`moe_layer`)
    moe_layer_fixed_s: float = 0.0  # seconds a MoE layer call costs every device outside its grouped matmul, whatever
    # its rows (`moe_layer`)
    admission_lag: bool = False  # a client's next request waits for the engine's steps in flight (`admit_lag`)
    request_path_steps: int = 0  # steps more it needs to reach the engine core (HTTP, chat template, tokenizer)
    gdn_layer_fixed_s: float = 0.0  # device seconds each GDN layer's core costs a step whatever its tokens (TPU)

    @classmethod
    def off(cls) -> Mechanisms:
        return cls()

    @classmethod
    def nominal(cls, **changes) -> Mechanisms:
        recs = records()
        vals = {f.name: _field_value(f.name, recs[f.name]["value"]) for f in dataclasses.fields(cls)}
        vals.update(changes)
        return cls(**vals)

    def neutral(self, name: str) -> Mechanisms:
        """This record with mechanism `name` switched to the old model's value (its contribution removed)."""
        return dataclasses.replace(self, **{name: getattr(Mechanisms.off(), name)})


def admit_lag(m: Mechanisms) -> int:
    """Steps a client's next request waits, after the step whose outputs ended its last one, before a schedule can
    include it (`play.ADMISSION_LAG`): the steps the engine core has in flight when it next reads its input queue
    (2 with async scheduling's batch queue of 2, 1 without) plus `request_path_steps`; 0 with `admission_lag` off."""
    if not m.admission_lag:
        return 0
    return (2 if m.async_scheduling else 1) + int(round(m.request_path_steps))  # whole steps (a slider's value)


def dp_dispatch(m: Mechanisms) -> str:
    """How tpu-inference's DP scheduler routes a new request (`lockstep.play_dp`'s dispatch): "batch" (held until dp
    of them wait, or as many ranks were idle in its newest schedule) with `dp_batch_prefill` and async scheduling;
    "each" (routed as it arrives) otherwise. Without async scheduling the hold never holds: `_count_idle_ranks` reads
    the newest cached schedule and counts every rank idle when none is cached, `update_from_output` drops the cached
    schedule, and vLLM's synchronous engine step updates from its output before the core reads its input queue; with
    async scheduling's batch queue of 2 the step in flight keeps its schedule cached while the core reads new
    requests (`data/costmodel_assumptions.json`, dp_batch_prefill)."""
    return "batch" if m.dp_batch_prefill and m.async_scheduling else "each"


def _field_value(name: str, v):
    if name == "token_padding":
        return v == "pow2"
    return v


def extremes(base: Mechanisms | None = None) -> list[tuple[str, str, Mechanisms]]:
    """(name, "low" | "high", the nominal with that one value at its end) for every swept ('range' or 'derived')
    assumption that the mechanisms `base` read (the host time not in force under its scheduling switch is
    skipped)."""
    base = base or Mechanisms.nominal()
    idle = "host_step_time_sync_s" if base.async_scheduling else "host_step_overhead_s"
    out = []
    for name, rec in records().items():
        if rec["kind"] not in SWEPT or name == idle:
            continue
        for end in ("low", "high"):
            out.append((name, end, dataclasses.replace(base, **{name: rec[end]})))
    return out


ACCEPTANCE = "mtp_acceptance_length"


def acceptance_length(drafts: int, end: str = "value") -> float:
    """The acceptance length (tokens a decoding sequence emits per verify step, 1 + drafts accepted) of `drafts`
    MTP drafts a step, at the record's `end` ("value", "low" or "high"): the record's own figure at its draft count;
    at another count, 1 + p + ... + p^drafts with p the constant per-draft acceptance rate that gives the record's
    figure at its count (bisection). 1 without drafts."""
    rec = records()[ACCEPTANCE]
    a, k0 = float(rec[end]), int(rec["drafts"])
    if drafts == 0 or drafts == k0:
        return a if drafts else 1.0
    length = lambda p, k: sum(p**i for i in range(k + 1))  # noqa: E731
    lo, hi = 0.0, 1.0
    for _ in range(60):
        lo, hi = ((lo + hi) / 2, hi) if length((lo + hi) / 2, k0) < a else (lo, (lo + hi) / 2)
    return length((lo + hi) / 2, drafts)


COMPONENT_ASSUMPTIONS = {  # component -> the assumptions its time rests on (besides the op's roofline)
    "attn_core": ("attention_kernel_efficiency", "mixed_step_attention", "hbm_efficiency", "dp_lockstep"),
    "gdn_core": ("gdn_layer_fixed_s", "matmul_efficiency", "hbm_efficiency", "dp_lockstep", "dp_batch_prefill",
                 "token_padding"),
    "cache_copies": ("hbm_efficiency",),
    "routed_experts": ("expert_imbalance", "gmm_tile_rows", "moe_chunk", "matmul_efficiency", "hbm_efficiency",
                       "dp_lockstep", "token_padding"),
    "permute": ("sparsecore_permute", "onehot_permute_threshold", "hbm_efficiency", "token_padding"),
    "onehot_permute": ("onehot_permute_threshold", "matmul_efficiency", "token_padding"),
    "moe_rows": ("moe_row_overhead_s", "moe_layer_fixed_s", "token_padding"),
    "all_gather": ("ici_efficiency", "collective_overlap", "fp8_allgather", "token_padding"),
    "reduce_scatter": ("ici_efficiency", "collective_overlap", "moe_chunk", "token_padding"),
    "all_reduce": ("ici_efficiency", "collective_overlap"),
    "all_to_all": ("ici_efficiency", "collective_overlap", "fused_combine_overlap"),
    "host": ("async_scheduling", "host_step_overhead_s", "host_step_time_sync_s"),
    "dp": ("dp_lockstep", "dp_batch_prefill", "token_padding"),
}
DEFAULT_COMPONENT = ("matmul_efficiency", "hbm_efficiency", "dp_lockstep", "dp_batch_prefill", "token_padding")


def component_assumptions(component: str) -> tuple[str, ...]:
    return COMPONENT_ASSUMPTIONS.get(component, DEFAULT_COMPONENT)


__all__ = ["ACCEPTANCE", "COMPONENT_ASSUMPTIONS", "Mechanisms", "acceptance_length", "admit_lag", "check",
           "component_assumptions", "dp_dispatch", "extremes", "records"]
