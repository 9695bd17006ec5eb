"""`python -m qwen35_lib.bench mtp --distill STEPS`: how well the multi-token-prediction head drafts, before and after
distilling it on the base model's own greedy continuations (offline, teacher-forced; issue 54, item 3).

1. The base model: `--model` (default qwen3.5-mini, float32) with seeded random weights (`init_weights`, as `bench
   engine` builds it), or `--checkpoint DIR` (its head too, when it ships one); the head random
   (`weights.init_mtp_weights`) otherwise: the test checkpoints' heads are random, so they draft at about 1/V.
   A random base's greedy continuation has no structure a head can learn (measured on qwen3.5-mini, seed 0, 256
   continuations of 96 tokens: the next token equals the training data's most frequent successor of the previous
   one at 0.05% of held-out positions, loops of period <= 16 at 0.6%, 3,584 distinct tokens in the last 32
   positions of 320 rows), so distilling on it raised the held-out acceptance nowhere. `--structured-base SCALE`
   gives the random base a structure instead (`structured_base`): its LM head tied to a seeded permutation pi of
   its normalized embedding and its layers' output projections scaled by SCALE, so that its greedy next token is
   often pi(last token) (measured: 18.6% of 768 greedy tokens at SCALE 1, 100% at 0.3); the shared LM head
   applies pi, so a head that carries the token's embedding through drafts pi(token) for any token.
2. Data: seeded synthetic prompts (uniform token ids, `--prompt-len` each), continued greedily by the base model for
   `--new-tokens` (its full forward, argmax), `--train-prompts` of them to train on and `--eval-prompts` held out.
   One teacher-forced forward per sequence gives the head's input (`forward(..., return_hidden=True)`: the last
   hidden states after the final norm, as vLLM feeds them) and the base model's greedy token after every position
   (`greedy[t]` = argmax of its logits at t: what a greedy verifier accepts after the prefix up to t).
3. Offline acceptance (`evaluate`): at every origin t of a held-out continuation (from the prompt's last position,
   where the engine drafts first), the head drafts k = 1..K tokens greedily, chained as vLLM's MTP proposer chains
   it (`draft_chain`): draft 1 from (h_t, token t+1) at position t; draft j > 1 from the head's own hidden state of
   draft j-1 and that draft's token, at position t+j-1, its attention over the true prefix's entries and the chain's.
   Draft j is accepted when it and every draft before it equal greedy[t+1..t+j] (`acceptance`): per position j the
   accepted fraction (vLLM's per-position acceptance rate) and the rate given draft j-1 accepted; per k the expected
   acceptance length 1 + sum of the first k rates (tokens per verify step, the verifier's own token counted).
4. Distillation (`distill`): only the head trains (optax Adam, `--lr`, global-norm clipping), the base model frozen:
   the cross-entropy of the head's logits at t (from h_t, token t+1) against greedy[t+1], the base model's greedy
   token t+2 (in a continuation, token t+2 itself), every position of `--batch` training sequences a step.
5. Acceptance again; the table printed and the JSON document returned (`--json`). A benchmark reports: nothing here
   asserts a rate.

6. The engine, measured (`bench.mtp_engine.engine_speculation`): the held-out prompts served greedily by the
   engine twice in one run, without speculation and with `--k` drafts a step from the distilled head
   (`EngineConfig.speculative_tokens`), the same knobs; each engine precompiled first, then timed: output tokens/s
   of each, their ratio, the outputs compared (greedy: identical), and the acceptance length the engine counted
   (1 + accepted drafts per verified row). Beside it the cost model's CPU prediction for the same run
   (`cpu_prediction`: `costmodel.predict` on the `cpu` specs measured before each round of timed runs, the median
   of each figure, so that the rates the model reads and the runs it predicts see the same load; one device, the
   engine's knobs, at the acceptance length the engine counted), and measured / predicted.
7. Each program alone (`bench.mtp_engine.step_ratios`): the decode, verify and draft steps at a full decode
   bucket, timed interleaved, beside the cost model's price of each on the same specs (measured / predicted).

The head's programs run on one device with the XLA `capacity` MoE kernel (`HEAD_PLAN`: dropless and exact, and
differentiable, which the CPU's native kernel is not); the base model runs with the platform's default kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qwen35_lib.bench.mtp_engine import cpu_prediction, engine_speculation, step_ratios
from qwen35_lib.bench.timing import environment, format_table, progress, warn_if_busy
from qwen35_lib.config import Config, get_config
from qwen35_lib.model.decoder import forward
from qwen35_lib.model.mtp import mtp_forward
from qwen35_lib.model.parallelism import Local
from qwen35_lib.plan import SINGLE

DESCRIPTION = ("the MTP head's offline acceptance per draft position (k = 1..3, teacher-forced), before and after "
               "distilling it on the base model's greedy continuations")
DEFAULTS = dict(model="qwen3.5-mini", train_prompts=256, eval_prompts=16, prompt_len=16, new_tokens=16, batch=16,
                distill=300)
QUICK = dict(model="qwen3.5-tiny", train_prompts=48, eval_prompts=8, prompt_len=16, new_tokens=8, batch=16, distill=40)
HEAD_PLAN = SINGLE.replace(moe_kernel="capacity")  # the head's MoE: XLA, dropless, differentiable
HEAD = Local(HEAD_PLAN)
CHAIN_BATCH = 32  # rows a chained draft pass runs at once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"a preset (default: {DEFAULTS['model']}; --quick: {QUICK['model']})")
    p.add_argument("--checkpoint", metavar="DIR", help="an HF checkpoint instead of random weights (its MTP head too, "
                   "when it has one)")
    p.add_argument("--dtype", default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--distill", type=int, metavar="STEPS",
                   help=f"training steps of the head (default: {DEFAULTS['distill']}; 0: the head as built only)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default: %(default)s)")
    p.add_argument("--batch", type=int, help=f"training sequences a step (default: {DEFAULTS['batch']})")
    p.add_argument("--train-prompts", type=int, help=f"prompts to train on (default: {DEFAULTS['train_prompts']})")
    p.add_argument("--eval-prompts", type=int, help=f"held-out prompts (default: {DEFAULTS['eval_prompts']})")
    p.add_argument("--prompt-len", type=int, help=f"tokens a prompt (default: {DEFAULTS['prompt_len']})")
    p.add_argument("--new-tokens", type=int, help=f"greedy tokens after a prompt (default: {DEFAULTS['new_tokens']})")
    p.add_argument("--k", type=int, default=3, help="drafted tokens, the most (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the prompts and the training order")
    p.add_argument("--quick", action="store_true", help="a small end-to-end run (tiny model, few prompts and steps)")
    p.add_argument("--structured-base", type=float, metavar="SCALE", help="a random base with structure: LM head "
                   "tied to a permuted normalized embedding, layer outputs scaled by SCALE (see the module doc)")
    p.add_argument("--serve-tokens", type=int, help="tokens the engine generates a held-out prompt when it is timed "
                   "with and without speculation (default: --new-tokens)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the timed engine's running sequences (default: "
                   "%(default)s)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine's timed runs")


# --- data: the base model's greedy continuations ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Prompts continued greedily by the base model, with what the head needs of them (numpy, host)."""

    ids: np.ndarray  # [N, L] int32: prompt, then the base model's greedy tokens
    hidden: np.ndarray  # [N, L, D] float32: the base model's last hidden states after the final norm
    greedy: np.ndarray  # [N, L] int32: argmax of the base model's logits at each position (teacher-forced)
    prompt_len: int

    @property
    def mismatches(self) -> int:
        """Continuation tokens the teacher-forced forward would not pick (near ties between two programs)."""
        return int((self.ids[:, self.prompt_len:] != self.greedy[:, self.prompt_len - 1:-1]).sum())


def synthetic_prompts(n: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """[n, length] int32 token ids, uniform over the vocabulary, seeded."""
    return np.random.default_rng(seed).integers(0, vocab_size, (n, length), dtype=np.int32)


def greedy_sequences(config: Config, weights: dict, prompts: np.ndarray, new_tokens: int,
                     desc: str = "greedy") -> Sequences:
    """Each prompt [N, P] continued by `new_tokens` greedy tokens, one full forward of the padded rows [N, P +
    new_tokens] per token (one program; padding never reaches real positions), then the teacher-forced hidden
    states and greedy tokens of the whole rows from the same program."""
    N, P = prompts.shape
    L = P + new_tokens
    ids = np.zeros((N, L), np.int32)
    ids[:, :P] = prompts
    with progress(new_tokens, desc) as bar:
        for n in range(P, L):
            logits, _ = forward(config, weights, ids, np.full(N, n, np.int32), return_hidden=True)
            ids[:, n] = np.asarray(jnp.argmax(logits[:, n - 1], axis=-1))
            bar.update(1)
    logits, hidden = forward(config, weights, ids, return_hidden=True)
    return Sequences(ids, np.asarray(hidden, np.float32), np.asarray(jnp.argmax(logits, axis=-1), np.int32), P)


# --- the head: loss, distillation, chained drafts, acceptance --------------------------------------------------


def _shared(weights: dict) -> dict:
    """The main model's leaves the head reads (its embedding and LM head): a jitted step's arguments."""
    return {"embed": weights["embed"], "lm_head": weights["lm_head"]}


def head_loss(config: Config, shared: dict, head: dict, hidden, next_ids, targets) -> jax.Array:
    """Mean cross-entropy of the head's logits at every position t of rows [B, T] (hidden h_t, next_ids token t+1)
    against `targets` [B, T] (the base model's greedy token t+2)."""
    _, logits = mtp_forward(config, shared, head, hidden, next_ids, parallelism=HEAD)  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _rows(seqs: Sequences, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The head's training rows of sequences `rows`: hidden [B, L-1, D], next ids [B, L-1], targets [B, L-1]."""
    return seqs.hidden[rows, :-1], seqs.ids[rows, 1:], seqs.greedy[rows, 1:]


def distill(config: Config, weights: dict, head: dict, seqs: Sequences, steps: int, lr: float = 3e-3,
            batch: int = 8, seed: int = 0, desc: str = "distill") -> tuple[dict, list[float]]:
    """Train only the head for `steps` Adam steps on `seqs` (`batch` sequences a step, each epoch a seeded
    permutation); returns (the trained head, each step's loss before its update)."""
    if config.expert_dtype is not None:
        raise ValueError(f"the head's experts are {config.expert_dtype}: distill a head of float experts (load the "
                         "checkpoint with fp8='dequantize')")
    rng = np.random.default_rng(seed)
    n = len(seqs.ids)
    batch = min(batch, n)
    order, state, shared, losses = np.empty(0, np.int64), _optimizer(lr).init(head), _shared(weights), []
    with progress(steps, desc) as bar:
        for _ in range(steps):
            if len(order) < batch:
                order = np.concatenate([order, rng.permutation(n)])
            rows, order = order[:batch], order[batch:]
            head, state, loss = _train_step(config, lr, head, state, shared, *_rows(seqs, rows))
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
    return head, losses


def _optimizer(lr: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train_step(config: Config, lr: float, head: dict, state, shared: dict, hidden, next_ids, targets):
    """One Adam step of the head on rows [B, T] (one program per config and learning rate, shared by every run)."""
    loss, grads = jax.value_and_grad(head_loss, argnums=2)(config, shared, head, hidden, next_ids, targets)
    updates, state = _optimizer(lr).update(grads, state, head)
    return optax.apply_updates(head, updates), state, loss


def origins(seqs: Sequences, k: int) -> list[tuple[int, int]]:
    """(sequence, t) of every origin a k-token draft can be checked at: t from the prompt's last position (where
    the engine drafts first) to the last with k greedy tokens after t+1 (t + k <= L - 1)."""
    N, L = seqs.ids.shape
    return [(r, t) for r in range(N) for t in range(seqs.prompt_len - 1, L - k)]


def draft_chain(config: Config, weights: dict, head: dict, seqs: Sequences, where: list[tuple[int, int]], k: int,
                batch: int = CHAIN_BATCH) -> np.ndarray:
    """The head's greedy drafts [len(where), k] at each origin (r, t), chained as vLLM's MTP proposer does.

    Pass j (1..k) runs one row per origin, right-padded to L - 1: positions 0..t take the true inputs (h_i, token
    i+1), positions t+1..t+j-1 the chain's (the head's hidden state of draft i, draft i), so the head's attention
    sees the entries the engine's head cache would hold; the row's last position gives draft j and the hidden
    state that feeds pass j+1.
    """
    N, L = seqs.ids.shape
    D = seqs.hidden.shape[-1]
    M, W = len(where), L - 1
    drafts = np.zeros((M, k), np.int32)
    states = np.zeros((M, k, D), np.float32)
    shared = _shared(weights)
    for j in range(1, k + 1):
        for s in range(0, M, batch):
            chunk = where[s:s + batch]
            h, x, lengths = np.zeros((batch, W, D), np.float32), np.zeros((batch, W), np.int32), np.ones(batch, int)
            for b, (r, t) in enumerate(chunk):
                h[b, :t + 1], x[b, :t + 1] = seqs.hidden[r, :t + 1], seqs.ids[r, 1:t + 2]
                h[b, t + 1:t + j], x[b, t + 1:t + j] = states[s + b, :j - 1], drafts[s + b, :j - 1]
                lengths[b] = t + j
            out, logits = mtp_forward(config, shared, head, h, x, lengths, parallelism=HEAD)
            last = jnp.asarray(lengths - 1)
            rows = jnp.arange(batch)
            n = len(chunk)
            drafts[s:s + n, j - 1] = np.asarray(jnp.argmax(logits[rows, last], axis=-1))[:n]
            states[s:s + n, j - 1] = np.asarray(out[rows, last], np.float32)[:n]
    return drafts


def acceptance(drafts: np.ndarray, targets: np.ndarray) -> dict:
    """Greedy acceptance of drafts [M, k] against the verifier's tokens [M, k]: draft j counts when it and every
    draft before it match. per_position[j]: accepted fraction at j (vLLM's per-position acceptance rate);
    conditional[j]: the same given draft j-1 accepted (None where none was); acceptance_length[k']: 1 + the sum of
    the first k' rates, the expected tokens a verify step yields drafting k' (the verifier's own counted)."""
    drafts, targets = np.asarray(drafts), np.asarray(targets)
    if drafts.shape != targets.shape or drafts.ndim != 2 or not drafts.size:
        raise ValueError(f"drafts {drafts.shape} and targets {targets.shape} must be the same [origins, k], non-empty")
    run = np.cumprod(drafts == targets, axis=1)  # [M, k]: drafts 1..j all accepted
    per_position = run.mean(axis=0)
    reached = np.concatenate([[len(run)], run[:, :-1].sum(axis=0)])  # origins whose draft j-1 was accepted
    conditional = [float(a / r) if r else None for a, r in zip(run.sum(axis=0), reached)]
    return {"origins": int(len(run)), "per_position": [float(a) for a in per_position], "conditional": conditional,
            "acceptance_length": {str(j): float(1 + per_position[:j].sum()) for j in range(1, run.shape[1] + 1)}}


def evaluate(config: Config, weights: dict, head: dict, seqs: Sequences, k: int) -> dict:
    """The head's held-out loss (`head_loss` over every position) and its `acceptance` drafting k tokens."""
    where = origins(seqs, k)
    drafts = draft_chain(config, weights, head, seqs, where, k)
    targets = np.array([seqs.greedy[r, t + 1:t + k + 1] for r, t in where], np.int32)
    loss = float(head_loss(config, _shared(weights), head, *_rows(seqs, slice(None))))
    return {"loss": loss} | acceptance(drafts, targets)


# --- the command ------------------------------------------------------------------------------------------------


def _resolve(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else DEFAULTS
    r = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v for k, v in base.items()}
    if min(r["train_prompts"], r["eval_prompts"], r["prompt_len"], r["batch"]) < 1 or r["distill"] < 0:
        raise ValueError("--train-prompts, --eval-prompts, --prompt-len and --batch must be at least 1, --distill at "
                         "least 0")
    if args.k < 1 or r["new_tokens"] < args.k + 1:
        raise ValueError(f"--k {args.k} --new-tokens {r['new_tokens']}: k must be at least 1 and the continuation "
                         "longer than k")
    return r


OUTPUT_PROJECTIONS = ("w_o", "w_out", "w_down", "shared_down")  # each layer's writes into the residual stream


def structured_base(weights: dict, scale: float, seed: int = 0) -> dict:
    """`weights` with a structure a one-layer head can learn: the LM head [D, V] tied to a seeded permutation pi of
    the row-normalized embedding (logit of token pi(x) = the hidden state's cosine with x's embedding, times the
    old head's mean column norm), and every layer's output projection (`OUTPUT_PROJECTIONS`) times `scale`, so
    that the last token's embedding dominates the final hidden state and the greedy next token is often pi(last
    token)."""
    emb = weights["embed"]  # [V, D]
    V = emb.shape[0]
    perm = np.random.default_rng(seed).permutation(V)
    unit = emb / jnp.linalg.norm(emb, axis=-1, keepdims=True)
    lm = jnp.zeros_like(weights["lm_head"]).at[:, perm].set(unit.T) * jnp.linalg.norm(weights["lm_head"], axis=0).mean()
    layers = {part: {n: a * scale if n in OUTPUT_PROJECTIONS else a for n, a in leaves.items()}
              if isinstance(leaves, dict) else leaves for part, leaves in weights["layers"].items()}
    return dict(weights, lm_head=lm.astype(weights["lm_head"].dtype), layers=layers)


def build(args: argparse.Namespace, model: str) -> tuple[Config, dict, dict, str]:
    """(config, weights, head, where the head came from): a checkpoint's, or seeded random ones."""
    from qwen35_lib.weights import init_mtp_weights, init_weights

    if not args.checkpoint:
        config = get_config(model, dtype=args.dtype)
        weights = init_weights(config, args.seed)
        if getattr(args, "structured_base", None) is not None:
            weights = structured_base(weights, args.structured_base, args.seed)
        return config, weights, init_mtp_weights(config, args.seed + 1), "random"
    from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, load_mtp

    config, weights = load_hf_checkpoint(args.checkpoint, dtype=args.dtype)
    try:
        return config, weights, load_mtp(args.checkpoint, dtype=args.dtype)[1], "checkpoint"
    except CheckpointError as e:
        print(f"{e}: a random head instead", file=sys.stderr)
        return config, weights, init_mtp_weights(config, args.seed + 1), "random"


def run(args: argparse.Namespace) -> dict:
    """1. Build the model and head; 2. the greedy continuations (train, held out); 3. acceptance of the head as
    built; 4. distill; 5. acceptance after; print; return the JSON document."""
    opts = _resolve(args)
    load_before = warn_if_busy()
    start = time.perf_counter()
    config, weights, head, head_source = build(args, opts["model"])
    k = args.k
    wall = {"build_s": time.perf_counter() - start}
    t = time.perf_counter()
    P, G = opts["prompt_len"], opts["new_tokens"]
    prompts = synthetic_prompts(opts["train_prompts"] + opts["eval_prompts"], P, config.vocab_size, args.seed)
    train = greedy_sequences(config, weights, prompts[:opts["train_prompts"]], G, "greedy (train)")
    held = greedy_sequences(config, weights, prompts[opts["train_prompts"]:], G, "greedy (held out)")
    wall["greedy_s"] = time.perf_counter() - t
    base = "random" if getattr(args, "structured_base", None) is None else \
        f"random, structured (scale {args.structured_base})"
    print(f"mtp benchmark: {config.name} ({'checkpoint ' + str(args.checkpoint) if args.checkpoint else base} "
          f"weights, seed {args.seed}), {config.dtype}, head {head_source}; {len(train.ids)} training and "
          f"{len(held.ids)} held-out prompts of {P} tokens + {G} greedy; drafting k <= {k}, teacher-forced")

    t = time.perf_counter()
    before = evaluate(config, weights, head, held, k)
    wall["evaluate_before_s"] = time.perf_counter() - t
    t = time.perf_counter()
    head, losses = distill(config, weights, head, train, opts["distill"], args.lr, opts["batch"], args.seed)
    wall["distill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    after = evaluate(config, weights, head, held, k) if opts["distill"] else before
    wall["evaluate_after_s"] = time.perf_counter() - t

    rows = []
    for label, r in (("head as built", before), (f"distilled ({opts['distill']} steps)", after)):
        rows.append([label, r["loss"], *[f"{a:.3f}" for a in r["per_position"]],
                     *[f"{r['acceptance_length'][str(j)]:.3f}" for j in range(1, k + 1)]])
    print(format_table(["head", "held-out loss", *[f"accept @{j}" for j in range(1, k + 1)],
                        *[f"length k={j}" for j in range(1, k + 1)]], rows))
    print(f"{before['origins']} draft origins; accept @j: drafts 1..j all equal the base model's greedy tokens; "
          f"length k: 1 + the first k rates (tokens a verify step yields). Distilling took {wall['distill_s']:.1f} s")
    served = predicted = steps = None
    if not getattr(args, "no_engine", False):
        t = time.perf_counter()
        serve_tokens = getattr(args, "serve_tokens", None) or G
        served = engine_speculation(config, weights, head, prompts[opts["train_prompts"]:], serve_tokens, k,
                                    getattr(args, "max_num_seqs", 16))
        wall["engine_s"] = time.perf_counter() - t
        try:
            predicted = cpu_prediction(config, served)
        except (ValueError, KeyError) as e:  # the cost model cannot price this run: said, not estimated
            predicted = {"error": str(e)}
        base, spec = served["0"], served[str(k)]
        print(format_table(["engine (measured, CPU)", "output tok/s", "steps", "acceptance length", "cost model tok/s"],
                           [["no speculation", f"{base['output_tokens_per_s']:.1f}", base["steps"], "-",
                             f"{predicted['output_tokens_per_s']['0']:.1f}" if "error" not in predicted else "-"],
                            [f"k = {k} drafts (distilled head)", f"{spec['output_tokens_per_s']:.1f}", spec["steps"],
                             f"{served['acceptance_length']:.3f}" if served["acceptance_length"] else "-",
                             f"{predicted['output_tokens_per_s'][str(k)]:.1f}" if "error" not in predicted else
                             "-"]]))
        pred = f"x{predicted['speedup']:.2f}" if "error" not in predicted else f"- ({predicted['error']})"
        ratio = f" (measured / cost model {served['speedup'] / predicted['speedup']:.3f})" if "error" not in \
            predicted else ""
        print(f"speedup measured x{served['speedup']:.2f}, cost model {pred}{ratio}; greedy outputs identical: "
              f"{served['same_outputs']}")
        t = time.perf_counter()
        steps = step_ratios(config, weights, head, prompts[opts["train_prompts"]:], serve_tokens, k,
                            getattr(args, "max_num_seqs", 16), cpu_specs=served["cpu_specs"])
        wall["steps_s"] = time.perf_counter() - t
        print(format_table(["program alone", "tokens", "measured ms", "cost model ms", "measured / model"],
                           [[name, r["tokens"], f"{1e3 * r['measured_s']:.2f}", f"{1e3 * r['predicted_s']:.2f}",
                             f"{r['measured_over_predicted']:.2f}"] for name, r in steps.items()]))
    wall["total_s"] = time.perf_counter() - start
    return {
        "benchmark": "mtp",
        "model": config.name,
        "dtype": config.dtype,
        "weights": f"checkpoint {args.checkpoint}" if args.checkpoint else "init_weights" + (
            f", structured_base(scale={args.structured_base})" if getattr(args, "structured_base", None) is not None
            else ""),
        "head": head_source,
        "seed": args.seed,
        "data": {"train_prompts": len(train.ids), "eval_prompts": len(held.ids), "prompt_len": P, "new_tokens": G,
                 "prompts": "uniform token ids, seeded", "continuations": "the base model's greedy tokens",
                 "greedy_mismatches": {"train": train.mismatches, "eval": held.mismatches}},
        "distill": {"steps": opts["distill"], "lr": args.lr, "batch": opts["batch"], "optimizer": "adam, clip 1.0",
                    "trained": "the MTP head only", "loss_first": losses[0] if losses else None,
                    "loss_last": losses[-1] if losses else None, "losses": losses},
        "k": k,
        "measure": "offline, teacher-forced on held-out continuations: greedy drafts chained on the head's own hidden "
                   "state (vLLM's MTP proposer), accepted while equal to the base model's greedy tokens",
        "before": before,
        "after": after,
        "engine_speculation": served if served is not None else {"measured": False, "reason": "--no-engine"},
        "cpu_prediction": predicted,
        "step_ratios": steps,
        "wall_s": wall,
        "head_kernels": {"moe_matmul": HEAD_PLAN.moe_kernel},
        "environment": environment(loadavg_1m_before=load_before),
    }


__all__ = ["Sequences", "acceptance", "cpu_prediction", "distill", "draft_chain", "engine_speculation", "evaluate",
           "greedy_sequences", "origins", "run", "step_ratios", "structured_base", "synthetic_prompts"]
