"""Attention of new tokens over the KV cache (and over their own keys and values kept apart):
XLA's einsums and softmax everywhere, and on CPU, for any number of new tokens, jaxspec's
attention kernel (``jaxspec.kernels.cpu_attention``, ``docs/cpu_kernel.md``).

Why a kernel on CPU: XLA sums a query's scores and weighted values in an order that depends on
the shapes, so a token's attention output inside a T-token verify window (the window kept apart
from the cache) was not the bits of its own 1-token pass (the token written into the cache);
with the weight products already row-invariant (``jaxspec.models.linear``), this was the last
part of a pass whose result depended on T. The kernel takes a query's visible keys in position
order whichever part they sit in, so greedy speculative decoding gives the logits of plain
decoding, bit for bit, and it reads only the slots a query sees, not the whole static-shape
cache.

The kernel path is taken when the kernels are active (``cpu_matmul.active("attention")``), q, k
and v are float32 or bfloat16 and the head dim is at most 512; gradients are XLA's
(``jax.custom_vjp``), so training is unchanged. Any T, prefill included: a query's result then
depends only on the keys it sees, never on T or on the cache's static length, and the kernel
reads only the slots a query sees, which makes it as fast as XLA's attention or faster
(measured on 2 cores, SmolLM2's heads, causal prefill, a layer: 64 tokens over 512 slots 1.0 vs
2.4 ms, 256 over 512 9.3 vs 8.8 ms, 700 over 1024 40 vs 61 ms, 1792 over 2048 296 vs 352 ms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import cpu_attention, cpu_matmul



def _xla(q, k, v, visible, extra, scale):
    b, t, n_heads, h = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, n_heads // n_kv, h)
    parts = [(k, v, visible)] + ([extra] if extra is not None else [])
    scores = [jnp.einsum("btkgh,bskh->bkgts", q, pk, preferred_element_type=jnp.float32) for pk, _, _ in parts]
    scores = jnp.concatenate(scores, axis=-1) if extra is not None else scores[0]
    scores = scores * scale if scale else scores / np.sqrt(h)
    seen = jnp.concatenate([pv for _, _, pv in parts], axis=-1) if extra is not None else visible
    weights = jax.nn.softmax(jnp.where(seen[:, None, None], scores, -jnp.inf), axis=-1).astype(v.dtype)
    if extra is None:
        return jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(b, t, n_heads * h)
    # the parts' weighted sums add in float32 and round once, as one einsum over both would:
    # rounding each part (bfloat16) made a token's output depend on where its window starts
    out, at = 0, 0
    for _, part_v, _ in parts:
        n = part_v.shape[1]
        out = out + jnp.einsum("bkgts,bskh->btkgh", weights[..., at : at + n], part_v,
                               preferred_element_type=jnp.float32)
        at += n
    return out.astype(v.dtype).reshape(b, t, n_heads * h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernel(q, k, v, visible, k_new, v_new, seen_new, scale):
    """The kernel on a CPU device, XLA elsewhere (``lax.platform_dependent``)."""
    extra = (k_new, v_new, seen_new) if k_new.shape[1] else None

    def cpu(q, k, v, visible, k_new, v_new, seen_new):
        s = scale or 1.0 / np.sqrt(q.shape[-1])
        out = cpu_attention.attention(q, k, v, visible, k_new, v_new, seen_new, s, out_dtype=v.dtype)
        return out.reshape(*q.shape[:2], -1)

    def default(q, k, v, visible, k_new, v_new, seen_new):
        return _xla(q, k, v, visible, extra, scale)

    return jax.lax.platform_dependent(q, k, v, visible, k_new, v_new, seen_new, cpu=cpu, default=default)


def _kernel_fwd(q, k, v, visible, k_new, v_new, seen_new, scale):
    return _kernel(q, k, v, visible, k_new, v_new, seen_new, scale), (q, k, v, visible, k_new, v_new, seen_new)


def _kernel_bwd(scale, res, g):
    q, k, v, visible, k_new, v_new, seen_new = res
    has_new = k_new.shape[1] > 0

    def f(q, k, v, k_new, v_new):
        return _xla(q, k, v, visible, (k_new, v_new, seen_new) if has_new else None, scale)

    dq, dk, dv, dkn, dvn = jax.vjp(f, q, k, v, k_new, v_new)[1](g)
    return dq, dk, dv, None, dkn, dvn, None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def kernel_applies(q: jax.Array, k: jax.Array, v: jax.Array, extra) -> bool:
    """Whether ``attention`` may take the CPU kernel (on a CPU device)."""
    arrays = (q, k, v) + (tuple(extra[:2]) if extra is not None else ())
    return (q.shape[1] >= 1 and q.shape[-1] <= 512 and k.dtype == v.dtype
            and (extra is None or extra[0].dtype == extra[1].dtype)
            and all(jnp.dtype(a.dtype) in cpu_matmul.DTYPES for a in arrays) and cpu_matmul.active("attention"))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *, scale: float = 0.0,
              extra: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """Grouped-query attention of new queries over the cache (and, with ``extra``, over keys
    and values kept apart from it: one softmax over both).

    Args:
      q: ``[B, T, H, h]``; k, v: ``[B, S, K, h]`` (cache, new tokens already written).
      visible: bool ``[B, T, S]`` (``decoder.slots_visible``): causal by position for contiguous
        tokens, the ancestors for a tree; stale slots are never visible.
      scale: score scale; 0 means ``h ** -0.5``.
      extra: ``(k [B, T', K, h], v [B, T', K, h], visible bool [B, T, T'])`` or None: the new
        tokens' own keys and values when they are not written into the cache
        (``forward(write=False)``); they follow the cache slots in position order.

    Returns:
      ``[B, T, H * h]`` of v's dtype. On CPU with the kernel (module docstring) each query's
      sums run in position order over what it sees, whatever T and whichever part holds a key.

    Raises:
      TypeError / ValueError: from ``jnp.einsum`` when the shapes do not chain.
    """
    if not kernel_applies(q, k, v, extra):
        return _xla(q, k, v, visible, extra, scale)
    if extra is None:
        b, t = q.shape[:2]
        extra = (jnp.zeros((b, 0) + k.shape[2:], k.dtype), jnp.zeros((b, 0) + v.shape[2:], v.dtype),
                 jnp.zeros((b, t, 0), bool))
    return _kernel(q, k, v, visible, *extra, scale)
