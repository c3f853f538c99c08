"""The core engine on tiny random float32 models: greedy exactness (invariant 1), batch
independence (invariant 3), cached == uncached forward (invariant 4), stop ids and
``max_new_tokens`` inside a verify window, metrics, and the single on-device loop.

Shapes are shared on purpose (see conftest): every ``generate`` call here uses the 256-slot
cache bucket, so each (drafter kind, gamma, batch size) compiles once for the whole module.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.api
from jaxspec import engine
from jaxspec.cache import KVCache
from jaxspec import models
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

GAMMAS = (1, 2, 4, 7)
DRAFTER_KINDS = ("ngram", "early_exit", "model_noisy", "model_small")  # see conftest.Tiny.drafter
# Every drafter at every gamma; the unrelated small draft model (a second ModelDrafter
# config, rarely accepted) at two of them to save its compiles.
GREEDY_CASES = [(k, g) for k in DRAFTER_KINDS[:3] for g in GAMMAS] + [("model_small", 1), ("model_small", 4)]


def _check_metrics(m: jaxspec.Metrics, gamma: int, max_new: int | None = None, abstains: bool = False):
    """Accounting identities every speculative call must satisfy, per row. A drafter that
    may abstain (n-gram lookup without a match drafts -1) drafts at most gamma per step."""
    steps, new = m.verify_steps, m.new_tokens
    if max_new is not None:
        np.testing.assert_array_equal(new, max_new)
    if abstains:
        assert np.all(m.drafted <= steps * gamma), (m.drafted, steps)
    else:
        np.testing.assert_array_equal(m.drafted, steps * gamma)
    assert np.all(m.accepted <= m.drafted), (m.accepted, m.drafted)
    np.testing.assert_array_equal(m.accepted_at.sum(axis=1), m.accepted)
    # draft i can only be accepted when draft i-1 was: counts never increase along the window
    assert np.all(np.diff(m.accepted_at, axis=1) <= 0), m.accepted_at
    # accepted counts emitted drafts only: each verify step emits its accepted drafts plus the
    # replacement/bonus token, except that a stop id or max_new_tokens may cut the row's last
    # window before that token (its accepted drafts past the cut are not counted at all)
    emitted = new - 1
    has_steps = steps > 0
    gap = (m.accepted + steps - emitted)[has_steps]
    assert np.all((gap == 0) | (gap == 1)), (m.accepted, steps, emitted)
    np.testing.assert_array_equal(m.accepted[~has_steps], 0)
    if steps.sum():
        assert m.tau == pytest.approx(emitted.sum() / steps.sum(), rel=1e-12)
    else:  # every row ended at its prefill token: one token per target forward
        assert m.tau == 1.0


# ---------------------------------------------------------------------------- invariant 1


def test_plain_greedy_equals_naive_argmax_loop(tiny, plain_greedy):
    """The reference of invariant 1 is itself right: the engine's plain greedy decoding
    equals argmax decoding by full uncached forwards over the whole sequence each step
    (one jitted forward over a fixed 48-token buffer; causal masking makes the padding
    after a row's length invisible)."""
    width = 48
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (len(tiny.prompts), width))

    @jax.jit
    def full_logits(tokens):
        cache = KVCache.zeros(tiny.cfg, len(tiny.prompts), width, jnp.float32)
        return models.forward(tiny.params, tiny.cfg, tokens, pos, cache).logits

    buf = np.zeros((len(tiny.prompts), width), np.int32)
    lens = np.array([len(p) for p in tiny.prompts])
    for i, p in enumerate(tiny.prompts):
        buf[i, : len(p)] = p
    for _ in range(tiny.max_new):
        logits = np.asarray(full_logits(jnp.asarray(buf)))
        nxt = logits[np.arange(len(tiny.prompts)), lens - 1].argmax(-1)
        buf[np.arange(len(tiny.prompts)), lens] = nxt
        lens = lens + 1
    naive = [buf[i, len(p) : len(p) + tiny.max_new].tolist() for i, p in enumerate(tiny.prompts)]
    assert plain_greedy == naive


def test_plain_decoding_metrics(tiny, plain_greedy):
    """Plain decoding through the same loop: one token per verify step, tau exactly 1."""
    m = tiny.generate(tiny.prompts).metrics
    _check_metrics(m, gamma=0, max_new=tiny.max_new)
    np.testing.assert_array_equal(m.verify_steps, tiny.max_new - 1)
    np.testing.assert_array_equal(m.accepted, 0)
    assert m.tau == 1.0


@pytest.mark.parametrize("kind,gamma", core(GREEDY_CASES, [("ngram", 4), ("early_exit", 2), ("model_noisy", 7),
                                                           ("model_small", 1)]))
def test_greedy_speculative_equals_plain(tiny, plain_greedy, kind, gamma):
    """Invariant 1 at batch 3 (prompt lengths 9, 1, 14) and batch 1, and invariant 3: each
    prompt run alone gives the same tokens as in the batch.

    Not vacuous: every drafter except the unrelated random draft model gets drafts accepted
    (the n-gram drafter on the repetitive prompts and the loops greedy decoding falls into;
    early exit and the noisy copy of the target because they often share its argmax), so
    both the accept and the reject/replace paths are exercised. The n-gram drafter also
    abstains (no match: drafts -1): alone, the 1-token prompt's first step is a one-token
    step; in the batch, the same row rides along a full window as a forced rejection."""
    batch = tiny.generate(tiny.prompts, kind, gamma)
    assert batch.tokens == plain_greedy
    _check_metrics(batch.metrics, gamma, tiny.max_new, abstains=kind == "ngram")
    if kind == "ngram":  # the 1-token prompt has nothing to look up at the first step
        assert batch.metrics.drafted[1] < batch.metrics.verify_steps[1] * gamma
    if kind != "model_small":
        assert batch.metrics.accepted.sum() > 0, f"{kind} never accepted: the test would be vacuous"
    assert (batch.metrics.accepted < batch.metrics.drafted).any(), "no rejection: the reject path is untested"
    for i, prompt in enumerate(tiny.prompts):
        single = tiny.generate([prompt], kind, gamma)
        assert single.tokens == [plain_greedy[i]], f"prompt {i} alone"
        assert single.metrics.accepted[0] == batch.metrics.accepted[i], "a row's acceptance depends on its batch"
        assert single.metrics.verify_steps[0] == batch.metrics.verify_steps[i], "a row waited for the batch"


def test_min_pass_tokens_pads_one_token_passes_and_keeps_the_output(tiny, plain_greedy, monkeypatch, forward_widths):
    """``engine.MIN_PASS_TOKENS`` (for accelerators whose 1-token pass is slower than a wider
    one): no target forward in the program runs fewer tokens (a plain step runs the root and
    copies of it; an abstaining n-gram drafter's shortest verify is widened; the gated
    program's plain loop is padded too), and the output is the unpadded program's: the same
    greedy and sampled tokens, logprobs within 1e-5 (float32: a wider pass may sum in another
    order, as in test_logprobs_spec_equals_plain_and_full_forward)."""
    sampled = dict(logprobs=2, temperature=0.8, seed=3)
    ref = tiny.generate(tiny.prompts, logprobs=2), tiny.generate(tiny.prompts, **sampled)
    widths = forward_widths
    widths.clear()
    monkeypatch.setitem(engine.MIN_PASS_TOKENS, jax.default_backend(), 3)
    out = tiny.generate(tiny.prompts, logprobs=2), tiny.generate(tiny.prompts, **sampled)
    assert min(widths) == 3, widths  # prefill: the padded prompt; every plain step: 3
    assert out[0].tokens == plain_greedy and out[1].tokens == ref[1].tokens != plain_greedy
    for a, b in zip(out, ref):
        for x, y in zip(a.logprobs + a.top_logprobs, b.logprobs + b.top_logprobs):
            np.testing.assert_allclose(np.asarray(x, dtype=float), np.asarray(y, dtype=float), atol=1e-5)
    monkeypatch.setitem(engine.MIN_PASS_TOKENS, jax.default_backend(), 2)
    widths.clear()
    spec = tiny.generate(tiny.prompts, "ngram", 4)
    assert min(widths) == 2, widths  # unpadded, a step where no row has a match verifies the root alone
    assert spec.tokens == plain_greedy
    _check_metrics(spec.metrics, 4, tiny.max_new, abstains=True)
    assert spec.metrics.drafted[1] < spec.metrics.verify_steps[1] * 4  # the 1-token prompt abstained
    # the unrelated draft model (tau ~1) at gamma 1, gated below tau 2: its rows end in plain
    # steps, padded to 3 tokens (its own verify window is 2 wide, its draft steps 1)
    monkeypatch.setitem(engine.MIN_PASS_TOKENS, jax.default_backend(), 3)
    widths.clear()
    gated = tiny.generate(tiny.prompts, "model_small", 1, disable_by_acceptance=2.0)
    assert gated.tokens == plain_greedy and gated.metrics.gated.all()
    assert {1, 2, 3} <= set(widths), widths


def test_padded_plain_fits_a_cache_without_slack(tiny, plain_greedy, inputs_factory):
    """The least cache a padded plain run needs: its last step's token sits at slot
    ``prompt + max_new_tokens - 2`` and writes M slots, so ``prompt + max_new_tokens + M - 2``
    (``window(None, M)`` = M leaves 2 spare; generate's cache buckets more). There, with M 3,
    the tokens are plain decoding's and every committed slot's keys and values are the
    unpadded program's (float32, within 1e-5): a write clamped at the cache's end would have
    moved the last step's keys onto a committed slot (one slot less fails this)."""
    inputs = inputs_factory(tiny.prompts, max_new_tokens=tiny.max_new)
    max_len = inputs.prompt.shape[1] + tiny.max_new + 3 - 2

    def run(m):
        return jax.jit(functools.partial(engine.run_program, config=tiny.cfg, drafter=None,
                                         max_len=max_len, min_pass_tokens=m))(tiny.params, None, inputs)

    padded, unpadded = run(3), run(1)
    for b, (prompt, ref) in enumerate(zip(tiny.prompts, plain_greedy)):
        assert np.asarray(padded.tokens[b, len(prompt):len(prompt) + tiny.max_new]).tolist() == ref, b
        n = int(padded.seq_lens[b]) - 1  # slots 0 .. n - 1 are committed
        for x, y in zip(padded.cache.k + padded.cache.v, unpadded.cache.k + unpadded.cache.v):
            np.testing.assert_allclose(np.asarray(x[b, :n]), np.asarray(y[b, :n]), atol=1e-5)
    with pytest.raises(ValueError, match="min_pass_tokens must be >= 1"):
        engine.run_program(tiny.params, None, inputs, config=tiny.cfg, drafter=None, max_len=max_len,
                           min_pass_tokens=0)


def test_confident_chains_stop_early_and_equal_plain(tiny, plain_greedy):
    """A chain stopped where the drafter's cumulative probability of it falls below 0.1
    (``confidence``; the tiny noisy draft's most probable token has 0.06-0.3) still gives
    plain decoding's tokens, at batch 3 and alone, and is verified at the width it needs:
    fewer drafts than steps (so some steps verify no draft: one-token steps), accepted more
    often than without the threshold (0.85 against 0.51 when written)."""
    batch = tiny.generate(tiny.prompts, "model_confident", 4)
    full = tiny.generate(tiny.prompts, "model_noisy", 4)
    assert batch.tokens == plain_greedy
    m = batch.metrics
    _check_metrics(m, 4, tiny.max_new, abstains=True)
    assert m.accepted.sum() > 0 and np.all(m.drafted < m.verify_steps), (m.accepted, m.drafted, m.verify_steps)
    assert m.acceptance_rate >= full.metrics.acceptance_rate, (m.acceptance_rate, full.metrics.acceptance_rate)
    for i, prompt in enumerate(tiny.prompts):
        single = tiny.generate([prompt], "model_confident", 4)
        assert single.tokens == [plain_greedy[i]], f"prompt {i} alone"
        assert single.metrics.drafted[0] == m.drafted[i], "a row's drafts depend on its batch"


def test_confident_chain_stops_running_the_drafter_where_no_row_can_go_on():
    """``draw_chain`` with a threshold runs the drafter's step only while some row's chain can
    still be kept: draft 0 has probability 0.9 and every later draft 0.5 (max), so at
    confidence 0.3 draft 1 (0.45) is kept, draft 2 (0.225) is not, and the step runs for drafts
    1 and 2 only (2 of gamma - 1 = 5 calls; the unconditioned chain runs all 5). A row whose
    first draft is below the threshold (max 0.2) drafts nothing and alone runs no step."""
    from jaxspec.drafters.model import draw_chain
    from jaxspec.drafters.base import Context
    from jaxspec.sampling import History, SamplingParams

    v, gamma = 8, 6

    def logits_with_max(m, b):  # one token of probability m, the rest equal
        probs = jnp.full((b, v), (1 - m) / (v - 1)).at[:, 3].set(m)
        return jnp.log(probs)

    def step(calls, token, i):
        return calls + 1, logits_with_max(0.5, token.shape[0])

    def run(first, confidence, b=2):
        ctx = Context(jnp.zeros((b, 4), jnp.int32), jnp.full((b,), 4, jnp.int32),
                      jax.vmap(jax.random.key)(jnp.arange(b)), SamplingParams.make(b),
                      History.from_prompt(jnp.zeros((b, 4), jnp.int32), jnp.full((b,), 4, jnp.int32), v))
        calls, prop = jax.jit(lambda: draw_chain(step, jnp.int32(0), logits_with_max(first, b), ctx, gamma,
                                                 confidence))()
        return int(calls), np.asarray(prop.valid)

    calls, valid = run(0.9, 0.3)
    assert calls == 2 and valid.tolist() == [[True, True, False, False, False, False]] * 2
    assert run(0.9, 0.0)[0] == gamma - 1
    calls, valid = run(0.2, 0.3)
    assert calls == 0 and not valid.any()


def test_plain_batch_rows_equal_single_runs(tiny, plain_greedy):
    """Invariant 3 for plain decoding."""
    for i, prompt in enumerate(tiny.prompts):
        assert tiny.generate([prompt]).tokens == [plain_greedy[i]]


def test_draft_model_equal_to_target_accepts_every_draft(tiny, plain_greedy):
    """With the target as its own draft model every greedy draft is the target's argmax:
    23 loop tokens at gamma 4 take ceil(23 / 5) = 5 verify steps, tau = 23 / 5 = 4.6. The
    last window keeps 3 of its 5 tokens (max_new_tokens): only those 3 of its 4 verified
    drafts count as accepted, so 4 * 4 + 3 = 19 accepted of 20 drafted."""
    r = tiny.generate(tiny.prompts, "model_self", 4)
    assert r.tokens == plain_greedy
    _check_metrics(r.metrics, 4, tiny.max_new)
    np.testing.assert_array_equal(r.metrics.verify_steps, 5)
    np.testing.assert_array_equal(r.metrics.drafted, 20)
    np.testing.assert_array_equal(r.metrics.accepted, 19)
    np.testing.assert_array_equal(r.metrics.accepted_at, [[5, 5, 5, 4]] * 3)
    assert r.metrics.tau == pytest.approx(4.6, rel=1e-12)


def test_drafts_cut_by_max_new_tokens_are_not_counted(tiny):
    """Issue 10 part 7: a window whose 4 drafts are all verified but of which max_new_tokens
    (3: the prefill token + 2) lets only 2 out reports 2 accepted of 4 drafted (acceptance
    0.5, not 1.0) and tau 2 (2 tokens from 1 verify step). A row that ends at its prefill
    token (max_new_tokens 1) has tau 1.0, not NaN."""
    m = tiny.generate([tiny.prompts[0]], "model_self", 4, max_new_tokens=3).metrics
    assert (m.verify_steps[0], m.drafted[0], m.accepted[0]) == (1, 4, 2)
    assert m.acceptance_rate == 0.5
    np.testing.assert_array_equal(m.acceptance_rate_per_position, [1, 1, 0, 0])
    assert m.tau == 2.0 and m.row(0)["tau"] == 2.0
    m1 = tiny.generate([tiny.prompts[0]], "model_self", 4, max_new_tokens=1).metrics
    assert m1.tau == 1.0 and m1.row(0)["tau"] == 1.0 and m1.summary()["tau"] == 1.0


@pytest.mark.parametrize("max_new", [1, 2, 5, 6, 7, 11, 20])
def test_max_new_tokens_not_a_multiple_of_the_window(tiny, plain_greedy, max_new):
    """Windows of gamma + 1 = 5 are fully accepted (draft == target), so max_new_tokens
    values that are not 1 + 5k end inside a window: exactly max_new_tokens are emitted,
    equal to plain's first max_new_tokens (1: only the prefill token; 6, 11: window edges)."""
    spec = tiny.generate(tiny.prompts, "model_self", 4, max_new_tokens=max_new)
    plain = tiny.generate(tiny.prompts, max_new_tokens=max_new)
    expected = [t[:max_new] for t in plain_greedy]
    assert plain.tokens == expected
    assert spec.tokens == expected
    np.testing.assert_array_equal(spec.metrics.new_tokens, max_new)
    np.testing.assert_array_equal(spec.metrics.verify_steps, -(-(max_new - 1) // 5))
    _check_metrics(spec.metrics, 4, max_new)


def _stop_inside_window(tokens: list[int], window: int) -> int:
    """First index k > 2 whose token does not occur before k and that lies strictly inside a
    fully accepted window (window w covers indices 1 + w*window .. w*window + window)."""
    for k in range(3, len(tokens)):
        if tokens[k] not in tokens[:k] and (k - 1) % window not in (0, window - 1):
            return k
    raise AssertionError(f"no usable stop position in {tokens}")


def test_stop_token_accepted_mid_window(tiny, plain_greedy):
    """A stop id verified in the middle of a window ends the row right after it: the
    speculative output is plain's output cut after the stop token, nothing after it, even
    though the verifier accepted drafts past it (accepted + steps > emitted proves that)."""
    for i, prompt in enumerate(tiny.prompts):
        k = _stop_inside_window(plain_greedy[i], 5)
        stop = plain_greedy[i][k]
        plain = tiny.generate([prompt], stop_token_ids=(stop,)).tokens[0]
        spec = tiny.generate([prompt], "model_self", 4, stop_token_ids=(stop,))
        out = spec.tokens[0]
        assert plain == plain_greedy[i][: k + 1]
        assert out == plain, f"prompt {i}, stop {stop} at {k}"
        assert out[-1] == stop and len(out) == k + 1
        m = spec.metrics
        # the stop sits among the last window's accepted drafts: that window emitted no
        # bonus token, and the drafts verified past the stop are not counted as accepted
        assert m.accepted[0] + m.verify_steps[0] == m.new_tokens[0], "the stop was not inside a window"
        _check_metrics(m, 4)


def test_stop_token_sampled_at_prefill(tiny, plain_greedy):
    """A stop id as the very first token: one token out, no verify step."""
    r = tiny.generate([tiny.prompts[0]], "model_self", 4, stop_token_ids=(plain_greedy[0][0],))
    assert r.tokens == [[plain_greedy[0][0]]]
    assert r.metrics.verify_steps[0] == 0


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_stop_ids_batch_rows_stop_independently(tiny, plain_greedy, kind):
    """Invariant 1 with a stop id, batch 3: rows end at different steps (a row that never
    emits the stop id runs to max_new_tokens), each exactly where plain decoding ends it."""
    # one stop id (the stop-id array keeps the shape of the other tests: no recompile)
    stops = (plain_greedy[0][_stop_inside_window(plain_greedy[0], 5)],)
    plain = tiny.generate(tiny.prompts, stop_token_ids=stops).tokens
    lengths = sorted(len(t) for t in plain)
    assert lengths[0] < lengths[-1], f"rows do not stop at different steps: {plain}"
    assert tiny.generate(tiny.prompts, kind, 4, stop_token_ids=stops).tokens == plain


# ---------------------------------------------------------------------------- invariant 3, sampling


@pytest.mark.parametrize("kind", ("plain",) + DRAFTER_KINDS)
def test_sampled_batch_rows_equal_single_runs(tiny, plain_greedy, kind):
    """Row b of a batch run with seed s equals a single run with seed s + b (api.generate
    documents that row b uses seed + b), also with a different temperature per row (0 for
    greedy in the middle row)."""
    gamma = 0 if kind == "plain" else 4
    temps = [1.0, 0.0, 0.7]
    batch = tiny.generate(tiny.prompts, kind, gamma, temperature=temps, seed=123)
    assert batch.tokens[1] == plain_greedy[1]
    assert batch.tokens[0] != plain_greedy[0], "temperature 1 gave the greedy output: sampling is not exercised"
    for i, prompt in enumerate(tiny.prompts):
        single = tiny.generate([prompt], kind, gamma, temperature=temps[i], seed=123 + i)
        assert single.tokens == [batch.tokens[i]], f"row {i}"
    other = tiny.generate(tiny.prompts, kind, gamma, temperature=temps, seed=124)
    assert other.tokens[0] != batch.tokens[0] or other.tokens[2] != batch.tokens[2], "seed has no effect"


# ---------------------------------------------------------------------------- invariant 4


# float32 logits here are O(1) (|logit| < 6): a cached and an uncached pass compute the same
# dot products in a different order and over different slot counts, so each logit may differ
# by a few float32 roundings of the O(10) partial sums feeding it: 2^-24 * 10 * ~2 layers *
# sqrt(64-term reductions) ~ 1e-5 at most. Measured: max |diff| < 2e-6. A single wrong
# context token moves logits by O(0.1) or more (checked below), 4 orders above the tolerance.
LOGIT_ATOL = 2e-5


def test_cached_decoding_matches_full_forward(tiny):
    """Invariant 4: logits from prefill + one-token steps + verify windows through the KV
    cache equal one uncached forward over the whole sequence, for two rows with different
    start positions (prefix lengths 4 and 9), including after "rejected drafts" left stale
    entries in the cache (a window of wrong tokens written, then overwritten / masked)."""
    cfg, params = tiny.cfg, tiny.params
    rng = np.random.default_rng(0)
    n, slots = 20, 32
    seq = rng.integers(0, cfg.vocab_size, (2, n)).astype(np.int32)
    fwd = jax.jit(functools.partial(models.forward, params, cfg))
    all_positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))

    full = np.asarray(fwd(jnp.asarray(seq), all_positions, KVCache.zeros(cfg, 2, slots, jnp.float32)).logits)
    assert np.abs(full).max() < 6

    lens = np.array([4, 9], np.int32)
    max_diff = 0.0

    def step(tokens, start, cache):
        t = tokens.shape[1]
        positions = start[:, None] + np.arange(t, dtype=np.int32)[None]
        out = fwd(jnp.asarray(tokens), jnp.asarray(positions), cache)
        logits, cache = out.logits, out.cache
        return np.asarray(logits), positions, cache

    def check(logits, positions, rows=(0, 1)):
        nonlocal max_diff
        for b in rows:
            for j, pos in enumerate(positions[b]):
                max_diff = max(max_diff, float(np.abs(logits[b, j] - full[b, pos]).max()))

    cache = KVCache.zeros(cfg, 2, slots, jnp.float32)
    # prefill right-padded to 9 tokens: row 0's padding (slots 4..8) gets junk ids, stale
    # entries that its later steps must mask until they overwrite them
    prefill = seq[:, :9].copy()
    prefill[0, 4:] = 63
    logits, positions, cache = step(prefill, np.zeros(2, np.int32), cache)
    check(logits[:, :4], positions[:, :4], rows=(0,))
    check(logits, positions, rows=(1,))
    start = lens.copy()
    for _ in range(3):  # one-token decode steps
        logits, positions, cache = step(seq[np.arange(2), start][:, None], start, cache)
        check(logits, positions)
        start += 1
    # a verify window of wrong drafts (rejected), then only the first true token re-decoded:
    junk = rng.integers(0, cfg.vocab_size, (2, 4)).astype(np.int32)
    _, _, cache = step(junk, start, cache)
    logits, positions, cache = step(seq[np.arange(2), start][:, None], start, cache)
    check(logits, positions)
    start += 1
    # a verify window of the true tokens over the remaining stale slots
    window = np.stack([seq[b, start[b] : start[b] + 4] for b in range(2)])
    logits, positions, cache = step(window, start, cache)
    check(logits, positions)
    start += 4
    assert list(start) == [12, 17]
    print("max |cached - full| =", max_diff)
    assert max_diff <= LOGIT_ATOL, max_diff

    # The tolerance can fail: one different context token (position 2) moves later logits.
    changed = seq.copy()
    changed[:, 2] = (changed[:, 2] + 1) % cfg.vocab_size
    other = fwd(jnp.asarray(changed), all_positions, KVCache.zeros(cfg, 2, slots, jnp.float32)).logits
    moved = np.abs(np.asarray(other)[:, 3:] - full[:, 3:]).max(axis=-1).min()
    print("min over later positions of max |logit change| from one token =", moved)
    assert moved > 1000 * LOGIT_ATOL


# ---------------------------------------------------------------------------- one program, one transfer


@pytest.mark.parametrize("kind", ("plain", "ngram", "model_small"))
def test_generation_lowers_to_one_while_loop_without_host_calls(tiny, inputs_factory, kind):
    """The decode loop is an XLA while loop inside the one program; nothing in it calls back
    to the host (no host callbacks, send/recv, infeed/outfeed)."""
    drafter, dparams = tiny.drafter(kind, 4)
    inputs = inputs_factory(tiny.prompts, max_new_tokens=tiny.max_new)
    fn = jax.jit(functools.partial(engine.run_program, config=tiny.cfg, drafter=drafter, max_len=64))
    text = fn.lower(tiny.params, drafter.select_params(tiny.params, dparams) if drafter else None, inputs).as_text()
    assert "stablehlo.while" in text
    for marker in ("callback", "stablehlo.send", "stablehlo.recv", "infeed", "outfeed"):
        assert marker not in text, marker


def _while_body_copies(hlo: str, shape: str) -> int:
    """``copy`` ops of arrays of ``shape`` (e.g. ``f32[3,64,2,8]``) in the while loops' bodies
    of an optimized HLO module's text."""
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
    n = 0
    for comp in re.split(r"\n(?=\S)", hlo):
        name = re.match(r"%([\w.\-]+) ", comp)
        if name and name.group(1) in bodies:
            n += len(re.findall(rf"= {re.escape(shape)}\{{[0-9,]*\}} copy\(", comp))
    return n


@pytest.mark.parametrize("kind,min_pass", (("plain", 1), ("plain", 2), ("model_noisy", 1), ("hybrid", 1)))
def test_decode_loop_does_not_copy_the_cache(tiny, inputs_factory, kind, min_pass):
    """No step copies a whole cache buffer: XLA updates the loop-carried cache in place. It
    copied each buffer twice per step in plain decoding while the step wrote its token after
    the attention's reads (a write that does not depend on them cannot be ordered after
    them); plain decoding now writes first (``engine._verify(write_first=True)``), also when
    its pass is padded to 2 tokens (``min_pass_tokens``). The gated model-drafter program's
    second loop is plain decoding too. The hybrid's draft model, which runs only on some
    steps, copied its cache twice per step under a ``lax.cond``; it runs in a loop of 0 or 1
    trips instead. Every cache buffer is checked, the target's and a draft model's."""
    drafter, dparams = tiny.drafter(kind, 4)
    inputs = inputs_factory(tiny.prompts, max_new_tokens=tiny.max_new)
    if drafter is not None:
        inputs = dataclasses.replace(inputs, gate_tau=jnp.full((len(tiny.prompts),), 2.0))
    fn = jax.jit(functools.partial(engine.run_program, config=tiny.cfg, drafter=drafter, max_len=64,
                                   min_pass_tokens=min_pass))
    dp = drafter.select_params(tiny.params, dparams) if drafter else None
    hlo = fn.lower(tiny.params, dp, inputs).compile().as_text()
    b, c = len(tiny.prompts), tiny.cfg
    assert f"f32[{b},64,{c.n_kv_heads},{c.head_dim}]" in hlo
    draft = getattr(getattr(drafter, "fallback", drafter), "config", None)  # a draft model's own cache
    shapes = {m for cfg in filter(None, (c, draft))
              for m in re.findall(rf"f32\[{b},\d+,{cfg.n_kv_heads},{cfg.head_dim}\]", hlo)}
    assert {s: _while_body_copies(hlo, s) for s in shapes} == dict.fromkeys(shapes, 0)


def test_generate_runs_one_program_and_one_transfer(tiny, monkeypatch):
    """A warm ``generate`` call runs exactly one compiled program, which returns one result
    pytree (``jaxspec.result.Output``), and brings all of it to the host with exactly one
    ``jax.device_get``.

    How this is checked, and why so: ``jax.transfer_guard_device_to_host("disallow")`` is
    also set (it turns any implicit device-to-host transfer into an error on GPU/TPU), but
    on XLA:CPU device buffers are host memory and jax 0.10 enforces no guard there (an
    ``np.asarray`` of a jax array inside the guard passes), and ``np.asarray`` reads CPU
    arrays through the buffer protocol without passing through Python. So the test counts
    what it can see for certain: calls of the compiled executables in
    ``jaxspec.api._COMPILED`` (a per-step host loop would call a program per step) and
    calls of ``jax.device_get``, with the number of arrays each one transfers. Together
    with the lowering test (the loop is a ``stablehlo.while`` with no host callbacks), that
    pins "nothing goes back to the host per step"."""
    kw = dict(kind="ngram", gamma=4)
    tiny.generate(tiny.prompts, **kw)  # warm: compiled and cached
    calls, transfers = [], []
    for key, exe in list(jaxspec.api._COMPILED.items()):
        def counted(*args, _exe=exe):
            out = _exe(*args)
            calls.append(len(jax.tree_util.tree_leaves(out)))
            return out
        monkeypatch.setitem(jaxspec.api._COMPILED, key, counted)
    real_get = jax.device_get

    def counting_get(x):
        transfers.append(len(jax.tree_util.tree_leaves(x)))
        return real_get(x)

    monkeypatch.setattr(jax, "device_get", counting_get)
    with jax.transfer_guard_device_to_host("disallow"):
        r = tiny.generate(tiny.prompts, **kw)
    assert r.metrics.compile_s == 0.0
    n_arrays = len(dataclasses.fields(jaxspec.result.Output)) - 1  # logprobs not requested: None
    assert calls == [n_arrays], f"compiled program calls (arrays returned): {calls}"
    assert transfers == [n_arrays], f"jax.device_get calls (arrays each): {transfers}"


def test_new_values_do_not_recompile(tiny, plain_greedy):
    """Per-request values are arrays (docs/design.md): another stop-id list (up to 8 ids), temperature,
    seed, max_new_tokens or prompt within the bucket reuses the compiled program."""
    tiny.generate(tiny.prompts, stop_token_ids=(5,))
    compiled = len(jaxspec.api._COMPILED)
    tiny.generate(tiny.prompts, stop_token_ids=(5, 6, 7), temperature=0.7, seed=3)
    tiny.generate([p[::-1] for p in tiny.prompts], stop_token_ids=(), max_new_tokens=tiny.max_new - 3)
    assert len(jaxspec.api._COMPILED) == compiled


def test_batch_sizes_share_a_bucket(tiny, plain_greedy):
    """Rows are padded to the next power of two (``request.batch_bucket``: 1, 2, 4, 8, ..., then
    to a multiple of a mesh's ``data`` axis) with one-token copies of row 0, dropped from the
    results: 3 and 4 prompts run one compiled program, the 3-prompt call returns exactly its
    3 rows (the plain greedy output, with per-row metrics), and the 4-prompt call's first
    rows equal it (rows are independent, invariant 3)."""
    bucket = jaxspec.request.batch_bucket
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert [bucket(1, 8), bucket(4, 8), bucket(9, 8), bucket(5, 3)] == [8, 8, 16, 9]
    three = tiny.generate(tiny.prompts)
    compiled = len(jaxspec.api._COMPILED)
    four = tiny.generate(tiny.prompts + [[3, 4, 3]])
    assert len(jaxspec.api._COMPILED) == compiled and four.metrics.compile_s == 0.0
    assert three.tokens == plain_greedy == four.tokens[:3]
    assert len(three.metrics.new_tokens) == len(three.metrics.accepted_at) == len(three.finish_reasons) == 3
