"""The drafter protocol: what the engine asks of every way of proposing draft tokens.

A drafter is a frozen, hashable object (it is a static argument of the compiled program);
its weights, if any, travel separately as a params pytree so they are traced, not baked in.
The engine owns the token buffer and the target; a drafter only sees the tokens so far:

- ``tokens``: int32 ``[B, S]``, prompt then generated tokens at their absolute positions;
  slots at and past ``seq_lens[b]`` are stale and must not be read as context.
- ``seq_lens``: int32 ``[B]``, tokens per row so far; the last one, ``tokens[b, seq_lens[b]-1]``,
  is the token the next draft continues from.

Drafters know nothing of the engine's loop: ``init`` builds the drafter's state after the
prompt, ``propose`` returns ``gamma`` draft tokens per row, ``commit`` rolls the state forward
after verification. Deterministic drafters return ``q = None`` (``jaxspec.acceptance`` then
treats the proposal as one-hot). A draft of ``-1`` means "nothing to propose here"; a drafter
with the class attribute ``abstains = True`` may return only -1s, and when no row has a draft
the engine runs a cheaper one-token step (``jaxspec.engine``).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxspec.config import ModelConfig


class Drafter(Protocol):
    """Protocol of all drafters. ``gamma`` (>= 1) is the static number of draft tokens."""

    gamma: int

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        """The params pytree the drafter runs on (its own weights, a view of the target's, or None)."""

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        """Raise ``ValueError`` naming the problem if this drafter cannot serve the target."""

    def init(self, params: Any, prompt: jax.Array, prompt_lens: jax.Array, max_len: int) -> Any:
        """Drafter state after reading ``prompt`` int32 ``[B, P]`` (row ``b`` valid up to
        ``prompt_lens[b]``), for sequences of at most ``max_len`` tokens."""

    def propose(self, params, state, tokens, seq_lens, keys, sampling, history):
        """Draft ``gamma`` tokens per row.

        Args:
          keys: ``[B]`` PRNG keys for this step.
          sampling: ``jaxspec.sampling.SamplingParams``; history: ``jaxspec.sampling.History``
            of the text so far. A drafter with q must return the distributions its drafts were
            drawn from; processing its logits like the target's (``processed_probs``, with the
            history advanced by its own drafts) keeps q close to p.
        Returns:
          ``(state, drafts int32[B, gamma], q float32[B, gamma, V] or None)``.
        """

    def commit(self, params, state, tokens, seq_lens, n_accepted):
        """State after the engine kept ``n_accepted`` int32 ``[B]`` drafts and advanced
        ``seq_lens`` (already updated; ``tokens`` holds the emitted tokens)."""


def check_gamma(gamma: int) -> None:
    """Raise ``ValueError`` unless ``gamma`` is an int >= 1."""
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 for a drafter, got {gamma!r}")
