"""What `python -m qwen35_lib info` reports: sizes of a model and, given a system, its memory budget.

`model_report` returns a JSON-ready dict (the `--json` output); `format_report` renders it as text.
Every number comes from `qwen35_lib.stats` (the weight declarations) and `qwen35_lib.budget`.
"""

from __future__ import annotations

from typing import Any

from qwen35_lib import budget as budget_lib
from qwen35_lib import hardware as hw
from qwen35_lib.config import FULL, LINEAR, Config
from qwen35_lib.stats import ModelStats, model_stats

PART_ORDER = ("routed_experts", "gdn", "attention", "shared_experts", "router", "embed", "lm_head", "norms")


def active_params_by_part(config: Config, stats: ModelStats | None = None) -> dict[str, int]:
    """Parameters each token uses, by part: all of every part, except top-k / E of the routed experts."""
    stats = stats or model_stats(config)
    active = dict(stats.params_by_part)
    active["routed_experts"] = active["routed_experts"] * config.num_experts_per_tok // config.num_experts
    assert sum(active.values()) == stats.active_params, (active, stats.active_params)
    return active


def human_bytes(n: float) -> str:
    """Bytes in binary units: `738.3 GiB`, `30.0 KiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def billions(n: float) -> str:
    return f"{n / 1e9:,.2f} B"


def model_report(config: Config, hardware: str | hw.Hardware | None = None, concurrency: int = 0,
                 context_len: int = 0, *, kv_dtype: str | None = None, spread: str = "even") -> dict[str, Any]:
    """Sizes of `config` (and its budget on `hardware`), as a JSON-ready dict."""
    stats = model_stats(config, kv_dtype=kv_dtype)
    types = config.layer_types
    report: dict[str, Any] = dict(
        model=config.name,
        dtype=config.dtype,
        expert_dtype=config.expert_dtype,
        kv_dtype=kv_dtype or config.dtype,
        gdn_state_dtype=config.gdn_state_dtype,
        layers=dict(total=len(types), gdn=types.count(LINEAR), attention=types.count(FULL),
                    pattern=["gdn" if t == LINEAR else "attention" for t in config.layer_pattern]),
        experts=dict(routed=config.num_experts, per_token=config.num_experts_per_tok, shared=1),
        total_params=stats.total_params,
        active_params=stats.active_params,
        params_by_part={p: stats.params_by_part[p] for p in PART_ORDER if p in stats.params_by_part},
        active_params_by_part={p: v for p, v in _ordered(active_params_by_part(config, stats)).items()},
        weight_bytes=stats.weight_bytes,
        weight_bytes_by_dtype=stats.weight_bytes_by_dtype,
        kv_bytes_per_token=stats.kv_bytes_per_token,
        gdn_state_bytes_per_seq=stats.gdn_state_bytes_per_seq,
        gdn_recurrent_bytes_per_seq=stats.gdn_recurrent_bytes_per_seq,
        gdn_conv_bytes_per_seq=stats.gdn_conv_bytes_per_seq,
    )
    if hardware is not None:
        hardware = hw.get(hardware) if isinstance(hardware, str) else hardware
        b = budget_lib.hbm_budget(config, hardware, concurrency, context_len, kv_dtype=kv_dtype, spread=spread)
        report["hardware"] = hardware.as_dict()
        report["budget"] = b.as_dict()
    return report


def _ordered(parts: dict[str, int]) -> dict[str, int]:
    return {p: parts[p] for p in PART_ORDER if p in parts}


def format_report(report: dict[str, Any]) -> str:
    """`model_report` as text, one fact a line."""
    r = report
    total, active = r["total_params"], r["active_params"]
    lines = [
        f"model {r['model']}: {r['layers']['total']} layers = {r['layers']['gdn']} Gated DeltaNet + "
        f"{r['layers']['attention']} attention (pattern {' '.join(r['layers']['pattern'])}), "
        f"{r['experts']['routed']} experts top-{r['experts']['per_token']} + {r['experts']['shared']} shared",
        f"parameters        {total:>19,}  ({billions(total)})",
        f"active per token  {active:>19,}  ({billions(active)}, {active / total:.1%})",
        f"  {'part':<16}{'total':>19}{'active':>19}",
    ]
    for part, n in r["params_by_part"].items():
        lines.append(f"  {part:<16}{n:>19,}{r['active_params_by_part'][part]:>19,}")
    lines.append(f"weights           {r['weight_bytes']:>19,} B ({human_bytes(r['weight_bytes'])})")
    for dtype, n in r["weight_bytes_by_dtype"].items():
        lines.append(f"  {dtype:<16}{n:>19,} B ({human_bytes(n)})")
    lines += [
        f"KV cache          {r['kv_bytes_per_token']:>19,} B per token ({r['kv_dtype']})",
        f"GDN state         {r['gdn_state_bytes_per_seq']:>19,} B per sequence ({r['gdn_state_dtype']} recurrent "
        f"{r['gdn_recurrent_bytes_per_seq']:,} B + conv {r['gdn_conv_bytes_per_seq']:,} B)",
    ]
    if "budget" in r:
        h, b = r["hardware"], r["budget"]
        lines += [
            f"hardware {h['name']}: {h['chips']} chips x {h['devices_per_chip']} devices, "
            f"{human_bytes(h['hbm_bytes_per_device'])} per device ({human_bytes(h['usable_hbm_bytes_per_device'])} "
            f"usable), {human_bytes(h['hbm_bytes'])} in all",
            f"weights per device {human_bytes(b['weight_bytes_per_device'])} ({b['spread']} spread): "
            + ("fit" if b["weights_fit"] else "DO NOT FIT"),
        ]
        if b["weights_fit"]:
            lines.append(f"left for caches   {human_bytes(b['free_bytes'])}: {b['max_kv_tokens']:,} tokens of KV "
                         f"cache, or {b['max_gdn_seqs']:,} sequences of GDN state")
        if b["concurrency"]:
            lines.append(
                f"{b['concurrency']} requests x {b['context_len']:,} tokens: KV {human_bytes(b['kv_cache_bytes'])} "
                f"+ GDN {human_bytes(b['gdn_state_bytes'])} = {human_bytes(b['cache_bytes'])}: "
                + (f"fit, {human_bytes(b['left_bytes'])} left" if b["fits"] else "DO NOT FIT")
                + f" (at most {b['max_concurrency']:,} such requests)")
        elif b["context_len"]:
            lines.append(f"at most {b['max_concurrency']:,} requests of {b['context_len']:,} tokens")
    return "\n".join(lines)
