"""The gated delta rule in XLA: chunked (sequences) and recurrent (single steps) forms, the `gdn` slot's twins.

Shapes: q, k [B, T, Hk, dk] (conv outputs, before the L2 norm); v [B, T, Hv, dv]; g (log decay, <= 0) and
beta [B, T, Hv] float32; state [B, Hv, dk, dv] float32. Value head h reads key head h // (Hv // Hk).
Math: ../shared/reference/qwen35_architecture.md sections 2.4 and 5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_lib.kernels.registry import register


def _prepare(q, k, v, g, beta):
    """L2-normalise q and k (float32), scale q by dk^-0.5, repeat key heads to value heads; all [B, Hv, T, .]."""
    r = v.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5

    def l2(x):
        x = x.astype(jnp.float32)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = jnp.repeat(l2(q) * scale, r, axis=2)
    k = jnp.repeat(l2(k), r, axis=2)
    tr = lambda x: jnp.swapaxes(x, 1, 2)
    return tr(q), tr(k), tr(v.astype(jnp.float32)), tr(g.astype(jnp.float32)), tr(beta.astype(jnp.float32))


def gdn_recurrent(q, k, v, g, beta, state):
    """One token at a time: S = e^g S; S += k (beta (v - kᵀS)); o = qᵀS. Returns (o [B, T, Hv, dv], state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, T, .]

    def step(S, xs):  # S: [B, Hv, dk, dv]
        q_t, k_t, v_t, g_t, b_t = xs
        S = S * jnp.exp(g_t)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - kv))
        return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)

    time_major = lambda x: jnp.moveaxis(x, 2, 0)
    S, o = jax.lax.scan(step, state.astype(jnp.float32), tuple(map(time_major, (q, k, v, g, beta))))
    return jnp.moveaxis(o, 0, 1), S  # o: [B, T, Hv, dv]


def gdn_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """The chunked (WY/UT) form: parallel inside chunks of C tokens, a scan over chunks.

    Per chunk, with G = cumsum(g) and Γ_ij = exp(G_i - G_j) for i >= j:
    1. A = strict_tril((beta k) kᵀ ⊙ Γ); U = (I + A)⁻¹ (beta v); W = (I + A)⁻¹ (beta e^G k)
    2. P = tril((q kᵀ) ⊙ Γ) (diagonal included)
    3. scan: V' = U - W S;  O = (e^G q) S + P V';  S = e^G_last S + (e^(G_last - G) k)ᵀ V'
    The tail is padded with g = beta = 0 tokens, which leave the state unchanged.
    """
    B, T = q.shape[:2]
    C = chunk_size
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, T, .]
    pad = -T % C
    padt = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    n = (T + pad) // C
    chunk = lambda x: x.reshape(x.shape[0], x.shape[1], n, C, *x.shape[3:])
    q, k, v, g, beta = map(chunk, (q, k, v, g, beta))  # [B, Hv, n, C, .]

    G = jnp.cumsum(g, axis=-1)  # [B, Hv, n, C]
    lower = jnp.tril(jnp.ones((C, C), bool))
    gamma = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))  # [B, Hv, n, C, C]
    kb = k * beta[..., None]
    A = jnp.einsum("...ik,...jk->...ij", kb, k) * gamma * jnp.tril(jnp.ones((C, C)), -1)
    L = A + jnp.eye(C)  # unit lower triangular
    solve = lambda b: jax.scipy.linalg.solve_triangular(L, b, lower=True, unit_diagonal=True)
    U = solve(v * beta[..., None])  # [B, Hv, n, C, dv]
    W = solve(kb * jnp.exp(G)[..., None])  # [B, Hv, n, C, dk]
    P = jnp.einsum("...ik,...jk->...ij", q, k) * gamma  # [B, Hv, n, C, C]
    q_dec = q * jnp.exp(G)[..., None]
    k_dec = k * jnp.exp(G[..., -1:] - G)[..., None]
    last = jnp.exp(G[..., -1])  # [B, Hv, n]

    def step(S, xs):  # S: [B, Hv, dk, dv]
        U_c, W_c, P_c, q_c, k_c, l_c = xs
        v_new = U_c - jnp.einsum("bhck,bhkv->bhcv", W_c, S)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, S) + jnp.einsum("bhcj,bhjv->bhcv", P_c, v_new)
        S = S * l_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return S, o

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    S, o = jax.lax.scan(step, state.astype(jnp.float32), tuple(map(chunk_major, (U, W, P, q_dec, k_dec, last))))
    o = jnp.moveaxis(o, 0, 2).reshape(B, o.shape[2], n * C, -1)[:, :, :T]  # [B, Hv, T, dv]
    return jnp.swapaxes(o, 1, 2), S


@register("gdn", "xla")
def gdn_xla(q, k, v, g, beta, state, chunk_size: int = 64):
    """The recurrent form for single-token steps, the chunked form otherwise. Output o in v's dtype."""
    if q.shape[1] == 1:
        o, S = gdn_recurrent(q, k, v, g, beta, state)
    else:
        o, S = gdn_chunked(q, k, v, g, beta, state, chunk_size)
    return o.astype(v.dtype), S
