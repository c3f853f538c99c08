"""Logits -> the processed next-token distribution that both plain and speculative decoding
sample from.

Temperature 0 means greedy: the distribution is one-hot on the argmax. With that convention
the speculative acceptance rule (``jaxspec.acceptance``) needs no greedy special case: with
one-hot p and q it accepts a draft token exactly when it is the target's argmax, and the
residual at the first rejection is the one-hot of the target's argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def processed_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """Next-token probabilities after temperature.

    Args:
      logits: float ``[B, ..., V]``.
      temperature: float32 ``[B]``; 0 selects greedy (one-hot on the first argmax).

    Returns:
      float32 ``[B, ..., V]``, each row summing to 1.
    """
    logits = logits.astype(jnp.float32)
    t = temperature.reshape(temperature.shape + (1,) * (logits.ndim - 1))
    # Subtract the max before dividing: a tiny temperature would otherwise overflow to inf - inf.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    soft = jax.nn.softmax(shifted / jnp.where(t > 0, t, 1.0), axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(t > 0, soft, hard)


def fold_rows(keys: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in(keys[b], data)`` for every row of a ``[B]`` key array.

    ``data`` is an int or int32 scalar (may be traced), e.g. a step index or a purpose tag; rows
    stay independent, so a row's draws never depend on the batch it is in.
    """
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per row: ``keys`` is a ``[B]`` key array, ``probs`` float32 ``[B, V]``.

    Returns int32 ``[B]``. Each row uses only its own key, so a row's draw does not depend on
    the batch it is in. Gumbel-max over ``log(probs)`` (``jax.random.categorical``): a one-hot
    row always yields its hot index and zero-probability tokens are never drawn.
    """
    draw = lambda k, pr: jax.random.categorical(k, jnp.log(pr), axis=-1)  # noqa: E731
    return jax.vmap(draw)(keys, probs).astype(jnp.int32)
