"""The generation program: prefill, then a ``lax.while_loop`` of draft -> verify -> accept ->
commit steps, compiled once into one XLA program with no host round trip per step.

    program = jit(prefill(target, drafter) -> while_loop(any row not done, spec_step, state))

Per step (``_spec_step``) every row drafts ``gamma`` tokens, the target scores
``[last, d_1..d_gamma]`` in ONE forward, ``jaxspec.acceptance.accept`` keeps ``n_accepted``
drafts plus one replacement/bonus token, and each row advances by its own count, cut at the
first stop id or completed stop string (``jaxspec.stopping``) and at its ``max_new_tokens``.
Rows never wait for each other; finished rows idle until every row is done.
``drafter=None`` is plain autoregressive decoding through the same loop (``gamma = 0``).

Sampling settings travel as per-row arrays (``SamplingParams``); the loop carries the
``History`` of generated tokens that penalties and ``min_new_tokens`` read, so verify
position t is processed exactly as plain decoding would process it after d_1..d_t.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import acceptance, cache as cache_lib, stopping
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.sampling import History, SamplingParams, fold_rows, processed_probs, sample, token_logprobs
from jaxspec.stopping import StopTables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of the tokens in the token buffer (slot i scores ``tokens[:, i]``).

    Attributes:
      chosen: float32 ``[B, S]``; top_ids: int32 ``[B, S, N]``; top: float32 ``[B, S, N]``,
      the N most probable tokens at each slot, most probable first.
    """

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """Everything the while loop carries (shape letters: B batch, S cache slots, G gamma)."""

    tokens: jax.Array  # int32 [B, S]: prompt, then generated tokens
    seq_lens: jax.Array  # int32 [B]: tokens so far; the last is not yet in the target cache
    done: jax.Array  # bool [B]
    cache: KVCache  # target cache, valid for slots < seq_lens - 1
    drafter_state: Any
    history: History  # generated-token counts for penalties and min_new_tokens
    tail: jax.Array  # int32 [B, K]: last bytes of generated text, for stop strings
    logprobs: Logprobs | None  # None unless requested
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
    sampling: SamplingParams  # per-row settings, stop ids included
    keys: jax.Array  # [B] PRNG keys
    stops: StopTables  # stop strings (possibly none) and the token byte table


@dataclasses.dataclass(frozen=True)
class LogprobsSpec:
    """Static logprobs request: ``n_top`` alternatives per token, of the ``raw`` model
    distribution (log-softmax of the logits) or the ``processed`` one (what is sampled from)."""

    n_top: int = 0
    mode: str = "raw"

    def of(self, logits: jax.Array, probs: jax.Array, tokens: jax.Array):
        """``token_logprobs`` of ``tokens [B, T]`` under logits/probs ``[B, T, V]``."""
        source = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1) if self.mode == "raw" else jnp.log(probs)
        return token_logprobs(source, tokens, self.n_top)


def _write_logprobs(lp: Logprobs | None, values, start) -> Logprobs | None:
    if lp is None:
        return None
    chosen, top_ids, top = values
    return Logprobs(
        cache_lib.write(lp.chosen, chosen, start),
        cache_lib.write(lp.top_ids, top_ids, start),
        cache_lib.write(lp.top, top, start),
    )


def _stop_strings(stops: StopTables, tail, new, allowed):
    """Append ``new [B, T]`` token by token to ``tail``; returns the tails after each token
    ``[B, T, K]`` and where a stop string completed ``bool [B, T]`` (counted where ``allowed``)."""

    def scan(tail):
        tails, hits = [], []
        for j in range(new.shape[1]):
            tail, hit = stopping.append(stops, tail, new[:, j])
            tails.append(tail)
            hits.append(hit)
        return jnp.stack(tails, axis=1), jnp.stack(hits, axis=1) & allowed

    skip = lambda tail: (jnp.repeat(tail[:, None], new.shape[1], axis=1), jnp.zeros(new.shape, bool))  # noqa: E731
    return jax.lax.cond(jnp.any(stops.active), scan, skip, tail)


def _may_stop(sp: SamplingParams, n_generated, width: int):
    """bool ``[B, width]``: whether a stop string completed by the j-th of the next ``width``
    tokens (generated token number ``n_generated + j``, from 0) counts: only once the output
    holds ``min_new_tokens`` tokens, as vLLM."""
    return (n_generated[:, None] + jnp.arange(width)[None] + 1) >= sp.min_new_tokens[:, None]


def _prefill(target, config: ModelConfig, drafter, drafter_params, inputs: Inputs, max_len: int, gamma: int,
             logprobs: LogprobsSpec | None):
    b, p = inputs.prompt.shape
    sp = inputs.sampling
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = KVCache.zeros(config, b, max_len, target["embed"].dtype)
    hidden, cache = llama.forward_hidden(target, config, inputs.prompt, positions, cache, visible_slots=p)
    last_hidden = jnp.take_along_axis(hidden, (inputs.prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    logits = llama.logits_from_hidden(target, config, last_hidden)[:, None]  # [B, 1, V]
    history = History.from_prompt(inputs.prompt, inputs.prompt_lens, config.vocab_size)
    probs = processed_probs(logits, sp, history)
    first = sample(fold_rows(fold_rows(inputs.keys, 0), 1), probs[:, 0])

    tokens = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(inputs.prompt)
    tokens = cache_lib.write(tokens, first[:, None], inputs.prompt_lens)
    lp = None
    if logprobs is not None:
        n = logprobs.n_top
        lp = Logprobs(jnp.zeros((b, max_len)), jnp.zeros((b, max_len, n), jnp.int32), jnp.zeros((b, max_len, n)))
        lp = _write_logprobs(lp, logprobs.of(logits, probs, first[:, None]), inputs.prompt_lens)
    tails, hit = _stop_strings(inputs.stops, stopping.empty_tail(b, inputs.stops), first[:, None],
                               _may_stop(sp, history.n_generated, 1))
    drafter_state = None if drafter is None else drafter.init(drafter_params, inputs.prompt, inputs.prompt_lens, max_len)
    zeros = jnp.zeros((b,), jnp.int32)
    return LoopState(
        tokens=tokens,
        seq_lens=inputs.prompt_lens + 1,
        done=sp.is_stop(first[:, None])[:, 0] | hit[:, 0] | (inputs.max_new_tokens <= 1),
        cache=cache,
        drafter_state=drafter_state,
        history=history.add(first[:, None], jnp.ones((b, 1), bool)),
        tail=tails[:, 0],
        logprobs=lp,
        step=jnp.int32(0),
        n_steps=zeros,
        n_drafted=zeros,
        n_accepted=zeros,
        accepted_at=jnp.zeros((b, gamma), jnp.int32),
    )


def _verify(target, config, inputs: Inputs, keys, s: LoopState, last, drafts, q, width: int, logprobs):
    """Target forward over ``[last, d_1..d_width]`` and acceptance; outputs padded to gamma + 1."""
    b, gamma = drafts.shape
    d, q = drafts[:, :width], None if q is None else q[:, :width]
    window = jnp.concatenate([last, jnp.where(d >= 0, d, last)], axis=1)  # [B, width + 1]
    positions = (s.seq_lens - 1)[:, None] + jnp.arange(width + 1, dtype=jnp.int32)[None]
    logits, _, cache = llama.forward(target, config, window, positions, s.cache)
    p = processed_probs(logits, inputs.sampling, s.history, d)
    n_acc, new = acceptance.accept(fold_rows(keys, 1), p, q, d)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, gamma - width)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    lp = None if logprobs is None else tuple(pad(x) for x in logprobs.of(logits, p, new))
    return n_acc, pad(new), cache, lp


def _spec_step(target, config, drafter, drafter_params, inputs: Inputs, gamma: int, logprobs, s: LoopState):
    keys = fold_rows(inputs.keys, s.step + 1)
    last = jnp.take_along_axis(s.tokens, (s.seq_lens - 1)[:, None], axis=1)
    b = last.shape[0]
    sp = inputs.sampling
    with jax.named_scope("draft"):
        if drafter is None:
            drafter_state, drafts, q = None, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, config.vocab_size))
        else:
            drafter_state, drafts, q = drafter.propose(
                drafter_params, s.drafter_state, s.tokens, s.seq_lens, fold_rows(keys, 0), sp, s.history
            )
    with jax.named_scope("verify"):
        verify = lambda n: _verify(target, config, inputs, keys, s, last, drafts, q, n, logprobs)  # noqa: E731
        if getattr(drafter, "abstains", False):
            # No row has a draft: a one-token step costs less than verifying a dead window.
            has_draft = jnp.any((drafts[:, 0] >= 0) & ~s.done)
            n_acc, new, cache, lp = jax.lax.cond(has_draft, lambda: verify(gamma), lambda: verify(0))
        else:
            n_acc, new, cache, lp = verify(gamma)
    with jax.named_scope("commit"):
        slot = jnp.arange(gamma + 1)[None]
        in_block = slot <= n_acc[:, None]
        may_stop = in_block & _may_stop(sp, s.history.n_generated, gamma + 1)
        tails, string_stop = _stop_strings(inputs.stops, s.tail, new, may_stop)
        is_stop = (sp.is_stop(new) | string_stop) & in_block
        first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), gamma + 1)
        room = inputs.max_new_tokens - (s.seq_lens - inputs.prompt_lens)
        n_keep = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), room)
        active = ~s.done
        n_keep = jnp.where(active, n_keep, 0)
        tokens = cache_lib.write(s.tokens, new, s.seq_lens)
        seq_lens = s.seq_lens + n_keep
        done = s.done | (first_stop < n_keep) | (n_keep >= room)
        kept_tail = jnp.take_along_axis(tails, jnp.maximum(n_keep - 1, 0)[:, None, None], axis=1)[:, 0]
        tail = jnp.where((n_keep > 0)[:, None], kept_tail, s.tail)
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
        history=s.history.add(new, slot < n_keep[:, None]),
        tail=tail,
        logprobs=_write_logprobs(s.logprobs, lp, s.seq_lens),
        step=s.step + 1,
        n_steps=s.n_steps + counted,
        n_drafted=s.n_drafted + n_drafted,
        n_accepted=s.n_accepted + n_acc * counted,
        accepted_at=s.accepted_at + (slot[:, :gamma] < n_acc[:, None]) * counted[:, None],
    )


def run_program(
    target, drafter_params, inputs: Inputs, *, config: ModelConfig, drafter, max_len: int,
    logprobs: LogprobsSpec | None = None,
) -> LoopState:
    """The whole generation as one traceable function (jit it with the static keywords).

    Args:
      target: target params pytree; drafter_params: the drafter's (from ``select_params``).
      inputs: ``Inputs``; config: target ``ModelConfig``; drafter: a ``Drafter`` or None;
      max_len: S, slots of every cache and of the token buffer; the caller guarantees
        ``prompt_lens + max_new_tokens + gamma + 1 <= S``.
      logprobs: what log-probabilities to record (``LoopState.logprobs``), or None.

    Returns:
      The final ``LoopState``.
    """
    gamma = 0 if drafter is None else drafter.gamma
    state = _prefill(target, config, drafter, drafter_params, inputs, max_len, gamma, logprobs)
    step = lambda s: _spec_step(target, config, drafter, drafter_params, inputs, gamma, logprobs, s)  # noqa: E731
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
