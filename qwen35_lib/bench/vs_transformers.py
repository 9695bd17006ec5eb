"""`python -m qwen35_lib.bench vs-transformers`: prefill throughput of our jitted `forward` vs HF transformers.

Both sides run the same random weights in float32 on the CPU: the HF model (`Qwen3_5MoeForCausalLM`, eager
PyTorch under `torch.no_grad`, its default attention and experts implementations, torch threads = cores) is
saved with `save_pretrained` and loaded into ours with `load_hf_checkpoint`, so the converter is exercised too.
Per (batch, seq) shape: the logits' max |Δ|, and tokens/s of each side, timed interleaved, and their ratio; and
each side's fraction of this machine's matmul roofline: the prefill's FLOPs (`bench.roofline.prefill_flops`) over
its measured time, over XLA:CPU's float32 matmul FLOP/s measured in the same run. Then (`--profile-steps`) our
forward of each shape profiled per component beside each component's floors (`bench.profile`). The ratios to
transformers are withheld, saying why, when other jobs held the cores during the timing (`timing.BusyMonitor`):
the fractions of the roofline, measured in the same run, stand.
Needs the `reference` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np

from qwen35_lib.bench.closed_loop import knobs
from qwen35_lib.bench.timing import (
    BusyMonitor,
    environment,
    format_table,
    measure,
    native_isa_text,
    ratio_text,
    warn_if_busy,
    xla_cpu_threads,
)
from qwen35_lib.config import Config, get_config
from qwen35_lib.plan import SINGLE, ServingPlan
from qwen35_lib.versions import installed_version

DESCRIPTION = "prefill tokens/s: our jitted forward vs HF transformers eager (float32, same random weights)"
DEFAULT_SHAPES = "1x512,4x256,1x2048"
OFF = 1e-3  # logits further apart than this at a position: count it (top-k routing ties flip a few)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3.5-mini", help="a Qwen3.5 preset (default: %(default)s)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="BATCHxSEQ prefill shapes (default: %(default)s)")
    p.add_argument("--moe-kernel", default="auto", help="our moe_matmul implementation (default: %(default)s)")
    p.add_argument("--hf-experts", help="transformers experts_implementation (default: transformers' own)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seeds the HF weights and the token ids")
    p.add_argument("--profile-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="profile our forward per shape: time per component beside its floor (default: on)")


def run(args: argparse.Namespace) -> dict:
    """1. Build the seeded random HF model for the preset; save it; load it with `load_hf_checkpoint`.
    2. For each shape: random token ids; time our forward and HF's side by side (warm-up compiles ours).
    3. Check the logits agree (max |Δ| from the warm-up outputs, and how many positions are off by more than
       `OFF`); print the table; return the JSON document.
    """
    from qwen35_lib.bench import profile as prof
    from qwen35_lib.bench.roofline import copy_bandwidth, matmul_flops
    from qwen35_lib.checkpoint import load_hf_checkpoint
    from qwen35_lib.model import forward
    from qwen35_lib.parallel.parallelism import parallelism
    from qwen35_lib.plan import SINGLE

    torch = _import_reference()
    load_before = warn_if_busy()
    config = get_config(args.model)
    shapes = parse_shapes(args.shapes)
    torch.set_num_threads(args.threads)
    hf = _hf_model(config, args.seed, args.hf_experts)
    with tempfile.TemporaryDirectory(prefix="qwen35_bench_") as tmp:
        hf.save_pretrained(tmp)
        ours, weights = load_hf_checkpoint(tmp, dtype="float32")
    check_same_model(config, ours)
    local = parallelism(SINGLE.replace(moe_kernel=args.moe_kernel))  # "auto": the platform's default
    moe_kernel = local.plan.kernel("moe_matmul")
    hf_impl = {"attention": hf.config._attn_implementation, "experts": hf.config._experts_implementation}
    print(f"prefill, float32 on both sides, {config.name} random weights (seed {args.seed}); ours: jitted forward, "
          f"moe_matmul={moe_kernel}, native kernels {native_isa_text()}; "
          f"transformers {installed_version('transformers')} "
          f"eager (torch {torch.__version__}, "
          f"{args.threads} threads, attention={hf_impl['attention']}, experts={hf_impl['experts']}); ours on "
          f"{xla_cpu_threads()} XLA:CPU threads; "
          f"median of {args.repeats}, interleaved, {args.settle} untimed call(s) before each")

    peak, bandwidth = matmul_flops(), copy_bandwidth()
    print(f"this machine now: XLA:CPU float32 matmul {peak / 1e9:.1f} GFLOP/s (1024^3, best of 5): the roofline; "
          f"numpy copy {bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(args.seed)
    results = []
    with BusyMonitor() as monitor:
        for B, T in shapes:
            ids = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)
            results.append(_measure_shape(lambda ids=ids: forward(ours, weights, ids, parallelism=local), hf, ids, args)
                           | _roofline(config, B, T, peak))
    load = monitor.result()
    for r in results:
        r["matmul_roofline"] |= {n: r["matmul_roofline"]["flops"] / r["timings"][n]["median_s"] / peak
                                 for n in ("ours", "transformers")}
    _print_table(results, load)
    geo = float(np.exp(np.mean([np.log(r["speedup"]) for r in results])))
    print(f"geometric-mean speedup of ours over transformers (prefill): {ratio_text(geo, load)} (float32, CPU)")
    print(f"load: {load['loadavg_1m_before']} before, {load['loadavg_1m_after']} after on {load['cores']} cores; "
          f"this process {100 * (load['cpu_share'] or 0):.0f}% of the cores, others "
          f"{load['others_cores'] if load['others_cores'] is None else round(load['others_cores'], 2)} cores")
    if args.profile_steps:
        for (B, T), r in zip(shapes, results):
            ids = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)
            r["profile"] = _profile_forward(ours, weights, ids, r, bandwidth, peak, local)
            prof.print_summary(f"ours {B}x{T}, where the time goes (jax.profiler) beside each component's floor",
                               r["profile"])
    return {
        "benchmark": "vs-transformers",
        "model": config.name,
        "dtype": "float32",
        "repeats": args.repeats,
        "settle": args.settle,
        "ours": {"moe_kernel": moe_kernel, "jit": True, "threads": xla_cpu_threads()},
        "transformers": {"version": installed_version("transformers"), "torch": torch.__version__,
                         "threads": args.threads,
                         "mode": "eager, torch.no_grad, use_cache=False", **hf_impl},
        "shapes": results,
        "geomean_speedup": geo,
        "ratios_withheld": load["withhold_ratios"],
        "load": load,
        "matmul_gflop_s": peak / 1e9,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "environment": environment(loadavg_1m_before=load_before),
    }


def _measure_shape(ours_forward, hf, ids: np.ndarray, args: argparse.Namespace) -> dict:
    """Time both sides on one [B, T] batch of token ids; compare their logits (from the warm-up calls)."""
    import torch

    B, T = ids.shape
    ids_torch = torch.from_numpy(ids.astype(np.int64))

    def hf_forward():
        with torch.no_grad():
            return hf(input_ids=ids_torch, use_cache=False).logits

    timings, outputs = measure({"ours": ours_forward, "transformers": hf_forward}, repeats=args.repeats, warmup=2,
                               settle=args.settle, desc=f"{B}x{T}")
    ref = outputs["transformers"].float().numpy()
    err = np.max(np.abs(np.asarray(outputs["ours"], np.float32) - ref), axis=-1)  # [B, T] per position
    tps = {n: B * T / t.median for n, t in timings.items()}
    return {"batch": B, "seq": T, "tokens": B * T, "tokens_per_s": tps, "speedup": tps["ours"] / tps["transformers"],
            "max_abs_logit_diff": float(err.max()), f"positions_over_{OFF:g}": int(np.sum(err > OFF)),
            "max_abs_logit": float(np.max(np.abs(ref))), "timings": {n: t.to_json() for n, t in timings.items()}}


def _profile_forward(config: Config, weights: dict, ids: np.ndarray, result: dict, bandwidth: float,
                     peak: float, parallelism=None) -> dict:
    """Our forward of `ids` profiled (`bench.profile`, two calls): each component's ms beside its floors
    (`roofline.step_components` of B rows of T tokens, the LM head on every token); the host row is the measured
    median minus the profiled executable's wall time (dispatch, argument checks)."""
    import jax

    from qwen35_lib.bench import profile as prof
    from qwen35_lib.bench.roofline import component_floors, step_components
    from qwen35_lib.model import forward
    from qwen35_lib.model.decoder import lower_forward

    B, T = ids.shape
    lengths = np.full((B,), T, np.int32)
    names = prof.op_names(lower_forward(config, weights, ids, lengths, parallelism).compile().as_text())
    lines = prof.trace(lambda: jax.block_until_ready(forward(config, weights, ids, parallelism=parallelism)), calls=2)
    module = "jit_forward_prepared"
    per_run = prof.component_times(lines, names, module)
    walls = prof.execution_walls(lines, module)
    runs = prof.execution_order(lines, module)
    floors = component_floors(step_components(config, [T] * B, [T] * B, B * T), bandwidth, peak)
    wall_ms = 1e3 * float(np.mean([walls[r] for r in runs])) if runs else 0.0
    host = max(0.0, 1e3 * result["timings"]["ours"]["median_s"] - wall_ms)
    out = prof.summarize(per_run, runs, [floors] * len(runs), walls, host, "host (median - executable)")
    return out | {"top_ops": prof.top_ops(lines, names, module, runs)}


def _roofline(config: Config, B: int, T: int, peak: float) -> dict:
    """The FLOPs of a B x T prefill and their time at `peak` FLOP/s."""
    from qwen35_lib.bench.roofline import prefill_flops

    flops = prefill_flops(config, B, T)
    return {"matmul_roofline": {"flops": flops, "roofline_ms": 1e3 * flops / peak}}


def _print_table(results: list[dict], load: dict) -> None:
    withheld = load.get("withhold_ratios")
    rows = [[f"{r['batch']}x{r['seq']}", r["tokens"], r["timings"]["ours"]["median_s"] * 1e3,
             r["timings"]["transformers"]["median_s"] * 1e3, r["tokens_per_s"]["ours"],
             r["tokens_per_s"]["transformers"], "withheld" if withheld else f"{r['speedup']:.2f}x",
             f"{r['matmul_roofline']['roofline_ms']:.1f}",
             f"{100 * r['matmul_roofline']['ours']:.0f}% / {100 * r['matmul_roofline']['transformers']:.0f}%",
             f"{r['max_abs_logit_diff']:.1e}", r[f"positions_over_{OFF:g}"]] for r in results]
    print(format_table(["BxT", "tokens", "ours ms", "HF ms", "ours tok/s", "HF tok/s", "ours/HF", "roofline ms",
                        "of roofline ours/HF", "max|Δ| logits", f"positions |Δ|>{OFF:g}"], rows))
    print(f"(a few positions off by more than {OFF:g} are usually top-k routing near-ties that rounding resolved "
          "the other way; many mean a real mismatch)")
    if withheld:
        print(f"ours/HF ratios withheld: {withheld}; the fractions of the roofline, measured in this run, stand")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"1x512,4x256" -> [(1, 512), (4, 256)]."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            b, t = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r} is not BATCHxSEQ (e.g. 1x512)") from None
        if b < 1 or t < 1:
            raise ValueError(f"shape {item!r}: batch and seq must be positive")
        shapes.append((b, t))
    if not shapes:
        raise ValueError("--shapes is empty; give BATCHxSEQ items, e.g. 1x512,4x256")
    return shapes


def hf_fields(config: Config) -> dict[str, Any]:
    """`Qwen3_5MoeTextConfig` fields equivalent to `config` (a Qwen3.5 MoE config with plain expert weights)."""
    if config.model_type != "qwen3_5_moe" or not config.norm_topk_prob or config.expert_dtype is not None:
        raise ValueError(f"{config.name}: vs-transformers compares Qwen3.5 MoE models (model_type 'qwen3_5_moe', "
                         "norm_topk_prob, unquantized experts); pick a qwen3.5-* preset")
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        layer_types=list(config.layer_types), num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        linear_num_key_heads=config.gdn_num_k_heads, linear_num_value_heads=config.gdn_num_v_heads,
        linear_key_head_dim=config.gdn_k_head_dim, linear_value_head_dim=config.gdn_v_head_dim,
        linear_conv_kernel_dim=config.gdn_conv_kernel, num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.moe_ffn,
        shared_expert_intermediate_size=config.shared_ffn, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=False,
        eos_token_id=list(config.eos_token_ids) or None,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                         "partial_rotary_factor": config.partial_rotary_factor},
    )


def _hf_model(config: Config, seed: int, experts: str | None) -> Any:
    """The seeded random HF model (the test factory's: norms and decays perturbed off their constants)."""
    from qwen35_lib.testing import make_hf_model

    model = make_hf_model("qwen3_5_moe", seed=seed, dtype="float32", **hf_fields(config))
    if experts:
        model.set_experts_implementation(experts)
    return model


def check_same_model(want: Config, got: Config) -> None:
    """The loaded config must describe the preset's architecture (else the mapping above is wrong)."""
    same = lambda c: c.replace(name="", dtype="float32", eos_token_ids=(),
                               max_position_embeddings=1)
    if same(want) != same(got):
        diff = {f: (getattr(want, f), getattr(got, f)) for f in want.__dataclass_fields__
                if getattr(same(want), f) != getattr(same(got), f)}
        raise ValueError(f"the HF checkpoint loads as a different model than {want.name}: {diff}")


def _import_reference():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise ValueError(f"vs-transformers needs the 'reference' extra (torch, transformers): {e}; "
                         "install with: pip install -e '.[reference]'") from None
    return torch


# --- the engine's generate vs transformers' (`bench engine --vs-transformers`) ---------------------------------

VS_TARGET = 2.0  # our output tokens/s over transformers' at `bench engine`'s vs_requests


def hf_twin(config: Config, seed: int) -> tuple[Any, Config, dict]:
    """(the seeded random HF model of `config`, and our (config, float32 weights) loaded from its checkpoint).

    The same construction as `vs-transformers`: `make_hf_model` with `hf_fields(config)`, `save_pretrained`,
    `load_hf_checkpoint`, and a check that the loaded config is the preset's architecture.
    """
    from qwen35_lib.bench.vs_transformers import check_same_model, hf_fields
    from qwen35_lib.checkpoint import load_hf_checkpoint
    from qwen35_lib.testing import make_hf_model

    hf = make_hf_model("qwen3_5_moe", seed=seed, dtype="float32", **hf_fields(config))
    with tempfile.TemporaryDirectory(prefix="qwen35_bench_") as tmp:
        hf.save_pretrained(tmp)
        ours, weights = load_hf_checkpoint(tmp, dtype="float32")
    check_same_model(config, ours)
    return hf, ours, weights


def reference_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_generate(hf, requests: list[tuple[list[int], int]]) -> Any:
    """transformers' greedy `generate` on one left-padded batch, max_new_tokens = the longest output, EOS off.

    Returns the generated ids [B, max_new] (torch)."""
    import torch

    B, L = len(requests), max(len(p) for p, _ in requests)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, (p, _) in enumerate(requests):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(o for _, o in requests),
                          do_sample=False, pad_token_id=0)
    return out[:, L:]


def compare_with_transformers(hf, config: Config, weights: dict, ec, requests, repeats: int,
                              plan: ServingPlan = SINGLE) -> dict:
    """Our engine vs transformers' generate on the same requests, timed interleaved; greedy tokens compared."""
    import torch
    import transformers

    from qwen35_lib.engine import Engine, SamplingParams

    hf.generation_config.eos_token_id = None  # ignore_eos on both sides: exact lengths
    n_out = sum(o for _, o in requests)
    hf_new = max(o for _, o in requests)

    start = time.perf_counter()
    info = Engine(config, weights, ec, plan=plan).precompile([len(p) for p, _ in requests],
                                                             [o for _, o in requests])
    compile_s = time.perf_counter() - start

    def ours():
        results = Engine(config, weights, ec, plan=plan).generate(
            [p for p, _ in requests], [SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in requests])
        return [r.output_ids for r in results]

    with BusyMonitor() as monitor:
        timings, outputs = measure({"ours": ours, "transformers": lambda: hf_generate(hf, requests)},
                                   repeats=repeats, warmup=1, settle=0,
                                   desc=f"vs transformers, {len(requests)} requests")
    hf_ids = outputs["transformers"].tolist()
    same_prefix = []
    for mine, theirs, (_, o) in zip(outputs["ours"], hf_ids, requests):
        k = next((i for i, (a, b) in enumerate(zip(mine, theirs[:o])) if a != b), o)
        same_prefix.append(k)
    t_ours, t_hf = timings["ours"].median, timings["transformers"].median
    tps = {"ours": n_out / t_ours, "transformers": len(requests) * hf_new / t_hf,
           "transformers_useful": n_out / t_hf}
    return {
        "requests": len(requests),
        "prompt_lengths": [len(p) for p, _ in requests],
        "output_lengths": [o for _, o in requests],
        "dtype": "float32",
        "transformers": {"version": transformers.__version__, "torch": torch.__version__,
                         "threads": torch.get_num_threads(), "mode": "generate, greedy, left-padded batch, "
                         f"max_new_tokens={hf_new} for every row, eager, torch.no_grad, KV/state cache",
                         "attention": hf.config._attn_implementation,
                         "experts": getattr(hf.config, "_experts_implementation", None)},
        "ours": {"engine": knobs(config, ec), "moe_kernel": plan.kernel("moe_matmul"), "threads": xla_cpu_threads(),
                 "precompile": {"seconds": compile_s, "buckets": len(info["buckets"]), "traces": info["compiled"]}},
        "timings": {n: t.to_json() for n, t in timings.items()},
        "output_tokens_per_s": tps,
        "speedup": tps["ours"] / tps["transformers"],
        "speedup_useful": tps["ours"] / tps["transformers_useful"],
        "load": monitor.result(),
        "target": VS_TARGET,
        "greedy_match": {"requests_identical": sum(k == o for k, (_, o) in zip(same_prefix, requests)),
                         "first_32_identical": sum(k >= min(32, o) for k, (_, o) in zip(same_prefix, requests)),
                         "tokens_before_first_difference": same_prefix,
                         "tokens_compared": n_out},
    }

