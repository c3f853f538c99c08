"""Static-shape KV cache.

One ``KVCache`` holds, per layer, keys and values of shape ``[B, S, K, h]`` (batch, cache
slots, KV heads, head dim). Slot ``s`` holds the token at absolute position ``s``. Shapes never
change during generation: each sequence tracks its own length outside the cache (the engine's
``seq_lens``), writes go to that sequence's own offset, and entries past a sequence's length
are stale; attention masks them (by position, or by the tree mask) until they are
overwritten. The target's verify step reads the cache without writing it
(``models.forward(write=False)``: the draft tree's own keys and values are kept apart) and
writes only the accepted path's entries, into contiguous slots after the committed text
(``KVCache.write``), so rejected branches are never visible to later steps. A drafter that
writes its whole tree into its own cache moves the path's entries with ``KVCache.keep_path``.
Why the target's verify does not write: it runs inside a ``lax.switch`` over verify widths,
and a cache updated inside a conditional costs XLA (jaxlib 0.10.2) a copy of every layer's
buffers per step (jax-ml/jax#16661; openxla/xla#46314 fixes it in a later jaxlib). On 2 CPU
cores, SmolLM2, one 128-token answer at 1024 slots: an n-gram tree 6.65 -> 6.07 s, plain
decoding (no switch, but a window written then moved) 7.60 -> 7.09 s. Plain decoding itself
writes its one token (its padded pass, with ``min_pass_tokens`` > 1) before the attention reads
the cache (``engine._verify``'s ``write_first``): written after the reads, by a write that depends on nothing they computed
(an empty tree's path is a constant), XLA could not order the in-place update after them and
copied every buffer twice per step (``tests/test_engine.py::test_decode_loop_does_not_copy_the_cache``).
After a real acceptance the write depends on the logits, and nothing is copied.
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
      k: tuple of ``n_layers`` arrays ``[B, S, K, h]``.
      v: tuple of ``n_layers`` arrays ``[B, S, K, h]``.
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

    def write(self, new: "KVCache", start: jax.Array) -> "KVCache":
        """Every layer's ``new`` entries (``[B, T, K, h]``) written at slots ``start [B] ..``
        (``write``); the caller guarantees ``start + T <= S``."""
        return KVCache(k=tuple(write(c, n, start) for c, n in zip(self.k, new.k)),
                       v=tuple(write(c, n, start) for c, n in zip(self.v, new.v)))

    def keep_path(self, start: jax.Array, path: jax.Array, span: int | None = None) -> "KVCache":
        """The cache after verification kept one path of a tree written at ``start``.

        Args:
          start: int32 ``[B]``, the window's first slot (the root's).
          path: int32 ``[B, W]``, window indices to keep, in order (``Accepted.path``): slot
            ``start + k`` receives the entry that was at ``start + path[:, k]``. The caller
            guarantees ``start + span <= S``.
          span: slots after ``start`` the entries are read from (default W); a drafter that
            lays its tree out over more slots than it keeps passes its layout's width.

        Returns:
          The updated cache; slots past the kept path are stale (never visible again before
          they are overwritten). For a chain the path is ``0, 1, 2, ...``: the identity.
        """
        width = path.shape[1] if span is None else span

        def keep(buf):
            return write(buf, jnp.take_along_axis(read(buf, start, width), path[:, :, None, None], axis=1), start)

        return KVCache(k=tuple(keep(x) for x in self.k), v=tuple(keep(x) for x in self.v))


def write_tree(cache, new, start: jax.Array):
    """``write`` of every leaf of ``new`` (``[B, T, ...]``) into the same leaf of ``cache``
    (``[B, S, ...]``) at slots ``start [B] ..``: a ``KVCache`` or any target's cache pytree
    (``jaxspec.models.target``)."""
    return jax.tree.map(lambda c, n: write(c, n, start), cache, new)


def read(buffer: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """``[B, width, ...]``: slots ``start[b] .. start[b] + width - 1`` of ``buffer [B, S, ...]``,
    for every row ``b`` (the caller guarantees ``start + width <= S``)."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, width, axis=0))(buffer, start)


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
