"""A tiny decoder written as a user would write one in flax.nnx, with random weights: the
target of tests/test_own_model.py (the recipe of docs/own_model.md).

Pre-norm blocks of multi-head attention (learned position embeddings, no RoPE) and a GELU
MLP, the head tied to the embedding. The products and the attention go through
``jaxspec.models.linear.linear`` and ``jaxspec.models.attention.attention`` (row-invariant
on CPU), so speculation is bitwise plain decoding for this model too. The cache is a tuple of
``(k, v)`` per layer, ``[B, S, H, h]`` each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import write
from jaxspec.models.attention import attention
from jaxspec.models.linear import linear


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs, scale: float):
        init = nnx.initializers.normal(scale / dim**0.5)
        self.heads = heads
        self.wqkv = nnx.Param(init(rngs.params(), (dim, 3 * dim)))
        self.wo = nnx.Param(init(rngs.params(), (dim, dim)))
        self.w_in = nnx.Param(init(rngs.params(), (dim, 2 * dim)))
        self.w_out = nnx.Param(init(rngs.params(), (2 * dim, dim)))

    def __call__(self, x, layer_cache, write_at, mask, shared_offset=False):
        b, t, d = x.shape
        if shared_offset:  # one write index for the whole batch, as the gemma library's cache has
            write_at = jnp.broadcast_to(write_at[0], write_at.shape)
        q, k, v = jnp.split(linear(_rms(x), self.wqkv[...]), 3, axis=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads) for y in (q, k, v))
        k_cache, v_cache = (write(c, y, write_at) for c, y in zip(layer_cache, (k, v)))
        x = x + linear(attention(q, k_cache, v_cache, mask), self.wo[...])
        x = x + linear(jax.nn.gelu(linear(_rms(x), self.w_in[...])), self.w_out[...])
        return x, (k_cache, v_cache)


class TinyNnxDecoder(nnx.Module):
    """``__call__(tokens, positions, cache, write_at, mask) -> (hidden, cache)``, ``head``,
    ``init_cache``: the methods ``jaxspec.models.nnx.NnxTarget`` calls."""

    def __init__(self, vocab: int, dim: int = 32, heads: int = 2, n_layers: int = 2, max_position: int = 256,
                 seed: int = 0, scale: float = 1.0, shared_offset: bool = False):
        rngs = nnx.Rngs(seed)
        self.shared_offset = shared_offset  # write every row at write_at[0] (a batch-wide cache index)
        self.heads, self.dim = heads, dim
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)))
        self.pos = nnx.Param(0.5 * jax.random.normal(rngs.params(), (max_position, dim)))
        self.blocks = nnx.List([Block(dim, heads, rngs, scale) for _ in range(n_layers)])

    def __call__(self, tokens, positions, cache, write_at, mask):
        x = jnp.take(self.embed[...], tokens, axis=0) + jnp.take(self.pos[...], positions, axis=0)
        new = []
        for block, layer_cache in zip(self.blocks, cache):
            x, layer_cache = block(x, layer_cache, write_at, mask, self.shared_offset)
            new.append(layer_cache)
        return _rms(x), tuple(new)

    def head(self, hidden):
        return linear(hidden, self.embed[...], transposed=True, out_dtype=jnp.float32)

    def init_cache(self, batch: int, max_len: int):
        shape = (batch, max_len, self.heads, self.dim // self.heads)
        return tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in self.blocks)

    def full_logits(self, tokens):
        """float32 logits ``[B, T, V]`` of whole sequences from an empty cache, causal: the
        model run on its own, outside jaxspec's engine (the tests' reference)."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        hidden, _ = self(tokens, positions, self.init_cache(b, t), jnp.zeros((b,), jnp.int32), mask)
        return self.head(hidden)
