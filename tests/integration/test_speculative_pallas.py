"""engine.speculative with the Pallas GDN: `gdn_kernel="pallas"` verifies with its verify kernel
(`kernels.gdn.pallas._verify_call`, interpret mode here), through the engine's own verify step, as the XLA twin."""

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_lib import get_config, init_weights
from qwen35_lib.engine.batch import SeqWork, pack, stack_ranks
from qwen35_lib.engine.cache import CacheShape, init_cache
from qwen35_lib.engine.speculative import check_speculative
from qwen35_lib.engine.step import verify_step
from qwen35_lib.plan import SINGLE


def test_pallas_gdn_verifies_as_the_xla_twin():
    """qwen3.5-tiny (float32), one verify step of 3 decode rows of V = 3 tokens (a fresh sequence, one continuing
    from its slot's random state and conv history, a padding row), greedy: the targets, the tokens kept, the normed
    hidden states and every cache pool after the rollback (the state checkpoints and conv windows included) equal
    the XLA twin's."""
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    D, V, S = 3, 3, 3
    cache = init_cache(cfg, CacheShape(ranks=1, num_pages=8, page_size=8, num_slots=4, verify=V))
    keys = iter(jax.random.split(jax.random.key(1), len(cache)))
    cache = {n: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype) if n.startswith(("state", "conv")) else x
             for n, x in cache.items()}  # a slot's state and conv history as an earlier step left them
    rows = [SeqWork([3, 7, 11], 0, [1], 1), SeqWork([5, 2, 9], 4, [2], 2)]  # fresh; from slot 2 at position 4
    tokens, meta = stack_ranks([pack(rows, [], D=D, T=D * V, S=S, max_pages=1, chunk=8, width=V)])
    tokens, meta = jnp.asarray(tokens), jax.tree.map(jnp.asarray, meta)
    samp = dict(temperature=jnp.zeros((1, S)), top_k=jnp.zeros((1, S), jnp.int32), top_p=jnp.ones((1, S)),
                seed=jnp.zeros((1, S), jnp.uint32), position=jnp.zeros((1, S), jnp.int32), min_p=jnp.zeros((1, S)))
    out = {}
    for kernel in ("xla", "pallas"):
        plan = SINGLE.replace(gdn_kernel=kernel).bound(None, cfg)
        check_speculative(plan, V - 1, {})  # served with drafts: no refusal
        fresh = jax.tree.map(jnp.copy, cache)  # verify_step donates the cache
        out[kernel] = jax.device_get(verify_step(cfg, plan, w, fresh, tokens, meta, samp))
    (targets, kept, pools, hidden), (targets_x, kept_x, pools_x, hidden_x) = out["pallas"], out["xla"]
    np.testing.assert_array_equal(targets, targets_x)
    np.testing.assert_array_equal(kept, kept_x)
    np.testing.assert_allclose(hidden[0, :2 * V], hidden_x[0, :2 * V], atol=1e-5, rtol=1e-5)
    assert set(pools) == set(pools_x) >= {"state", "state_ckpt", "conv_q_ckpt"}
    for name in pools:  # slots 1 and 2 (the null slot 0 and the unused 3 as the twin leaves them too)
        np.testing.assert_allclose(pools[name], pools_x[name], atol=1e-5, rtol=1e-5, err_msg=name)
    assert not np.allclose(pools["state_ckpt"], cache["state_ckpt"])  # the verification wrote its checkpoints
