"""The generation program: prefill, then a ``lax.while_loop`` of draft -> verify -> accept ->
commit steps, compiled once into one XLA program with no host round trip per step.

    program = jit(prefill(target, drafter) -> while_loop(any row not done, spec_step, state))

Per step (``_spec_step``) every row drafts ``gamma`` tokens, the target scores
``[last, d_1..d_gamma]`` in ONE forward, ``jaxspec.acceptance.accept`` keeps ``n_accepted``
drafts plus one replacement/bonus token, and each row advances by its own count, cut at the
first stop id and at its ``max_new_tokens``. Rows never wait for each other; finished rows
idle until every row is done. ``drafter=None`` is plain autoregressive decoding through the
same loop (``gamma = 0``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import acceptance, cache as cache_lib
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.sampling import fold_rows, processed_probs, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything the while loop carries (shape letters: B batch, S cache slots, G gamma)."""

    tokens: jax.Array  # int32 [B, S]: prompt, then generated tokens
    seq_lens: jax.Array  # int32 [B]: tokens so far; the last is not yet in the target cache
    done: jax.Array  # bool [B]
    cache: KVCache  # target cache, valid for slots < seq_lens - 1
    drafter_state: Any
    step: jax.Array  # int32 scalar: loop iterations so far
    n_steps: jax.Array  # int32 [B]: target verify forwards while the row was active
    n_drafted: jax.Array  # int32 [B]: draft tokens proposed (a drafter may abstain)
    n_accepted: jax.Array  # int32 [B]: draft tokens accepted by verification
    accepted_at: jax.Array  # int32 [B, G]: times draft position i was accepted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """Per-call arrays: changing their values never recompiles."""

    prompt: jax.Array  # int32 [B, P], right-padded
    prompt_lens: jax.Array  # int32 [B]
    max_new_tokens: jax.Array  # int32 [B]
    temperature: jax.Array  # float32 [B]
    keys: jax.Array  # [B] PRNG keys
    stop_ids: jax.Array  # int32 [E], padded with -1


def _prefill(target, config: ModelConfig, drafter, drafter_params, inputs: Inputs, max_len: int, gamma: int):
    b, p = inputs.prompt.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = KVCache.zeros(config, b, max_len, target["embed"].dtype)
    hidden, cache = llama.forward_hidden(target, config, inputs.prompt, positions, cache, visible_slots=p)
    last_hidden = jnp.take_along_axis(hidden, (inputs.prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    probs = processed_probs(llama.logits_from_hidden(target, config, last_hidden), inputs.temperature)
    first = sample(fold_rows(fold_rows(inputs.keys, 0), 1), probs)

    tokens = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(inputs.prompt)
    tokens = cache_lib.write(tokens, first[:, None], inputs.prompt_lens)
    drafter_state = None if drafter is None else drafter.init(drafter_params, inputs.prompt, inputs.prompt_lens, max_len)
    zeros = jnp.zeros((b,), jnp.int32)
    return LoopState(
        tokens=tokens,
        seq_lens=inputs.prompt_lens + 1,
        done=jnp.isin(first, inputs.stop_ids) | (inputs.max_new_tokens <= 1),
        cache=cache,
        drafter_state=drafter_state,
        step=jnp.int32(0),
        n_steps=zeros,
        n_drafted=zeros,
        n_accepted=zeros,
        accepted_at=jnp.zeros((b, gamma), jnp.int32),
    )


def _verify(target, config, inputs: Inputs, keys, s: LoopState, last, drafts, q, width: int):
    """Target forward over ``[last, d_1..d_width]`` and acceptance; outputs padded to gamma + 1."""
    b, gamma = drafts.shape
    d, q = drafts[:, :width], None if q is None else q[:, :width]
    window = jnp.concatenate([last, jnp.where(d >= 0, d, last)], axis=1)  # [B, width + 1]
    positions = (s.seq_lens - 1)[:, None] + jnp.arange(width + 1, dtype=jnp.int32)[None]
    logits, _, cache = llama.forward(target, config, window, positions, s.cache)
    p = processed_probs(logits, inputs.temperature)
    n_acc, new = acceptance.accept(fold_rows(keys, 1), p, q, d)
    return n_acc, jnp.pad(new, ((0, 0), (0, gamma - width))), cache


def _spec_step(target, config, drafter, drafter_params, inputs: Inputs, gamma: int, s: LoopState) -> LoopState:
    keys = fold_rows(inputs.keys, s.step + 1)
    last = jnp.take_along_axis(s.tokens, (s.seq_lens - 1)[:, None], axis=1)
    b = last.shape[0]
    with jax.named_scope("draft"):
        if drafter is None:
            drafter_state, drafts, q = None, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, config.vocab_size))
        else:
            drafter_state, drafts, q = drafter.propose(
                drafter_params, s.drafter_state, s.tokens, s.seq_lens, fold_rows(keys, 0), inputs.temperature
            )
    with jax.named_scope("verify"):
        verify = lambda n: _verify(target, config, inputs, keys, s, last, drafts, q, n)  # noqa: E731
        if getattr(drafter, "abstains", False):
            # No row has a draft: a one-token step costs less than verifying a dead window.
            has_draft = jnp.any((drafts[:, 0] >= 0) & ~s.done)
            n_acc, new, cache = jax.lax.cond(has_draft, lambda: verify(gamma), lambda: verify(0))
        else:
            n_acc, new, cache = verify(gamma)
    with jax.named_scope("commit"):
        slot = jnp.arange(gamma + 1)[None]
        n_emitted = s.seq_lens - inputs.prompt_lens
        is_stop = jnp.isin(new, inputs.stop_ids) & (slot <= n_acc[:, None])
        first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), gamma + 1)
        room = inputs.max_new_tokens - n_emitted
        n_keep = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), room)
        active = ~s.done
        n_keep = jnp.where(active, n_keep, 0)
        tokens = cache_lib.write(s.tokens, new, s.seq_lens)
        seq_lens = s.seq_lens + n_keep
        done = s.done | (first_stop < n_keep) | (n_keep >= room)
        if drafter is not None:
            drafter_state = drafter.commit(drafter_params, drafter_state, tokens, seq_lens, n_acc)
        counted = active.astype(jnp.int32)
        n_drafted = jnp.sum(jnp.cumprod(drafts >= 0, axis=1), axis=1) * counted
    return LoopState(
        tokens=tokens,
        seq_lens=seq_lens,
        done=done,
        cache=cache,
        drafter_state=drafter_state,
        step=s.step + 1,
        n_steps=s.n_steps + counted,
        n_drafted=s.n_drafted + n_drafted,
        n_accepted=s.n_accepted + n_acc * counted,
        accepted_at=s.accepted_at + (slot[:, :gamma] < n_acc[:, None]) * counted[:, None],
    )


def run_program(target, drafter_params, inputs: Inputs, *, config: ModelConfig, drafter, max_len: int) -> LoopState:
    """The whole generation as one traceable function (jit it with the static keywords).

    Args:
      target: target params pytree; drafter_params: the drafter's (from ``select_params``).
      inputs: ``Inputs``; config: target ``ModelConfig``; drafter: a ``Drafter`` or None;
      max_len: S, slots of every cache and of the token buffer; the caller guarantees
        ``prompt_lens + max_new_tokens + gamma + 1 <= S``.

    Returns:
      The final ``LoopState``.
    """
    gamma = 0 if drafter is None else drafter.gamma
    state = _prefill(target, config, drafter, drafter_params, inputs, max_len, gamma)
    step = lambda s: _spec_step(target, config, drafter, drafter_params, inputs, gamma, s)  # noqa: E731
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
