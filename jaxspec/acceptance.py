"""Speculative acceptance: which draft tokens to keep and which token to add.

The rule is speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Alg. 2): draft token ``d_i`` is accepted with probability
``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the replacement is drawn from the
residual ``norm(max(0, p_i - q_i))``; when all ``gamma`` drafts are accepted a bonus token is
drawn from ``p_gamma``. The emitted tokens then follow p exactly.

One rule covers every case:
- greedy (temperature 0): p and q are one-hot (``jaxspec.sampling``), so ``d_i`` is accepted
  iff it equals the target's argmax and the replacement is that argmax;
- deterministic drafters (n-gram lookup) propose without q: q is the one-hot of the draft, so
  ``d_i`` is accepted with probability ``p_i(d_i)`` and the residual is p without ``d_i``
  (the rule that is exact for a one-hot proposal);
- plain decoding is ``gamma = 0``: the "bonus" token is a sample from p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.sampling import fold_rows, sample


def accept(keys: jax.Array, p: jax.Array, q: jax.Array | None, drafts: jax.Array):
    """Verify a window of draft tokens against the target.

    Args:
      keys: ``[B]`` PRNG key array, one per row (a row's result depends only on its own key).
      p: float32 ``[B, gamma + 1, V]``, target's processed distributions at the positions
        after ``last, d_1, ..., d_gamma``.
      q: float32 ``[B, gamma, V]``, drafter's processed distributions ``d_i`` was drawn from,
        or ``None`` for deterministic drafters (treated as one-hot on ``drafts``).
      drafts: int32 ``[B, gamma]``; ``-1`` marks "no draft" (a drafter that found nothing to
        propose): that position is rejected and its replacement drawn from p itself, which is
        what q = 0 gives in the residual.

    Returns:
      ``(n_accepted int32[B] in [0, gamma], tokens int32[B, gamma + 1])``: the first
      ``n_accepted + 1`` entries of ``tokens`` are the emitted tokens (the accepted drafts,
      then the replacement or bonus token); later entries are unspecified.
    """
    b, g1, v = p.shape
    gamma = g1 - 1
    valid = drafts >= 0
    q = jax.nn.one_hot(drafts, v, dtype=p.dtype) if q is None else jnp.where(valid[..., None], q, 0.0)
    drafts = jnp.where(valid, drafts, 0)
    key_u, key_r = fold_rows(keys, 0), fold_rows(keys, 1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(key_u)
    p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    accepted = valid & (u * q_d < p_d)  # u < min(1, p/q) without dividing; q_d > 0 for a sampled d
    n_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)

    p_next = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)
    q_next = jnp.take_along_axis(q_pad, n_accepted[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p == q at a rejected position, which has probability 0; fall back to p.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    next_token = sample(key_r, residual)

    drafts_pad = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    positions = jnp.arange(g1)[None, :]
    tokens = jnp.where(positions < n_accepted[:, None], drafts_pad, next_token[:, None])
    return n_accepted, tokens.astype(jnp.int32)
