"""The generation program: prefill, then a ``lax.while_loop`` of draft -> verify -> accept ->
commit steps, compiled once into one XLA program with no host round trip per step.

    program = jit(prefill(target, drafter) -> while_loop(any row not done, spec_step, state))

Per step (``_spec_step``) every row's drafter proposes a tree of N nodes (``jaxspec.tree``; a
chain of gamma drafts is the special case), the target scores the window
``[last token, nodes]`` in ONE forward with the tree's ancestor mask at positions
``committed length + depth`` (``_verify``; the forward reads the cache and keeps the window's
keys and values apart), ``jaxspec.acceptance.accept`` keeps the accepted path plus one
replacement/bonus token, only that path's keys and values are written, in contiguous slots
after the committed text (``cache.write_tree``), and each row advances by its own count, cut at the first stop id or
completed stop string (``jaxspec.stopping``) and at its ``max_new_tokens`` along the path.
Rows never wait for each other; finished rows idle until every row is done.
``drafter=None`` is plain autoregressive decoding through the same loop (an empty tree).
With ``Inputs.grammar`` (structured output, ``jaxspec.grammar``) every row carries its
automaton's state: the target's distribution at each window entry is masked to the tokens
the state after the path to it allows, and a token after which the automaton allows
nothing ends the row.
With ``Inputs.gate_tau`` (``jaxspec.policy``'s acceptance gate) a row whose tokens per verify
step over its last ``policy.GATE_WINDOW`` steps fell below its threshold stops speculating:
its drafts are masked out, and once no active row speculates the program leaves the loop for
a second one of plain steps (``run_program``), which never runs the drafter.
On a backend in ``MIN_PASS_TOKENS`` (an accelerator whose 1-token pass is slower than a
2-token one) a plain step's pass and an abstaining drafter's narrowest verify run at least
that many tokens (``run_program``).
The acceptance rule is static (``run_program``'s ``rule``): ``acceptance.EXACT``, or, for
benchmarks only, ``synthetic.SYNTHETIC``: random acceptance at the rates
``Inputs.synthetic_rates`` (``jaxspec.synthetic``, NOT lossless), which verifies the full
window every step and never gates; nothing else changes.

Sampling settings travel as per-row arrays (``SamplingParams``); the loop carries the
``History`` of generated tokens that penalties and ``min_new_tokens`` read, so the token
after window entry w is processed exactly as plain decoding would process it after the path
to w (``jaxspec.sampling.window_counts``).

The target is read only through the ``TargetModel`` protocol (``jaxspec.models.target``):
jaxspec's own decoder (``Decoder``) or a model of the user's own.

Shape letters: the package legend (``jaxspec``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import acceptance, cache as cache_lib, grammar, models, policy, stopping, synthetic
from jaxspec.config import ModelConfig
from jaxspec.models.target import TargetModel, as_target
from jaxspec.drafters.base import Committed, Context, Prefill
from jaxspec.sampling import History, SamplingParams, first_argmax, fold_rows, processed_probs, sample, token_logprobs
from jaxspec.stopping import StopTables
from jaxspec.tree import Proposal, Tree


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
    """Everything the while loop carries (gamma: the drafter's deepest proposal)."""

    tokens: jax.Array  # int32 [B, S]: prompt, then generated tokens
    seq_lens: jax.Array  # int32 [B]: tokens so far; the last is not yet in the target cache
    done: jax.Array  # bool [B]
    cache: Any  # target cache (TargetModel.init_cache; a KVCache for jaxspec's decoder), valid for slots < seq_lens - 1
    drafter_state: Any
    history: History  # generated-token counts for penalties and min_new_tokens
    tail: jax.Array  # int32 [B, L]: last bytes of generated text, for stop strings
    logprobs: Logprobs | None  # None unless requested
    step: jax.Array  # int32 scalar: loop iterations so far
    n_steps: jax.Array  # int32 [B]: target verify forwards while the row was active
    n_drafted: jax.Array  # int32 [B]: valid draft nodes proposed (a drafter may abstain)
    n_accepted: jax.Array  # int32 [B]: accepted draft tokens that were emitted (not cut by a stop)
    accepted_at: jax.Array  # int32 [B, gamma]: times an accepted draft at depth i + 1 was emitted
    speculating: jax.Array  # bool [B]: the acceptance gate has not turned the row's drafts off
    recent: jax.Array  # int32 [B, GATE_WINDOW]: tokens emitted by the row's last verify steps (a ring)
    # int32 [B]: each row's automaton state after its text (jaxspec.grammar), or None (no grammar)
    grammar_state: jax.Array | None = None
    # int32 [B, F]: how each row's target spelled each forced text last (jaxspec.grammar.remember), or None
    spelling: jax.Array | None = None


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
    # float32 [B, gamma]: conditional acceptance rates of SYNTHETIC acceptance (jaxspec.synthetic,
    # not lossless; ``run_program(rule=synthetic.SYNTHETIC)``), or None (the default: real verification).
    synthetic_rates: jax.Array | None = None
    # float32 [B]: the acceptance gate's threshold per row (jaxspec.policy), or None (no gate,
    # static): a row whose mean tokens per verify step over its last GATE_WINDOW steps is below
    # it stops speculating.
    gate_tau: jax.Array | None = None
    # the call's structured-output automata (jaxspec.grammar.GrammarTables), or None (static):
    # every target distribution is masked to the tokens a row's automaton allows.
    grammar: grammar.GrammarTables | None = None


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


def _capture(drafter) -> tuple[int, ...]:
    return () if drafter is None else drafter.capabilities.capture


def _prefill(target, model: TargetModel, drafter, drafter_params, inputs: Inputs, max_len: int, gamma: int,
             logprobs: LogprobsSpec | None):
    b, p = inputs.prompt.shape
    sp = inputs.sampling
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    cache = model.init_cache(target, b, max_len)
    out = model.forward(target, inputs.prompt, positions, cache, capture=_capture(drafter), head=False,
                        visible_slots=p)
    cache = out.cache
    last_hidden = jnp.take_along_axis(out.hidden, (inputs.prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    logits = model.logits(target, last_hidden)[:, None]  # [B, 1, V]
    history = History.from_prompt(inputs.prompt, inputs.prompt_lens, model.vocab_size)
    g = inputs.grammar
    probs = processed_probs(logits, sp, history, allowed=None if g is None else grammar.allowed(g, g.initial)[:, None])
    first = sample(fold_rows(fold_rows(inputs.keys, 0), 1), probs[:, 0])
    grammar_state = spelling = None
    if g is not None:
        grammar_state = grammar.advance(g, g.initial, first)
        spelling = grammar.remember(g, grammar.no_spelling(g, b), g.initial, first, jnp.ones((b,), bool))

    tokens = jnp.zeros((b, max_len), jnp.int32).at[:, :p].set(inputs.prompt)
    tokens = cache_lib.write(tokens, first[:, None], inputs.prompt_lens)
    lp = None
    if logprobs is not None:
        n = logprobs.n_top
        lp = Logprobs(jnp.zeros((b, max_len)), jnp.zeros((b, max_len, n), jnp.int32), jnp.zeros((b, max_len, n)))
        lp = _write_logprobs(lp, logprobs.of(logits, probs, first[:, None]), inputs.prompt_lens)
    tails, hit = stopping.completed(inputs.stops, stopping.empty_tail(b, inputs.stops), first[:, None],
                                    stopping.may_stop(sp, history.n_generated, 1))
    prefill = Prefill(inputs.prompt, inputs.prompt_lens, out.captured, out.hidden)
    drafter_state = None if drafter is None else drafter.init(drafter_params, prefill, max_len)
    zeros = jnp.zeros((b,), jnp.int32)
    return LoopState(
        tokens=tokens,
        seq_lens=inputs.prompt_lens + 1,
        done=(sp.is_stop(first[:, None])[:, 0] | hit[:, 0] | (inputs.max_new_tokens <= 1)
              | (False if g is None else ~grammar.is_live(g, grammar_state))),
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
        speculating=jnp.ones((b,), bool),
        recent=jnp.zeros((b, policy.GATE_WINDOW), jnp.int32),
        grammar_state=grammar_state,
        spelling=spelling,
    )


def gamma(drafter) -> int:
    """The deepest draft of ``drafter``'s proposals, 0 for plain decoding (None): the one place
    it is read (the loop's per-depth counts, the metrics' columns)."""
    return 0 if drafter is None else drafter.gamma


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Verified:
    """One verify step's results, along the accepted path (W window entries)."""

    accepted: acceptance.Accepted
    # the target's keys and values along the path, for slots start .. (the cache's pytree with
    # [B, W, ...] leaves: [B, W, K, h] per layer for jaxspec's decoder); None when the forward
    # wrote them itself (plain decoding: ``cache``)
    kv: Any
    hidden: jax.Array  # [B, W, D]: the target's final hidden states along the path
    captured: tuple  # [B, W, D] per captured layer, along the path
    logprobs: tuple | None  # token_logprobs of the emitted tokens, or None
    n_drafted: jax.Array  # int32 [B]: valid nodes of the verified tree
    argmax: jax.Array  # int32 [B, W]: the target's argmax after every window entry (Committed.argmax)
    cache: Any = None  # the target cache with the window written (plain decoding), else None


def _pad_window(x: jax.Array, width: int) -> jax.Array:
    """``x [B, W, ...]`` padded to ``[B, width, ...]`` by repeating its last window entry."""
    return jnp.pad(x, ((0, 0), (0, width - x.shape[1])) + ((0, 0),) * (x.ndim - 2), mode="edge")


def _along(x: jax.Array, path: jax.Array) -> jax.Array:
    """``x [B, W, ...]`` gathered at window indices ``path [B, W']``."""
    return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)


def _verify(target, model: TargetModel, inputs: Inputs, keys, s: LoopState, root, proposal: Proposal, capture, logprobs,
            width: int, min_pass_tokens: int, rule=acceptance.EXACT, write_first: bool = False) -> _Verified:
    """ONE target forward over the window ``[root, nodes]`` with the tree's ancestor mask, and
    acceptance by ``rule``; outputs padded to ``width`` (W) entries so a smaller tree fits
    the same state.

    ``write_first`` (plain decoding, outside any conditional): the window, one token that is
    always kept, is written into the cache before the attention reads it, and ``cache`` comes
    back. Otherwise the cache is only read: this may run inside the switch over verify widths,
    where a cache updated in a branch costs XLA a copy of every layer's buffers each step
    (jaxlib 0.10; jax-ml/jax#16661), and the accepted path's keys and values (``kv``) are
    written after acceptance. Why not that for plain decoding too: its write would not depend
    on anything the attention read (the path of an empty tree is a constant), so XLA cannot
    order the in-place write after the reads and copies every buffer twice per step; after a
    real acceptance the path depends on the logits, and it does not. With ``min_pass_tokens``
    > 1 a plain step's forward runs that many entries (the root and copies of it), and only
    the first one's outputs are kept.
    """
    tree = Tree.of(root, proposal)
    start = s.seq_lens - 1  # the root's slot: it is not yet in the cache
    positions = start[:, None] + tree.depth
    if write_first:
        if proposal.n_nodes:
            raise ValueError("write_first is plain decoding's: an empty proposal")
        # min_pass_tokens > 1: the root repeated at the next positions; their keys and values
        # land in slots past the committed text, which the next step overwrites before reading
        pad = jnp.arange(min_pass_tokens, dtype=jnp.int32)[None]
        out = model.forward(target, jnp.repeat(tree.tokens, min_pass_tokens, axis=1), positions + pad, s.cache,
                            write_at=start, capture=capture)
        out = dataclasses.replace(out, logits=out.logits[:, :1], hidden=out.hidden[:, :1],
                                  captured=tuple(c[:, :1] for c in out.captured))
    else:
        mask = models.TreeMask(start, tree.ancestors, positions)
        out = model.forward(target, tree.tokens, positions, s.cache, mask=mask, capture=capture, write=False)
    g = inputs.grammar
    allowed = None if g is None else grammar.allowed(g, grammar.window_states(g, s.grammar_state, tree))
    p = processed_probs(out.logits, inputs.sampling, s.history, tree, allowed)
    acc = rule.accept(fold_rows(keys, 1), p, proposal, tree, inputs)
    lp = None if logprobs is None else logprobs.of(_along(out.logits, acc.path), _along(p, acc.path), acc.tokens)
    pad = functools.partial(_pad_window, width=width)
    accepted = acceptance.Accepted(acc.n_accepted, pad(acc.path), pad(acc.tokens))
    kv = None if write_first else jax.tree.map(lambda x: pad(_along(x, acc.path)), out.cache)
    return _Verified(accepted, kv, pad(_along(out.hidden, acc.path)),
                     tuple(pad(_along(c, acc.path)) for c in out.captured),
                     None if lp is None else tuple(pad(x) for x in lp),
                     jnp.sum(tree.valid[:, 1:], axis=1, dtype=jnp.int32),
                     pad(first_argmax(out.logits)),
                     out.cache if write_first else None)


def _first_nodes(proposal: Proposal, n: int) -> Proposal:
    q = None if proposal.q is None else proposal.q[:, :n]
    return Proposal(proposal.tokens[:, :n], proposal.parents[:, :n], proposal.valid[:, :n], q)


def _gated(drafter, inputs: Inputs, rule) -> bool:
    """Whether this program runs the acceptance gate (static): never under synthetic acceptance."""
    return drafter is not None and inputs.gate_tau is not None and rule.narrows


def _gate(inputs: Inputs, s: LoopState, n_keep, active, done):
    """``(speculating, recent)`` after a step that emitted ``n_keep [B]`` tokens per row: the
    count goes into the row's ring, and a row that has made ``GATE_WINDOW`` verify steps
    stops speculating once their mean is below its ``gate_tau``, unless that step ended it
    (``done [B]``: a last step cut by a stop or ``max_new_tokens`` says nothing of the drafter)."""
    window = s.recent.shape[1]
    slot = jax.nn.one_hot(s.n_steps % window, window, dtype=bool) & active[:, None]
    recent = jnp.where(slot, n_keep[:, None], s.recent)
    full = s.n_steps + active >= window
    low = jnp.sum(recent, axis=1) < inputs.gate_tau * window
    return s.speculating & ~(active & ~done & full & low), recent


def _draft(drafter, drafter_params, inputs: Inputs, rule, keys, root, s: LoopState):
    """``(drafter state, Proposal)`` of this step: the drafter's tree (none for plain decoding;
    rows the acceptance gate turned off propose nothing), as ``rule`` verifies it."""
    if drafter is None:  # plain decoding (a gated program's second loop passes the drafter's state on)
        return s.drafter_state, Proposal.empty(root.shape[0])
    context = Context(s.tokens, s.seq_lens, fold_rows(keys, 0), inputs.sampling, s.history, inputs.grammar,
                      s.grammar_state, ~s.done & s.speculating)
    drafter_state, proposal = drafter.propose(drafter_params, s.drafter_state, context)
    if inputs.grammar is not None and proposal.q is None:  # forced drafts in, forbidden ones out
        proposal = grammar.constrain(inputs.grammar, s.grammar_state, proposal, s.spelling)
    if _gated(drafter, inputs, rule):
        proposal = dataclasses.replace(proposal, valid=proposal.valid & s.speculating[:, None])
    return drafter_state, rule.fill(proposal, root)


def _verify_step(target, model: TargetModel, drafter, inputs: Inputs, rule, keys, root, s: LoopState, proposal: Proposal,
                 logprobs, min_pass_tokens: int) -> _Verified:
    """The target's verification of ``proposal`` (``_verify``), at the narrowest of a few
    static widths for an abstaining drafter under a rule that ``narrows``: no draft at all is
    a one-token step, one chain of a tree (the best n-gram match alone) a (gamma + 1)-token
    one, and the drafter's own; none under ``min_pass_tokens`` (an abstaining row's nodes
    there are invalid: rejected)."""
    verify = functools.partial(_verify, target, model, inputs, keys, s, root, capture=_capture(drafter),
                               logprobs=logprobs, width=proposal.n_nodes + 1, min_pass_tokens=min_pass_tokens,
                               rule=rule)
    if drafter is None or not (drafter.capabilities.abstains and rule.narrows):
        return verify(proposal, write_first=drafter is None)
    least = min(min_pass_tokens - 1, proposal.n_nodes)
    widths = sorted({max(w, least) for w in (0, drafter.gamma, proposal.n_nodes, *drafter.capabilities.verify_widths)})
    node = jnp.arange(1, proposal.n_nodes + 1)[None]
    used = jnp.max(jnp.where(proposal.valid & ~s.done[:, None], node, 0))
    pick = sum((used > w).astype(jnp.int32) for w in widths[:-1])
    return jax.lax.switch(pick, [functools.partial(verify, _first_nodes(proposal, w)) for w in widths])


def _commit(drafter, drafter_params, drafter_state, inputs: Inputs, gamma: int, rule, s: LoopState, v: _Verified,
            width: int) -> LoopState:
    """The next ``LoopState``: each active row keeps its accepted path and the replacement or
    bonus token, cut at the first stop id or completed stop string and at ``max_new_tokens``
    (``jaxspec.stopping``); the path's keys and values are written, the drafter told what was
    kept, the counts and the acceptance gate updated."""
    sp = inputs.sampling
    # No valid node is deeper than gamma, so at most gamma + 1 tokens are emitted: the stop
    # checks (unrolled per token) read only those, however wide the window (a lookahead
    # window's invalid nodes go deeper).
    emit = min(gamma + 1, width)
    n_acc, new = v.accepted.n_accepted, v.accepted.tokens[:, :emit]
    slot = jnp.arange(emit)[None]
    in_block = slot <= n_acc[:, None]
    may_stop = in_block & stopping.may_stop(sp, s.history.n_generated, emit)
    tails, string_stop = stopping.completed(inputs.stops, s.tail, new, may_stop)
    is_stop = (sp.is_stop(new) | string_stop) & in_block
    g, grammar_state, spelling = inputs.grammar, s.grammar_state, s.spelling
    if g is not None:  # a token after which the row's automaton allows nothing ends the row
        states = grammar.chain_states(g, s.grammar_state, new)  # [B, emit + 1]: before token 0, after each
        is_stop = is_stop | (~grammar.is_live(g, states[:, 1:]) & in_block)
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), emit)
    room = inputs.max_new_tokens - (s.seq_lens - inputs.prompt_lens)
    active = ~s.done
    n_keep = jnp.where(active, jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), room), 0)
    tokens = cache_lib.write(s.tokens, new, s.seq_lens)
    seq_lens = s.seq_lens + n_keep
    done = s.done | (first_stop < n_keep) | (n_keep >= room)
    if g is not None:
        grammar_state = jnp.take_along_axis(states, n_keep[:, None], axis=1)[:, 0]  # after the kept tokens
        for j in range(emit):  # the state before each kept token, and how the target spelled it
            spelling = grammar.remember(g, spelling, states[:, j], new[:, j], j < n_keep)
    kept_tail = jnp.take_along_axis(tails, jnp.maximum(n_keep - 1, 0)[:, None, None], axis=1)[:, 0]
    counted = active.astype(jnp.int32)
    # Drafts that verification accepted but a stop or max_new_tokens then cut off were never
    # emitted: the metrics count the emitted ones (n_keep holds the accepted drafts first, then
    # the replacement/bonus token).
    n_emitted_drafts = jnp.minimum(n_acc, n_keep)
    if drafter is not None:
        committed = Committed(tokens, seq_lens, n_acc * counted, v.accepted.path, s.seq_lens - 1, v.hidden,
                              v.captured, v.argmax)
        drafter_state = drafter.commit(drafter_params, drafter_state, committed)
    gated = _gated(drafter, inputs, rule)
    speculating, recent = _gate(inputs, s, n_keep, active, done) if gated else (s.speculating, s.recent)
    return LoopState(
        tokens=tokens,
        seq_lens=seq_lens,
        done=done,
        cache=cache_lib.write_tree(s.cache, v.kv, s.seq_lens - 1) if v.cache is None else v.cache,
        drafter_state=drafter_state,
        history=s.history.add(new, slot < n_keep[:, None]),
        tail=jnp.where((n_keep > 0)[:, None], kept_tail, s.tail),
        logprobs=_write_logprobs(s.logprobs, v.logprobs, s.seq_lens),
        step=s.step + 1,
        n_steps=s.n_steps + counted,
        n_drafted=s.n_drafted + v.n_drafted * counted,
        n_accepted=s.n_accepted + n_emitted_drafts,
        accepted_at=s.accepted_at + (jnp.arange(gamma)[None] < n_emitted_drafts[:, None]),
        speculating=speculating,
        recent=recent,
        grammar_state=grammar_state,
        spelling=spelling,
    )


def _spec_step(target, model: TargetModel, drafter, drafter_params, inputs: Inputs, gamma: int, logprobs, min_pass_tokens: int,
               rule, s: LoopState) -> LoopState:
    """One loop iteration: draft -> verify (and accept, by ``rule``) -> commit."""
    keys = fold_rows(inputs.keys, s.step + 1)
    root = jnp.take_along_axis(s.tokens, (s.seq_lens - 1)[:, None], axis=1)[:, 0]
    with jax.named_scope("draft"):
        drafter_state, proposal = _draft(drafter, drafter_params, inputs, rule, keys, root, s)
    with jax.named_scope("verify"):
        v = _verify_step(target, model, drafter, inputs, rule, keys, root, s, proposal, logprobs, min_pass_tokens)
    with jax.named_scope("commit"):
        return _commit(drafter, drafter_params, drafter_state, inputs, gamma, rule, s, v, proposal.n_nodes + 1)


# jax backend -> ``run_program``'s ``min_pass_tokens`` there. On the H200
# (jax 0.11.2, bf16, Llama-3.1-8B shape, batch 1) a 1-token pass took 7.80 ms and a 2-token
# one 6.04 ms; in the loop a plain step 6.97 ms and a synthetic tau-1 step (5-token verify plus
# drafter) 5.44 ms (benchmarks/results/accelerator_summary_nvidia-h200_2026-12-04.md). On a 2-core CPU
# SmolLM2-135M's plain decoding padded to 2 tokens ran at 0.72x the unpadded tok/s (13
# Spec-Bench questions, identical tokens; benchmarks/results/padded_plain_smollm2-135m_cpu_2026-12-05.json).
# Empty until a padded plain step is measured faster in the loop on some backend
# (``benchmarks/accelerator.py``'s e2e part, ``benchmarks/experiments/padded_plain.py``): 1 everywhere.
MIN_PASS_TOKENS: dict[str, int] = {}


def min_pass_tokens(backend: str | None = None) -> int:
    """``MIN_PASS_TOKENS`` for ``backend`` (``jax.default_backend()`` when None), else 1."""
    return MIN_PASS_TOKENS.get(backend or jax.default_backend(), 1)


@contextlib.contextmanager
def min_pass_tokens_set(m: int, backend: str | None = None):
    """Within the block, ``generate`` runs every target pass with at least ``m`` tokens on
    ``backend`` (default ``jax.default_backend()``): for benchmarks that compare the two.

    Raises:
      ValueError: ``m`` < 1.
    """
    if m < 1:
        raise ValueError(f"min_pass_tokens must be >= 1, got {m}")
    backend = backend or jax.default_backend()
    saved = MIN_PASS_TOKENS.get(backend)
    MIN_PASS_TOKENS[backend] = m
    try:
        yield
    finally:
        if saved is None:
            del MIN_PASS_TOKENS[backend]
        else:
            MIN_PASS_TOKENS[backend] = saved


def window(drafter, min_pass_tokens: int = 1) -> int:
    """W: the verify window's entries (root + the drafter's node budget; 1 for plain decoding),
    at least ``min_pass_tokens``. The token buffer and the target's cache need
    ``prompt + max_new_tokens + W`` slots."""
    return max(1 if drafter is None else drafter.n_nodes + 1, min_pass_tokens)


def run_program(
    target, drafter_params, inputs: Inputs, *, config: ModelConfig | TargetModel, drafter, max_len: int,
    logprobs: LogprobsSpec | None = None, min_pass_tokens: int = 1, rule=acceptance.EXACT,
) -> LoopState:
    """The whole generation as one traceable function (jit it with the static keywords).

    Args:
      target: target params pytree; drafter_params: the drafter's (from ``select_params``).
      inputs: ``Inputs``; config: the target's ``ModelConfig`` (jaxspec's decoder) or a
        ``TargetModel`` (``jaxspec.models.target``: the engine reads the target only through it); drafter: a ``Drafter`` or None;
      max_len: S, slots of the target's cache and of the token buffer; the caller guarantees
        ``prompt_lens + max_new_tokens + window(drafter, min_pass_tokens) <= S``.
      logprobs: what log-probabilities to record (``LoopState.logprobs``), or None.
      min_pass_tokens: a plain step's one token runs as a pass of this many (copies of it at
        the next positions, their outputs dropped), and an abstaining drafter's narrowest
        verify is widened to it (at most to the drafter's window). For accelerators whose
        1-token pass is slower than a wider one (``MIN_PASS_TOKENS``). On CPU in float32 the
        tokens are the unpadded program's (tests/test_engine.py); on an accelerator a wider
        pass runs other kernels and may round differently.
      rule: the acceptance rule, ``acceptance.EXACT`` (default) or, for benchmarks only,
        ``synthetic.SYNTHETIC`` (which reads ``inputs.synthetic_rates``).

    Raises:
      ValueError: ``min_pass_tokens`` < 1; ``synthetic.SYNTHETIC`` without ``inputs.synthetic_rates``
        or rates under another rule, or with ``inputs.grammar``.

    Returns:
      The final ``LoopState``.
    """
    if min_pass_tokens < 1:
        raise ValueError(f"min_pass_tokens must be >= 1, got {min_pass_tokens}")
    if (inputs.synthetic_rates is not None) != isinstance(rule, synthetic.Synthetic):
        raise ValueError("inputs.synthetic_rates go with rule=SYNTHETIC, and only with it")
    if inputs.grammar is not None and isinstance(rule, synthetic.Synthetic):
        raise ValueError("structured output (inputs.grammar) is not for synthetic acceptance, which emits "
                         "the drafter's tokens unverified")
    model = as_target(config)
    g = gamma(drafter)
    state = _prefill(target, model, drafter, drafter_params, inputs, max_len, g, logprobs)
    step = functools.partial(_spec_step, target, model, drafter, drafter_params, inputs, g, logprobs,
                             min_pass_tokens, rule)
    if not _gated(drafter, inputs, rule):
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)
    # The acceptance gate: speculate while some active row still does (rows it turned off
    # propose nothing), then plain steps, without the drafter, for the rows still going.
    state = jax.lax.while_loop(lambda s: jnp.any(s.speculating & ~s.done), step, state)
    plain = functools.partial(_spec_step, target, model, None, None, inputs, g, logprobs, min_pass_tokens, rule)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), plain, state)
