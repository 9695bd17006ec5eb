"""Speculative decoding with the model's own multi-token-prediction (MTP) head: draft, verify, accept, roll back.

With `EngineConfig.speculative_tokens` = k > 0 every step of the engine (`Engine.step`):
1. verifies: each decoding sequence's row in the decode region holds its last sampled token and its drafts, up to
   V = k + 1 tokens (`engine.batch.pack(..., width=V)`), through the same paged attention and GDN kernels as any
   other token; the logits of all V (`sample_tok` [S, V]) give the target's greedy tokens;
2. accepts (`verify`): greedy, the longest prefix of drafts equal to the target's tokens plus the target's next
   token (`accept`); sampling, speculative sampling (`rejection_sample`: draft d kept with probability
   min(1, p(d) / q(d)), a rejection resampled from max(0, p - q), the bonus token from p), p the target's
   distribution after the engine's temperature / top-k / top-p / min-p, q a point mass (the drafts are the head's
   argmax, as vLLM's MTP proposer's): n = 1 + accepted drafts tokens kept, all of them outputs;
3. rolls back exactly: the KV pages by length (a rejected position is written over when it comes again), the GDN
   conv and recurrent state from the checkpoints the verification kept (`model.ragged.keep_accepted`;
   `kernels.gdn.xla.gdn_verify_xla`, or the Pallas verify kernel `kernels.gdn.pallas._verify_call` under
   gdn_kernel="pallas", equal to it: tests/engine/test_speculative_pallas.py);
4. drafts k tokens a sequence for the next step (`draft_step`): the head runs over every token of the step (each
   position t with the target's normed hidden state and token t + 1: the prompt's next token, or the token the
   target sampled there), filling its own KV cache, and its logits at each sequence's last kept token give draft
   1; drafts 2..k chain on the head's own hidden state and draft, one token a sequence each (as vLLM's MTP
   proposer chains them; `bench mtp`'s `draft_chain` is the same chain over dense rows).

The head's attention keeps its own KV cache, paged like a main attention layer's and addressed by the same page
tables (a pool of one layer: `Engine.head_cache`), so it needs no bookkeeping of its own: position t of a sequence is
row t of its pages in both. Chained drafts write positions past the last kept token, which the next step's head
pass writes over; those past the sequence's pages (late in a long acceptance run) land in the null page and only
cost the draft some accuracy, never the output. Greedy, the target's output is the same with or without drafts,
whatever the head drafts; sampled, its distribution is (each token drawn with the request's own key for its
position, so a seeded request is reproducible). Logits processing (penalties, logit_bias, allowed_token_ids, bad
words, min_tokens) applies to each verified position with the request's outputs followed by the drafts before it
(its state after accepting them, as vLLM's rejection sampler processes drafts), so the accepted tokens are the
ones processed sampling takes without drafts; structured output is refused (`check_request`).

Every layout runs it: the checkpoint pools are declared with the GDN state's logical axes (`engine.cache`), so a
layout places them as it places the state (split by GDN heads under `tp`, by ranks under `dp_ep`), and the head as a
layer (`weights.declare_mtp`, its KV heads duplicated where the plan's are: `parallel.shardings.shard_weights`). Tested
greedy-equal to one device without drafts under `single`, `dp8_ep8`, `tp` (2 devices), `tp_ep` (4) and
`dp4_tp2_ep8` (tests/engine/test_speculative.py)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from qwen35_lib.config import Config
from qwen35_lib.engine.batch import RaggedMeta
from qwen35_lib.engine.sampling import process_logits, target_probs, token_keys
from qwen35_lib.model.mtp import ragged_mtp
from qwen35_lib.parallel.parallelism import parallelism
from qwen35_lib.plan import ServingPlan

# the kernels verification runs with, by slot: the GDN's keep per-position checkpoints (the Pallas verify kernel
# `gdn.pallas._verify_call`, its XLA twin; `native` runs XLA's verify), the attention's are tested with rows of
# drafts; the first of each is the one to bind instead
VERIFY_KERNELS = {"gdn": ("xla", "pallas", "native"), "attention": ("items", "xla")}


def check_speculative(plan, k: int, mtp_weights) -> None:
    """A ValueError in one line when `k` speculative tokens cannot run under the bound `plan` or without a head."""
    if k < 0:
        raise ValueError(f"speculative_tokens must be >= 0, got {k}")
    if not k:
        return
    if mtp_weights is None:
        raise ValueError(f"speculative_tokens={k} drafts with the model's MTP head, and none was given: pass "
                         "mtp_weights=qwen35_lib.checkpoint.load_mtp(path)[1] (a checkpoint with mtp.* tensors) or set "
                         "speculative_tokens=0")
    for slot, ok in VERIFY_KERNELS.items():
        if plan.kernel(slot) not in ok:
            raise ValueError(f"speculative_tokens={k} verifies with the {slot} kernels {ok} (their per-position "
                             f"checkpoints), not {plan.kernel(slot)!r}: bind the plan with {slot}_kernel='xla' or "
                             "set speculative_tokens=0")


def check_request(k: int, params) -> None:
    """A ValueError in one line for a request speculation cannot serve: structured output (a grammar's matcher
    consumes outputs for good, and a verified position's mask is the matcher's state after drafts that may be
    rejected: it would have to consume them and roll back). Logits processing is served: each verified position
    is processed with the request's outputs and the drafts before it (`Engine._sampling_arrays`)."""
    if k and params.structured is not None:
        raise ValueError(f"speculative_tokens={k} cannot apply structured output (a grammar) to drafts: drop it, "
                         "or use an engine with speculative_tokens=0")


def accept(tokens: jax.Array, meta, targets: jax.Array) -> jax.Array:
    """The standard greedy acceptance: for decode row i (sequence i) with q_len tokens [x, d_1, ..., d_{q_len-1}] at
    [i V, i V + V) of `tokens` [R, T], and the target's greedy tokens `targets` [R, S, V] after each of them, the
    tokens kept: 1 + the longest prefix of drafts with d_j == targets[i, j - 1]. Other rows keep 1. Returns [R, S]."""
    R, S, V = targets.shape
    D = meta.decode_seq.shape[-1]
    drafts = tokens[:, :D * V].reshape(R, D, V)[..., 1:]  # [R, D, V-1]
    real = jnp.arange(1, V) < meta.q_len[:, :D, None]  # [R, D, V-1]: a draft, not padding
    run = jnp.cumprod((drafts == targets[:, :D, :-1]) & real, axis=-1)  # 1 while every draft so far matched
    kept = 1 + jnp.sum(run, axis=-1).astype(jnp.int32)  # [R, D]
    return jnp.ones((R, S), jnp.int32).at[:, :D].set(kept)


def rejection_sample(probs: jax.Array, drafts: jax.Array, n: jax.Array, keys: jax.Array,
                     q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the target's tokens stay distributed as
    `probs` whatever the drafts. Row i verifies drafts d_1..d_n (`drafts` [N, W-1], `n` [N] real ones) with the
    target's distribution after each of its tokens `probs` [N, W, V] (the engine's temperature / top-k / top-p /
    min-p applied: `sampling.target_probs`) and the drafts' `q` [N, W-1, V] (None: point masses on the drafts, the
    greedy drafter's). d_j is accepted with probability min(1, p(d_j) / q(d_j)) (uniform u_j from key j of the row,
    folded with 1), the first rejection samples from the normalized max(0, p - q) there, and after n accepted the
    bonus token is drawn from p (with key j itself, as `sampling.sample` draws). Returns (tokens [N, W]: the m
    accepted drafts then the sampled token, 0 after; kept [N] = m + 1)."""
    N, W, V = probs.shape
    rows = jnp.arange(N)
    p_draft = jnp.take_along_axis(probs[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [N, W-1]
    q_draft = 1.0 if q is None else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1))))(keys[:, :-1])
    ok = (u * q_draft < p_draft) & (jnp.arange(W - 1) < n[:, None])  # u < p / q, and a real draft
    m = jnp.sum(jnp.cumprod(ok, axis=-1), axis=-1).astype(jnp.int32)  # drafts accepted [N]
    p = probs[rows, m]  # [N, V]: the target's distribution where the row stops
    at = jnp.minimum(m, W - 2)
    qm = jax.nn.one_hot(drafts[rows, at], V, dtype=p.dtype) if q is None else q[rows, at]
    residual = jnp.maximum(p - qm, 0)
    residual = jnp.where(((m < n) & (jnp.sum(residual, axis=-1) > 0))[:, None], residual, p)
    token = jax.vmap(jax.random.categorical)(keys[rows, m], jnp.log(residual)).astype(jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros((N, 1), drafts.dtype)], axis=1)  # [N, W]
    j = jnp.arange(W)
    tokens = jnp.where(j < m[:, None], padded, jnp.where(j == m[:, None], token[:, None], 0))
    return tokens.astype(jnp.int32), m + 1


def verify(logits: jax.Array, tokens: jax.Array, meta, samp: dict) -> tuple[jax.Array, jax.Array]:
    """The target's tokens after each of a row's tokens [R, S, V] and the tokens each row keeps [R, S], from the
    verify step's logits [R, S, V, vocab]: greedy acceptance (`accept`) when every row is greedy, else
    `rejection_sample` with each row's sampling parameters, the key of the token at position P of a request
    fold_in(key(seed), P) as `sampling.sample`'s (a seeded request samples the same tokens alone or batched).
    With `samp["proc"]` ([R, S, V, ...] rows) each position's logits are processed first (`sampling.process_logits`).
    Prefill rows draft nothing: the token after their last one is drawn as `sample` draws it."""
    R, S, V, _ = logits.shape
    D = meta.decode_seq.shape[-1]
    if "proc" in samp:  # logits processing, each position's own row [R, S, V, ...] (`Engine._sampling_arrays`)
        proc = jax.tree.map(lambda x: x.reshape(R * S * V, *x.shape[3:]), samp["proc"])
        logits = process_logits(logits.reshape(R * S * V, -1), proc).reshape(R, S, V, -1)

    def greedy(logits):
        targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return targets, accept(tokens, meta, targets)

    def sampled(logits):
        each = lambda x: jnp.repeat(x.reshape(R * S), V)  # a row's parameters for each of its V positions
        probs = target_probs(logits.reshape(R * S * V, -1), each(samp["temperature"]), each(samp["top_k"]),
                             each(samp["top_p"]), each(samp["min_p"]))
        drafts = jnp.zeros((R, S, V - 1), tokens.dtype).at[:, :D].set(
            tokens[:, :D * V].reshape(R, D, V)[..., 1:])
        n = jnp.where(jnp.arange(S) < D, jnp.maximum(meta.q_len - 1, 0), 0)  # [R, S] drafts a row verifies
        pos = jnp.take_along_axis(meta.positions, meta.sample_tok.reshape(R, S * V), axis=1).reshape(R, S, V) + 1
        keys = token_keys(jnp.broadcast_to(samp["seed"][..., None], (R, S, V)), pos)
        out, kept = rejection_sample(probs.reshape(R * S, V, -1), drafts.reshape(R * S, V - 1), n.reshape(R * S),
                                     keys.reshape(R * S, V))
        return out.reshape(R, S, V), kept.reshape(R, S)

    return jax.lax.cond(jnp.all(samp["temperature"] <= 0), greedy, sampled, logits)


def head_inputs(schedules, packs, V: int) -> tuple[np.ndarray, np.ndarray]:
    """The head pass's `next_ids` [R, T] and `next_src` [R, T] from the step's schedules and packs: the token after each
    position where the host knows it (the next token of the same row, or the prompt's next one past a prefill chunk
    that does not finish it), else (`next_src` >= 0) its index s V + j in the step's targets [S, V]: a decode row's
    target j, and the sampled token of a prefill row that finishes its prompt (j = 0)."""
    R, T = len(packs), packs[0][0].shape[0]
    ids, src = np.zeros((R, T), np.int32), np.full((R, T), -1, np.int32)
    for rank, (schedule, (_, meta)) in enumerate(zip(schedules, packs)):
        for s, (r, w) in enumerate(schedule.items):
            first, n = int(meta.q_start[s]), len(w.tokens)
            if s < len(schedule.decodes):
                src[rank, first:first + n] = s * V + np.arange(n)
                continue
            ids[rank, first:first + n - 1] = w.tokens[1:]
            end = w.start_pos + n
            if end < len(r.known):
                ids[rank, first + n - 1] = r.known[end]
            else:
                src[rank, first + n - 1] = s * V
    return ids, src


def replicated(x: jax.Array) -> jax.Array:
    """`x` replicated on every device where there is a mesh: every process reads all ranks' tokens."""
    if not jax.sharding.get_abstract_mesh().empty:
        return jax.lax.with_sharding_constraint(x, PartitionSpec())
    return x


@partial(jax.jit, static_argnums=(0, 1, 2))
def draft_step(cfg: Config, plan: ServingPlan, k: int, weights: dict, mtp_weights: dict, cache: dict, hidden,
               tokens, meta, targets, accepted, next_ids, next_src):
    """k greedy drafts a sequence [R, S, k] and the head's updated KV cache (donated by nothing: small), after a
    verified step: `hidden` [R, T, D] the target's normed hidden states, `targets` [R, S, V] and `accepted` [R, S]
    as `Engine.step` found them, `next_ids` / `next_src` from `head_inputs`. See the module's step 4."""
    par = parallelism(plan)
    R, S, V = targets.shape
    nxt = jnp.where(next_src >= 0, jnp.take_along_axis(targets.reshape(R, S * V), jnp.clip(next_src, 0), axis=1),
                    next_ids)  # [R, T]
    last = jnp.take_along_axis(meta.sample_tok, (accepted - 1)[..., None], axis=-1)[..., 0]  # [R, S] last kept token
    logits, cache, out = ragged_mtp(cfg, weights, mtp_weights, cache, hidden, nxt, meta._replace(sample_tok=last),
                                    par)
    draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, S]
    h = jnp.take_along_axis(out, last[..., None], axis=1)  # [R, S, D]
    active = meta.q_len > 0  # [R, S]
    base = jnp.take_along_axis(meta.positions, last, axis=1)  # [R, S]
    top = meta.page_table.shape[-1] * cache["kv"].shape[3] - 1  # the last position a page table can address
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (R, S))
    drafts = [draft]
    for i in range(1, k):  # one token a sequence: draft i + 1 from draft i and the head's own hidden state
        pos = jnp.minimum(base + i, top)
        chain = RaggedMeta(token_seq=jnp.where(active, rows, -1), positions=pos, q_start=rows,
                           q_len=active.astype(jnp.int32), kv_len=jnp.where(active, pos + 1, 0),
                           page_table=meta.page_table, slot=jnp.zeros_like(rows), decode_seq=rows, sample_tok=rows)
        logits, cache, h = ragged_mtp(cfg, weights, mtp_weights, cache, h, drafts[-1], chain, par)
        drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return replicated(jnp.stack(drafts, axis=-1)), cache
