"""N-gram prompt lookup drafting, computed on device.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's
last n tokens, trying n from ``max_n`` down to ``min_n`` (Saxena 2023, "Prompt Lookup
Decoding"; Hugging Face's ``prompt_lookup_num_tokens``, vLLM's ``ngram`` method). Context is
the prompt plus everything generated so far. Choices, written down:

- the most recent match wins (Hugging Face takes the earliest): in generated text that repeats
  itself, the latest occurrence is the likeliest continuation;
- when the match's continuation runs into the present, it repeats with the match's period
  (tokens ``[j + n, seq_len)`` cycled), which drafts loops and lists well;
- ``min_n`` defaults to 2: single-token matches draft poorly (on 8 Spec-Bench prompts with
  SmolLM2 on CPU, min_n 1 gave tau 1.43 but 0.99x plain speed, min_n 2 tau 1.31 and 1.10x,
  since a dead window costs a 5-token verify instead of a 1-token step);
- with no match it abstains (drafts are -1, see ``jaxspec.acceptance``); when no row of the
  batch has a draft the engine runs a one-token step instead of verifying an empty window.

Deterministic: ``q`` is ``None``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.drafters.base import check_gamma

MAX_NGRAM = 16  # the lookup unrolls over n-gram sizes: compile time grows ~quadratically


def lookup(row: jax.Array, n: jax.Array, gamma: int, max_n: int, min_n: int) -> jax.Array:
    """Drafts for one sequence.

    Args:
      row: int32 ``[S]`` tokens, valid before ``n``.
      n: int32 scalar, number of valid tokens (>= 1).

    Returns:
      int32 ``[gamma]``, all -1 when nothing matched.
    """
    s = row.shape[0]
    start = jnp.int32(-1)  # first continuation slot of the chosen match
    for size in range(max_n, min_n - 1, -1):
        if size >= s:
            continue
        pattern = jax.lax.dynamic_slice_in_dim(row, jnp.maximum(n - size, 0), size)
        j = jnp.arange(s - size + 1)
        match = (j + size < n) & (n >= size)  # an earlier window with at least one token after it
        for i in range(size):
            match &= row[i : s - size + 1 + i] == pattern[i]
        latest = jnp.max(jnp.where(match, j + size, -1))
        start = jnp.where(start >= 0, start, latest)
    period = jnp.maximum(n - start, 1)
    offsets = jnp.arange(gamma) % period
    drafts = row[jnp.clip(start + offsets, 0, s - 1)]
    return jnp.where(start >= 0, drafts, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
    """Prompt-lookup drafter.

    Attributes:
      gamma: draft tokens per step (>= 1).
      max_n: longest n-gram matched (>= min_n).
      min_n: shortest n-gram matched (>= 1).

    Raises:
      ValueError: at construction, for gamma < 1 or n-gram sizes out of range.
    """

    gamma: int = 4
    max_n: int = 3
    min_n: int = 2
    abstains = True  # class attribute, not a field: may return no drafts (-1)

    def __post_init__(self):
        check_gamma(self.gamma)
        if not 1 <= self.min_n <= self.max_n <= MAX_NGRAM:
            raise ValueError(
                f"n-gram sizes need 1 <= min_n <= max_n <= {MAX_NGRAM} (compile time grows with max_n), "
                f"got min_n={self.min_n}, max_n={self.max_n}"
            )

    def select_params(self, target_params, drafter_params):
        return None

    def validate(self, target_config: ModelConfig, drafter_params) -> None:
        return None

    def init(self, params, prompt, prompt_lens, max_len):
        return None

    def propose(self, params, state, tokens, seq_lens, keys, sampling, history):
        drafts = jax.vmap(lambda row, n: lookup(row, n, self.gamma, self.max_n, self.min_n))(tokens, seq_lens)
        return state, drafts, None

    def commit(self, params, state, tokens, seq_lens, n_accepted):
        return state
