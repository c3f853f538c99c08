"""Calls of the CPU attention and RoPE kernels (``cpu_attention.cc``, in the library
``cpu_matmul`` loads): attention of T new queries over the cache and over their own keys and
values kept apart, each query summing over the keys it sees in position order, and RoPE with
the same rounding in every program, so a token's result is bitwise the same whatever T and
wherever its window starts (``docs/cpu_kernel.md``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import cpu_matmul


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, seen_cache: jax.Array,
              k_new: jax.Array, v_new: jax.Array, seen_new: jax.Array, scale: float,
              out_dtype=jnp.float32) -> jax.Array:
    """Grouped-query attention on CPU, one softmax over the visible cache slots and new entries.

    Args:
      q: ``[B, T, H, h]`` float32 or bfloat16, the new tokens' queries.
      k_cache, v_cache: ``[B, S, K, h]`` float32 or bfloat16 (alike); ``seen_cache`` bool
        ``[B, T, S]``: the slots each query sees.
      k_new, v_new: ``[B, N, K, h]`` (N may be 0), the new tokens' keys and values not written
        into the cache; ``seen_new`` bool ``[B, T, N]``.
      scale: the score scale (a Python float).
      out_dtype: float32 (default) or bfloat16: the float32 result rounded once in the kernel,
        bitwise what ``.astype(jnp.bfloat16)`` of the float32 result gives (no convert op after).

    Returns:
      ``[B, T, H, h]`` of ``out_dtype``. Each query takes its visible keys in the order cache slots, then
      new entries, and sums in float32 in that order (scores, softmax, weighted values), so the
      result for a query depends on what it sees, never on T. A query that sees nothing gets
      zeros.

    Raises:
      RuntimeError: the kernel is off (``cpu_matmul.enabled``); shape/dtype mismatches are
      reported by XLA when the program runs (callers check them: ``jaxspec.models.attention``).
    """
    if not cpu_matmul.enabled():
        raise RuntimeError(f"the CPU kernels are off: {cpu_matmul.describe()}")
    out = jax.ShapeDtypeStruct(q.shape, cpu_matmul.result_dtype(out_dtype))
    call = jax.ffi.ffi_call(cpu_matmul.target("attention"), out, vmap_method="sequential")
    return call(q, k_cache, v_cache, seen_cache, k_new, v_new, seen_new, scale=np.float32(scale))


def rope(x: jax.Array, positions: jax.Array, inv_freq, out_dtype=jnp.float32) -> jax.Array:
    """Rotary position embedding ("rotate_half" layout) on CPU, float32 arithmetic with every
    product rounded before its sum, the same code in every program.

    Args:
      x: ``[B, T, N, h]`` float32 or bfloat16; positions: int32 ``[B, T]``;
      inv_freq: float32 ``[h / 2]`` (``jaxspec.models.rope.inv_freq``).
      out_dtype: float32 (default) or bfloat16, rounded once in the kernel (as ``attention``).

    Returns:
      ``[B, T, N, h]`` of ``out_dtype``.

    Raises:
      RuntimeError: the kernel is off (``cpu_matmul.enabled``).
    """
    if not cpu_matmul.enabled():
        raise RuntimeError(f"the CPU kernels are off: {cpu_matmul.describe()}")
    out = jax.ShapeDtypeStruct(x.shape, cpu_matmul.result_dtype(out_dtype))
    call = jax.ffi.ffi_call(cpu_matmul.target("rope"), out, vmap_method="sequential")
    return call(x, positions.astype(jnp.int32), jnp.asarray(inv_freq, jnp.float32))
