"""The few blocks whose collectives must be exact, written with `jax.shard_map`.

Everything else is left to XLA's SPMD partitioner, which derives collectives from the layouts in
`sharding.py`; here the layout alone would let it pick something worse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from boost_jax.sharding import active, spec


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Vocab-parallel embedding: each rank looks up the tokens in its slice of the vocabulary
    (zeros elsewhere), then one reduction over the vocab axis combines them. When the residual is
    split on d (btp) that reduction is a reduce-scatter, so each rank receives only its d/p slice:
    half the bytes of the paper's all-reduce + slice."""
    ctx = active()
    vocab_axis = ctx and ctx[1].get("vocab")
    if not vocab_axis or ctx[0].shape[vocab_axis] == 1:
        return table[tokens]
    mesh, rules = ctx
    out_spec = spec(("batch", "seq", "act_embed"), rules)
    scatter = vocab_axis in jax.tree.leaves(tuple(out_spec))

    def local(table_shard, tokens_shard):
        rows = table_shard.shape[0]
        ids = tokens_shard - jax.lax.axis_index(vocab_axis) * rows
        mine = (ids >= 0) & (ids < rows)
        x = jnp.where(mine[..., None], table_shard[jnp.clip(ids, 0, rows - 1)], 0)
        if scatter:
            return jax.lax.psum_scatter(x, vocab_axis, scatter_dimension=2, tiled=True)
        return jax.lax.psum(x, vocab_axis)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec(("vocab", None), rules), spec(("batch", "seq"), rules)),
        out_specs=out_spec,
    )(table, tokens)
