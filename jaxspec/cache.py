"""Static-shape KV cache.

One ``KVCache`` holds, per layer, keys and values of shape ``[B, S, KV, hd]`` (batch, cache
slots, KV heads, head dim). Slot ``s`` holds the token at absolute position ``s``. Shapes never
change during generation: each sequence tracks its own length outside the cache (the engine's
``seq_lens``), writes go to that sequence's own offset, and entries past a sequence's length
are stale; attention masks them by position (key position <= query position) until they are
overwritten. Rolling back rejected draft tokens therefore costs nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values per layer.

    Attributes:
      k: tuple of ``n_layers`` arrays ``[B, S, KV, hd]``.
      v: tuple of ``n_layers`` arrays ``[B, S, KV, hd]``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        """An empty cache of ``max_len`` slots per sequence, in ``dtype``."""
        shape = (batch, max_len, config.n_kv_heads, config.head_dim)
        layers = range(config.n_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers))

    @property
    def max_len(self) -> int:
        """S, slots per sequence."""
        return self.k[0].shape[1]


def write(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write ``new[b]`` into ``buffer[b]`` at slot ``start[b]``, for every row ``b``.

    Args:
      buffer: ``[B, S, ...]``.
      new: ``[B, T, ...]`` with the same trailing shape and dtype as ``buffer``.
      start: int32 ``[B]``, first slot per row. The caller guarantees ``start + T <= S``
        (``lax.dynamic_update_slice`` would otherwise clamp the offset and shift the write).

    Returns:
      The updated buffer; in place under ``jit`` when the buffer is donated.
    """

    def one_row(row, new_row, s):
        return jax.lax.dynamic_update_slice_in_dim(row, new_row.astype(row.dtype), s, axis=0)

    return jax.vmap(one_row)(buffer, new, start)
