"""Drafting with a smaller model: a separate draft model, or the target's own first layers.

- ``ModelDrafter``: a separate draft model sharing the target's vocabulary (Leviathan et al.
  2023; Chen et al. 2023).
- ``EarlyExitDrafter``: self-speculation with the target's first ``n_layers`` blocks followed
  by its final norm and output head, no training needed (the "early-exit" drafting of
  Elhoushi et al. 2024, "LayerSkip", Sec. 4; Zhang et al. 2024, "Draft & Verify").

Both keep their own static KV cache. Each ``propose`` starts by re-reading the two newest
tokens (positions ``seq_len - 2`` and ``seq_len - 1``): that rewrites the one cache slot that
is missing after a fully accepted window (the last draft is never fed to the drafter), so the
drafter needs no bookkeeping of what was accepted and ``commit`` is the identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import check_gamma
from jaxspec.models import llama
from jaxspec.sampling import fold_rows, processed_probs, sample


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """Draft ``gamma`` tokens autoregressively with a small Llama-family model.

    Attributes:
      config: the draft model's ``ModelConfig``; ``vocab_size`` must equal the target's.
      gamma: draft tokens per step (>= 1).

    Raises:
      ValueError: ``gamma`` < 1 (at construction); vocabulary sizes, BOS or EOS ids differ, or
        no draft params (at ``validate``, before any compile). ``jaxspec.check_pair`` also
        compares the tokenizers' strings of two loaded models.
    """

    config: ModelConfig
    gamma: int = 4

    def __post_init__(self):
        check_gamma(self.gamma)

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return drafter_params

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        from jaxspec.checkpoints.pairing import check_configs

        check_configs(target_config, self.config)  # vocabulary size, BOS, EOS
        if drafter_params is None:
            raise ValueError("ModelDrafter needs drafter_params (the draft model's weights)")

    def init(self, params, prompt, prompt_lens, max_len):
        cache = KVCache.zeros(self.config, prompt.shape[0], max_len, params["embed"].dtype)
        positions = jnp.broadcast_to(jnp.arange(prompt.shape[1], dtype=jnp.int32), prompt.shape)
        _, cache = llama.forward_hidden(params, self.config, prompt, positions, cache, visible_slots=prompt.shape[1])
        return cache

    def propose(self, params, cache, tokens, seq_lens, keys, sampling, history):
        cfg = self.config
        positions = (seq_lens - 2)[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        window = jnp.take_along_axis(tokens, positions, axis=1)
        hidden, cache = llama.forward_hidden(params, cfg, window, positions, cache)

        def draft(hidden, history, i):
            # q: the drafter's distribution after the same processing as the target's p.
            q = processed_probs(llama.logits_from_hidden(params, cfg, hidden), sampling, history)
            d = sample(fold_rows(keys, i), q)
            return d, q, history.add(d[:, None], jnp.ones_like(d[:, None], bool))

        d0, q0, history = draft(hidden[:, -1], history, 0)

        def step(carry, i):
            cache, token, history = carry
            pos = (seq_lens - 1 + i)[:, None]
            hidden, cache = llama.forward_hidden(params, cfg, token[:, None], pos, cache)
            d, q, history = draft(hidden[:, 0], history, i)
            return (cache, d, history), (d, q)

        (cache, _, _), (ds, qs) = jax.lax.scan(step, (cache, d0, history), jnp.arange(1, self.gamma, dtype=jnp.int32))
        drafts = jnp.concatenate([d0[:, None], ds.T], axis=1)
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        return cache, drafts, q

    def commit(self, params, cache, tokens, seq_lens, n_accepted):
        return cache


@dataclasses.dataclass(frozen=True, init=False)
class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first ``n_layers`` blocks, final norm and head.

    Args:
      target_config: the target's ``ModelConfig``.
      n_layers: blocks to keep, ``1 <= n_layers < target_config.n_layers``.
      gamma: draft tokens per step (>= 1).

    The drafter's params are a view of the target's (no copy): ``select_params`` slices them.

    Raises:
      ValueError: ``n_layers`` or ``gamma`` out of range (at construction); a target whose
        config is not the one this drafter was built for (at ``validate``).
    """

    n_layers: int = 1
    # class attribute, not a field: its params are the target's, so it runs on the target's
    # shards under a mesh (``jaxspec.sharding``)
    shares_target_weights = True

    def __init__(self, target_config: ModelConfig, n_layers: int, gamma: int = 4):
        if not isinstance(n_layers, int) or not 1 <= n_layers < target_config.n_layers:
            raise ValueError(
                f"n_layers for early exit must be in [1, {target_config.n_layers - 1}] "
                f"(the target has {target_config.n_layers} layers), got {n_layers}"
            )
        object.__setattr__(self, "config", target_config.truncated(n_layers))
        object.__setattr__(self, "gamma", gamma)
        object.__setattr__(self, "n_layers", n_layers)
        check_gamma(gamma)

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return {**target_params, "layers": list(target_params["layers"][: self.n_layers])}

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        if target_config.truncated(self.n_layers) != self.config:
            raise ValueError(f"EarlyExitDrafter was built for {self.config.name}, not the target {target_config.name}")
