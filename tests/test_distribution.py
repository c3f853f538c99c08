"""Invariant 2 (docs/design.md): speculative sampling draws from exactly the target's distribution.

A tiny target (vocabulary 8) generates 3 tokens after a fixed prompt; the exact probability
of each of the 8^3 = 512 continuations is enumerated from ``jaxspec.models.forward`` over all
prefixes, each step processed by ``reference_probs``: an independent float64 implementation
of the settings (penalties, temperature, top-k, top-p, min-p; Hugging Face's processors,
sort-based), not the engine's ``jaxspec.sampling``. Settings: ``SETTINGS``.
One batched run of the compiled engine program then draws N = 80,000 continuations
(row b keyed by ``jax.random.key(seed + b)``, as ``jaxspec.generate`` keys its rows), and a
chi-square goodness-of-fit test compares the counts with the exact probabilities.

The test. Cells with expected count >= 5 are kept, the rest pooled into one cell (merged
into the smallest kept cell if the pool itself expects < 5), so the chi-square
approximation holds; df = cells - 1. A run fails when its p-value is below
ALPHA = 1e-3 (the seeds are fixed, so each test is deterministic; 1e-3 is the chance that a
correct engine fails with a new seed).

Power. Under an alternative distribution p' the statistic is approximately noncentral
chi-square with noncentrality lambda = N * sum (p' - p)^2 / p >= N * (2 TV)^2 (Cauchy-Schwarz),
TV the total-variation distance between p' and p on the test's cells. So every alternative
with TV >= sqrt(lambda* / 4N) is rejected with probability >= 95%, lambda* being the
noncentrality that gives 95% power at level ALPHA. Each test prints its own detectable TV
(0.013 for top-k 3, whose support is small, to 0.023). At N = 80,000: T = 1 keeps 497 cells
(+1 pooled cell holding 0.05% of the mass; df 497, lambda* = 169.0), so the smallest TV
detected with 95% power is 0.0230; T = 0.7 keeps 360 (+1 pooled, 0.38% of the mass; df 360,
lambda* = 146.7): TV 0.0214. That holds whatever the shape of the deviation
(``detectable_tv`` computes it by simulation; scipy's ncx2 agrees to 4 digits; each test
asserts it is <= 0.025). For scale: the draft model's first-token distribution is at TV
0.38 (T = 1) / 0.50 (T = 0.7) from the target's, and the wrong rules below produce samples
at empirical TV 0.21-0.57 from the target (chi-square > 20,000 on 497 df, p < 1e-300, at
N rows; the rejecting tests now draw ``N_DETECT`` rows).

The harness has power where it matters: ``test_wrong_rule_is_detected`` swaps
``jaxspec.acceptance.accept`` for five deliberately wrong rules, and
``test_penalties_from_committed_tokens_only_are_detected`` makes penalties ignore the drafts
inside the verify window; the same test rejects each of them.

What is observed: 3 tokens, the first drawn at prefill, the next two by verify steps. So
the residual and acceptance at draft positions 1-2 shape the sample, and the bonus token
only at gamma 1 (a gamma >= 2 window never keeps its bonus within 3 tokens).

Cost: ``api.generate`` pads to a 64-token prompt bucket and a 256-slot cache, which made a
large batch ~25x slower per row (measured: 10,000 rows 8 s through ``generate``, 20,000
rows 0.6 s here), so the program is jitted here with the smallest cache (16 slots) through
``engine.run_program``, the function ``generate`` compiles;
``test_generate_uses_the_same_sampler`` checks that ``generate`` gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.api
import jaxspec.sampling
from jaxspec import acceptance, engine, policy
from jaxspec.cache import KVCache
from jaxspec.drafters.history import HistoryDrafter, HistoryRows
from jaxspec import models as decoder
from jaxspec.models import eagle3
from jaxspec.sampling import History, SamplingParams, processed_probs, sample
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

V = 8
TARGET = jaxspec.ModelConfig(
    vocab_size=V, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32, max_position=64,
    name="dist-target",
)
DRAFT = jaxspec.ModelConfig(
    vocab_size=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32, max_position=64,
    name="dist-draft",
)
PROMPT = [1, 2, 3, 1, 2]  # repeats "1 2": the n-gram drafter proposes "3 ..." at the first step
N_NEW = 3
N = 80_000
# Rows of the tests that must REJECT a wrong sampler: power for a small deviation is not what
# they show (the passing tests' N does), only that the harness sees a wrong rule. At 10,000
# rows the closest wrong samplers in CI are penalties that skip the drafts (empirical TV 0.118:
# chi2 1,111 on 300 df, p 2e-93) and lookahead keeping a rejected sibling (TV 0.109: chi2
# 1,101 on 295 df, p 3e-93), against a critical value near 390 at ALPHA; the wrong acceptance
# rules and window-wide tree penalties sit further (TV 0.21-0.57; 0.34: chi2 5,650). Each test
# prints its chi-square. An eighth of N: ~10 s less per test.
N_DETECT = 10_000
MAX_LEN = 16  # len(PROMPT) + N_NEW + gamma + 1 <= 16 for gamma <= 7
ALPHA = 1e-3
POWER = 0.95
MAX_DETECTABLE_TV = 0.025
# Row b of a run with seed s is keyed seed s + b: runs of different tests use disjoint key
# ranges (overlapping ranges would share the prefill draws and correlate their statistics).
SEED_STRIDE = 1_000_000


# ---------------------------------------------------------------------------- statistics (stdlib + numpy)


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df > stat): the regularized upper incomplete gamma Q(df/2, stat/2), by its
    series (x < a + 1) or Lentz's continued fraction (Numerical Recipes, 3rd ed., 6.2)."""
    a, x = df / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        while abs(term) > abs(total) * 1e-16:
            ap += 1
            term *= x / ap
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value x with P(chi2_df > x) = alpha (bisection on ``chi2_sf``)."""
    lo, hi = 0.0, df + 50.0 * math.sqrt(2 * df) + 100
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def noncentrality_for_power(df: int, alpha: float, power: float, draws: int = 200_000) -> float:
    """Smallest noncentrality lambda with P(noncentral chi2(df, lambda) > critical) >= power,
    by bisection over numpy's noncentral chi-square sampler (fixed seed: common random
    numbers make the estimate monotone in lambda; its Monte Carlo error is ~0.3%)."""
    crit = chi2_isf(alpha, df)

    def power_at(lam):
        return np.mean(np.random.default_rng(0).noncentral_chisquare(df, lam, draws) > crit)

    lo, hi = 0.0, 16.0
    while power_at(hi) < power:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_at(mid) < power else (lo, mid)
    return hi


def detectable_tv(n: int, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest TV distance that a chi-square test over ``df + 1`` cells at level ``alpha``
    detects with probability >= ``power`` from ``n`` samples, for any deviation shape."""
    return math.sqrt(noncentrality_for_power(df, alpha, power) / (4 * n))


def chi_square_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson's goodness of fit of ``counts`` to ``probs`` with small cells pooled.

    Returns ``(statistic, df, p_value)``."""
    n = counts.sum()
    expected = n * probs
    keep = expected >= 5
    obs, exp = list(counts[keep].astype(float)), list(expected[keep])
    pool_o, pool_e = float(counts[~keep].sum()), float(expected[~keep].sum())
    if pool_e >= 5:
        obs.append(pool_o)
        exp.append(pool_e)
    elif pool_o or pool_e:
        i = int(np.argmin(exp))
        obs[i] += pool_o
        exp[i] += pool_e
    obs, exp = np.array(obs), np.array(exp)
    stat = float(np.sum((obs - exp) ** 2 / exp))
    df = len(obs) - 1
    return stat, df, chi2_sf(stat, df)


def test_statistics_helpers_match_tables():
    """The stdlib chi-square against textbook table values (Abramowitz & Stegun 26.2), and
    the power computation against the classic df = 1 case: 80% power at level 0.05 needs
    lambda = (1.960 + 0.842)^2 = 7.85."""
    for x, df, p in [(3.841459, 1, 0.05), (18.307038, 10, 0.05), (149.449253, 100, 0.001), (6.634897, 1, 0.01)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-5)
        assert chi2_isf(p, df) == pytest.approx(x, rel=1e-5)
    assert chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), rel=1e-12)  # df 2: exp(-x/2)
    assert noncentrality_for_power(1, 0.05, 0.8) == pytest.approx(7.85, rel=0.01)
    # a fair die: a huge sample of the right distribution passes, a 2% tilt does not
    probs = np.full(6, 1 / 6)
    assert chi_square_test(np.array([1000, 1010, 990, 1005, 995, 1000]), probs)[2] > 0.5
    assert chi_square_test(np.array([1000, 1000, 1000, 1000, 880, 1120]), probs)[2] < 1e-3


# ---------------------------------------------------------------------------- models and exact distribution


TARGET_SEED, DRAFT_SEED, EAGLE_SEED = 10, 11, 12
# An EAGLE-3 head over a draft vocabulary of 6 of the 8 tokens (0 and 5 are never drafted).
EAGLE = eagle3.EagleConfig(TARGET, draft_vocab=6)
EAGLE_D2T = [1, 2, 3, 4, 6, 7]


@pytest.fixture(scope="module")
def models():
    return {
        "target": decoder.init_params(TARGET, jax.random.key(TARGET_SEED), scale=1.0),
        "draft": decoder.init_params(DRAFT, jax.random.key(DRAFT_SEED), scale=1.0),
        "eagle": {"head": eagle3.init_params(EAGLE, jax.random.key(EAGLE_SEED), scale=2.0),
                  "d2t": jnp.asarray(EAGLE_D2T, jnp.int32)},
    }


@functools.partial(jax.jit, static_argnums=1)
def _full_logits(params, config, tokens):
    """Uncached forward over whole sequences: float32 logits ``[B, T, V]``."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return decoder.forward(params, config, tokens, positions, KVCache.zeros(config, b, t, jnp.float32)).logits


def reference_probs(logits: np.ndarray, prompt, generated, settings: dict) -> np.ndarray:
    """The processed next-token distribution, written independently of ``jaxspec.sampling``:
    float64, Hugging Face's logits processors in their order, top-k/top-p by sorting.

    ``logits`` float ``[V]``; ``generated`` the tokens generated before this one."""
    s = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
         "frequency_penalty": 0.0, "presence_penalty": 0.0, **settings}
    x = np.asarray(logits, np.float64).copy()
    r = s["repetition_penalty"]
    for t in set(prompt) | set(generated):  # RepetitionPenaltyLogitsProcessor (CTRL)
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(x))
    x -= s["frequency_penalty"] * counts + s["presence_penalty"] * (counts > 0)  # OpenAI penalties
    x /= s["temperature"]
    if s["top_k"] > 0:  # TopKLogitsWarper: drop logits below the k-th largest
        x[x < np.sort(x)[-s["top_k"]]] = -np.inf
    if s["top_p"] < 1:  # TopPLogitsWarper: ascending sort, drop where cumulative mass <= 1 - p
        order = np.argsort(x)
        cum = np.cumsum(_softmax(x[order]))
        drop = cum <= 1 - s["top_p"]
        drop[-1] = False
        x[order[drop]] = -np.inf
    if s["min_p"] > 0:  # MinPLogitsWarper
        probs = _softmax(x)
        x[probs < s["min_p"] * probs.max()] = -np.inf
    return _softmax(x)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@functools.lru_cache(maxsize=None)
def _prefix_logits(which: str, seed: int) -> np.ndarray:
    """float64 ``[V^2, len(PROMPT) + 2, V]`` logits after PROMPT + every 2-token prefix
    (row x1 * V + x2), of the target (``which="target"``) or the draft model."""
    config = TARGET if which == "target" else DRAFT
    params = decoder.init_params(config, jax.random.key(seed), scale=1.0)
    prefixes = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)
    tokens = np.concatenate([np.tile(PROMPT, (len(prefixes), 1)), prefixes], axis=1).astype(np.int32)
    return np.asarray(_full_logits(params, config, jnp.asarray(tokens)), np.float64)


def _exact_probs(settings: dict, logits: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[V ** N_NEW]``: P(x1 x2 x3 | PROMPT) = p(x1) p(x2 | x1) p(x3 | x1 x2), index
    x1 * V^2 + x2 * V + x3, each factor ``reference_probs`` of the target's logits with the
    tokens generated before it. ``logits``: ``_prefix_logits``' layout, of another target
    (tests/test_own_model.py); default TARGET's."""
    logits = _prefix_logits("target", TARGET_SEED) if logits is None else logits
    last = len(PROMPT) - 1
    p = np.zeros((V, V, V))
    p1 = reference_probs(logits[0, last], PROMPT, [], settings)
    for x1 in range(V):
        p2 = reference_probs(logits[x1 * V, last + 1], PROMPT, [x1], settings)
        for x2 in range(V):
            p3 = reference_probs(logits[x1 * V + x2, last + 2], PROMPT, [x1, x2], settings)
            p[x1, x2] = p1[x1] * p2[x2] * p3
    return p.reshape(-1)


# ---------------------------------------------------------------------------- sampling through the engine

_PROGRAMS: dict = {}


def _program(drafter, fresh: bool = False):
    """``engine.run_program`` jitted for TARGET and ``drafter``; ``fresh`` skips the cache
    (a monkeypatched acceptance rule must be traced anew)."""
    if fresh or drafter not in _PROGRAMS:
        fn = jax.jit(functools.partial(engine.run_program, config=TARGET, drafter=drafter, max_len=MAX_LEN))
        if fresh:
            return fn
        _PROGRAMS[drafter] = fn
    return _PROGRAMS[drafter]


def _drafter(kind: str, gamma: int, models):
    if kind == "plain":
        return None, None
    if kind == "model":
        return jaxspec.ModelDrafter(DRAFT, gamma=gamma, confidence=0.0), models["draft"]
    if kind == "model_confident":  # chains stopped below cumulative draft probability 0.3
        return jaxspec.ModelDrafter(DRAFT, gamma=gamma, confidence=0.3), models["draft"]
    if kind == "ngram":
        return jaxspec.NGramDrafter(gamma=gamma, max_n=2, min_n=1), None
    if kind == "early_exit":
        d = jaxspec.EarlyExitDrafter(TARGET, n_layers=1, gamma=gamma)
        return d, d.select_params(models["target"], None)
    # Trees (N + 1 <= MAX_LEN - len(PROMPT) - N_NEW = 8 window entries).
    if kind == "ngram_tree":  # up to 3 matches x gamma, merged into a trie
        return jaxspec.NGramDrafter(gamma=gamma, max_n=2, min_n=1, branches=3, branch_min_n=1), None
    if kind == "model_tree":  # EAGLE-2 top-k tree of the draft model, deterministic (no q)
        return jaxspec.ModelDrafter(DRAFT, gamma=gamma, tree_nodes=5, branching=2), models["draft"]
    if kind == "early_exit_tree":
        d = jaxspec.EarlyExitDrafter(TARGET, n_layers=1, gamma=gamma, tree_nodes=4, branching=2)
        return d, d.select_params(models["target"], None)
    if kind in ("eagle", "eagle_tree"):  # EAGLE-3 head, random, drafting 6 of the 8 tokens
        tree = dict(tree_nodes=4, branching=2) if kind == "eagle_tree" else {}
        d = jaxspec.EagleDrafter(EAGLE, gamma=gamma, **tree)
        return d, d.select_params(models["target"], models["eagle"])
    if kind == "sampled_siblings":  # SpecInfer: siblings drawn i.i.d. from q, each carrying q
        return SampledSiblings(DRAFT, gamma=1, tree_nodes=0, confidence=0.0), models["draft"]
    if kind in ("history", "history_peeking"):  # own text, 3 sibling rows (every row has PROMPT), earlier rollouts
        cls = PeekingHistory if kind == "history_peeking" else HistoryDrafter
        return cls(gamma=gamma, tree_nodes=7, max_n=2, min_n=1, siblings=3), EARLIER
    if kind == "hybrid":  # the history's tree where a bigram matches, the draft model's sampled chain elsewhere
        first = HistoryDrafter(gamma=gamma, tree_nodes=5, max_n=2, min_n=2, siblings=3)
        return jaxspec.HybridDrafter(first, jaxspec.ModelDrafter(DRAFT, gamma=gamma, confidence=0.0)), \
            (EARLIER, models["draft"])
    raise ValueError(kind)


# Two earlier rollouts of PROMPT for the history drafter (its last two tokens, then an output),
# one row's worth: ``_sample_counts`` gives every row the same.
EARLIER = HistoryRows(tokens=jnp.array([[[1, 2, 3, 1, 4, 0], [1, 2, 5, 5, 2, 6]]], jnp.int32),
                      lens=jnp.array([[5, 6]], jnp.int32), starts=jnp.array([[2, 2]], jnp.int32))


class SampledSiblings(jaxspec.ModelDrafter):
    """A test drafter: ``SIBLINGS`` children of the root drawn i.i.d. from the draft model's
    processed q (duplicates allowed), each with its q: the residual path of SpecInfer's
    multi-candidate rule (``norm(max(0, r - q))`` after each rejected sibling)."""

    @property
    def n_nodes(self) -> int:
        return SIBLINGS

    def propose(self, params, state, context):
        from jaxspec.drafters.model import DraftState
        from jaxspec.sampling import fold_rows
        from jaxspec.tree import Proposal

        logits, cache = self.read(params, state.cache, context)
        q = processed_probs(logits, context.sampling, context.history)
        tokens = jnp.stack([sample(fold_rows(context.keys, i), q) for i in range(SIBLINGS)], axis=1)
        b = tokens.shape[0]
        parents = jnp.full((b, SIBLINGS), -1, jnp.int32)
        proposal = Proposal(tokens, parents, jnp.ones((b, SIBLINGS), bool), jnp.repeat(q[:, None], SIBLINGS, axis=1))
        return DraftState(cache, jnp.full((b, SIBLINGS), -1, jnp.int32)), proposal


SIBLINGS = 3


def _sample_counts(models, inputs_factory, kind, gamma, settings, seed, n=N, fresh=False):
    """Counts ``[V ** 3]`` of the continuations of ``n`` rows, and the fractions of rows that
    accepted at least one draft and that rejected at least one."""
    drafter, dparams = _drafter(kind, gamma, models)
    rows = lambda h: jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n, *x.shape[1:])), h)  # noqa: E731
    if isinstance(dparams, HistoryRows):  # one row's earlier rollouts, for every row
        dparams = rows(dparams)
    elif isinstance(dparams, tuple) and isinstance(dparams[0], HistoryRows):  # a hybrid's
        dparams = (rows(dparams[0]), dparams[1])
    inputs = inputs_factory([PROMPT] * n, max_new_tokens=N_NEW, seed=seed, vocab_size=V, **settings)
    state = jax.device_get(_program(drafter, fresh)(models["target"], dparams, inputs))
    lp = len(PROMPT)
    np.testing.assert_array_equal(state.seq_lens, lp + N_NEW)
    x = state.tokens[:, lp : lp + N_NEW].astype(np.int64)
    counts = np.bincount((x[:, 0] * V + x[:, 1]) * V + x[:, 2], minlength=V**N_NEW)
    accepted_some = float((state.n_accepted > 0).mean())
    rejected_some = float((state.n_accepted < state.n_steps * (drafter.gamma if drafter else 0)).mean())
    return counts, (accepted_some, rejected_some)


def _check(counts, exact, label, max_tv=MAX_DETECTABLE_TV):
    """The chi-square test of ``counts`` against ``exact``; asserts that a TV of ``max_tv``
    would be detected with POWER (None: a test that must reject, where power is not asked)."""
    stat, df, p_value = chi_square_test(counts, exact)
    tv_emp = 0.5 * np.abs(counts / counts.sum() - exact).sum()
    tv_min = detectable_tv(int(counts.sum()), df)
    info = f"{label}: chi2 {stat:.1f}, df {df}, p {p_value:.3g}, empirical TV {tv_emp:.4f}, detectable TV {tv_min:.4f}"
    print(info)
    assert max_tv is None or tv_min <= max_tv, info
    return p_value, info


# Each setting changes the distribution a lot at V = 8 (TV to plain T = 1 sampling, printed
# by test_settings_change_the_distribution): temperatures, truncation and penalties.
SETTINGS = {
    "T=0.7": {"temperature": 0.7},
    "T=1": {"temperature": 1.0},
    "T=1.5": {"temperature": 1.5},
    "top_k=3": {"temperature": 1.0, "top_k": 3},
    "top_p=0.8": {"temperature": 1.0, "top_p": 0.8},
    "min_p=0.1": {"temperature": 1.0, "min_p": 0.1},
    "penalties": {"temperature": 1.0, "repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_processing_matches_reference(name):
    """``processed_probs`` (thresholds by bisection, penalties from ``History``) equals the
    sort-based float64 reference at every position of every 3-token continuation: the same
    support exactly, probabilities within 2e-6 (float32 softmax of logits below 30 in
    magnitude: a few ulps of 1)."""
    logits = _prefix_logits("target", TARGET_SEED)
    last = len(PROMPT) - 1
    worst = 0.0
    # one call per generated length (1, V and V^2 rows: every continuation of that length at once)
    for n in range(N_NEW):
        continuations = [list(g) for g in itertools.product(range(V), repeat=n)]
        rows = [int(np.ravel_multi_index(g, (V,) * n)) * V ** (2 - n) if n else 0 for g in continuations]
        x = logits[rows, last + n]
        sp = SamplingParams.make(len(rows), **SETTINGS[name])
        history = History.from_prompt(jnp.asarray([PROMPT] * len(rows), jnp.int32),
                                      jnp.full((len(rows),), len(PROMPT), jnp.int32), V)
        if n:
            history = history.add(jnp.asarray(continuations, jnp.int32), jnp.ones((len(rows), n), bool))
        ours = np.asarray(processed_probs(jnp.asarray(x, jnp.float32), sp, history))
        for generated, p_ours, x_row in zip(continuations, ours, x):
            ref = reference_probs(x_row, PROMPT, generated, SETTINGS[name])
            np.testing.assert_array_equal(p_ours > 0, ref > 0, err_msg=f"{name} support after {generated}")
            worst = max(worst, float(np.abs(p_ours - ref).max()))
    assert worst < 2e-6, worst


def test_settings_change_the_distribution():
    """Every setting's exact distribution is far (TV > 0.05, more than twice what the
    harness detects) from plain T = 1 sampling, so each case tests its own setting; the
    reference sums to 1."""
    plain = _exact_probs(SETTINGS["T=1"])
    for name, settings in SETTINGS.items():
        exact = _exact_probs(settings)
        assert exact.sum() == pytest.approx(1.0, abs=1e-9)
        tv = 0.5 * np.abs(exact - plain).sum()
        print(f"{name}: TV to T=1 {tv:.3f}, max cell {exact.max():.4f}")
        assert name == "T=1" or tv > 0.05, (name, tv)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_plain_sampling_matches_reference(models, inputs_factory, name):
    """Plain target sampling through the engine (no drafter) passes the chi-square test
    against the enumerated reference distribution, for every setting."""
    seed = SEED_STRIDE * (list(SETTINGS).index(name) + 40)
    counts, _ = _sample_counts(models, inputs_factory, "plain", 0, SETTINGS[name], seed=seed)
    p_value, info = _check(counts, _exact_probs(SETTINGS[name]), f"plain {name}")
    assert p_value > ALPHA, info


# Every drafter with every setting; gamma alternates 1 / 4 so each drafter meets both.
CASES = [
    (kind, (1, 4)[(i + k) % 2], name)
    for k, kind in enumerate(("model", "ngram", "early_exit"))
    for i, name in enumerate(SETTINGS)
]


# Trees: each tree drafter at T 0.7 and 1, top-k, top-p and penalties (gamma = depth 2, or 1
# for sampled siblings).
TREE_SETTINGS = ("T=0.7", "T=1", "top_k=3", "top_p=0.8", "penalties")
TREE_CASES = [(kind, 1 if kind == "sampled_siblings" else 2, name)
              for kind in ("ngram_tree", "model_tree", "early_exit_tree", "sampled_siblings") for name in TREE_SETTINGS]
CASES += TREE_CASES
# EAGLE-3 (a random head: exactness does not depend on training): its chain with q, whose
# support is the draft vocabulary (tokens 0 and 5 never drafted), at gamma 4 with penalties
# (q processed with the drafts' counts). One case for the suite's time; by hand these passed
# too: gamma 4 T = 0.7 (p = 0.78), gamma 1 top-p 0.8 (p = 0.16), gamma 2 penalties
# (p = 0.48), and the deterministic tree at T = 1 (p = 0.38).
CASES += [("eagle", 4, "penalties")]
# A chain that stops where the draft's cumulative probability falls below 0.3 (its length is
# the drafter's choice, never the target's: still exact).
CASES += [("model_confident", 4, "T=1"), ("model_confident", 4, "penalties")]
# The rollout-history drafter: its drafts come from sibling rows, themselves random (and from
# earlier rollouts): a chain-deep tree at T = 1 (the RL setting) and with penalties.
CASES += [("history", 3, "T=1"), ("history", 2, "penalties"), ("history", 3, "T=0.7")]
# The history where it matches and a draft model's sampled chain (with q) where it does not, in
# one window: one-hot q for the history's nodes beside the model's q.
CASES += [("hybrid", 3, "T=1"), ("hybrid", 2, "penalties")]


# CI: every drafter kind once, every setting at least once, both gammas of the chains.
CI_CASES = [("model", 4, "T=1"), ("model", 1, "penalties"), ("ngram", 4, "T=1.5"), ("ngram", 1, "min_p=0.1"),
            ("early_exit", 4, "top_k=3"), ("early_exit", 1, "top_p=0.8"), ("ngram_tree", 2, "T=1"),
            ("model_tree", 2, "penalties"), ("early_exit_tree", 2, "top_p=0.8"), ("sampled_siblings", 1, "T=0.7"),
            ("eagle", 4, "penalties"), ("history", 3, "T=1"), ("hybrid", 3, "T=1")]


@pytest.mark.parametrize("kind,gamma,name", core(CASES, CI_CASES))
def test_speculative_sampling_matches_target(models, inputs_factory, kind, gamma, name):
    """Speculative sampling with each drafter (draft model, n-gram lookup with q = None,
    early exit) at gamma 1 and 4 under each setting passes the chi-square test against the
    exact target distribution; drafts are accepted often enough (and rejected often
    enough) that both the acceptance and the residual paths shape the sample."""
    seed = SEED_STRIDE * (CASES.index((kind, gamma, name)) + 2)
    counts, (accepted_some, rejected_some) = _sample_counts(models, inputs_factory, kind, gamma, SETTINGS[name], seed)
    print(f"rows accepting a draft {accepted_some:.3f}, rows rejecting one {rejected_some:.3f}")
    assert accepted_some > 0.05 and rejected_some > 0.02, (accepted_some, rejected_some)
    p_value, info = _check(counts, _exact_probs(SETTINGS[name]), f"{kind} gamma {gamma} {name}")
    assert p_value > ALPHA, info


def test_draft_model_differs_from_target(models):
    """The draft model is a real approximation, not the target: TV between its first-token
    distribution and the target's is large (0.38 at T = 1), yet they overlap (>= 4 tokens
    have probability > 1% under both)."""
    last = len(PROMPT) - 1
    p = reference_probs(_prefix_logits("target", TARGET_SEED)[0, last], PROMPT, [], {})
    q = reference_probs(_prefix_logits("draft", DRAFT_SEED)[0, last], PROMPT, [], {})
    tv = 0.5 * np.abs(p - q).sum()
    assert 0.2 < tv < 0.6, tv
    assert (np.minimum(p, q) > 0.01).sum() >= 4, "supports barely overlap"


def test_generate_uses_the_same_sampler(models, inputs_factory):
    """``jaxspec.generate`` (row b seeded seed + b, prompt padded to 64, 256-slot cache)
    draws the same continuations as the program these tests sample, row for row."""
    drafter, dparams = _drafter("model", 2, models)
    seed, n = SEED_STRIDE * 30, 16
    out = jaxspec.generate(models["target"], [PROMPT] * n, config=TARGET, drafter=drafter, drafter_params=dparams,
                           max_new_tokens=N_NEW, temperature=1.0, seed=seed, ignore_eos=True)
    inputs = inputs_factory([PROMPT] * n, max_new_tokens=N_NEW, temperature=1.0, seed=seed, vocab_size=V)
    state = jax.device_get(_program(drafter)(models["target"], dparams, inputs))
    lp = len(PROMPT)
    assert out.tokens == state.tokens[:, lp : lp + N_NEW].tolist()


# ---------------------------------------------------------------------------- the harness rejects wrong rules


def _wrong_accept(rule: str):
    """A copy of the speculative-sampling rule with one deliberate mistake:

    - ``resample_from_p``: at the first rejection draw from p instead of norm(max(0, p - q));
    - ``always_accept``: accept every draft (the output then follows the drafter);
    - ``double_ratio``: accept with min(1, 2 p / q) instead of min(1, p / q);
    - ``bonus_off_by_one``: after all drafts are accepted, draw the bonus token from
      p[gamma - 1] (the distribution the last draft was checked against) instead of p[gamma];
    - ``inverted_ratio``: accept with min(1, q / p).

    (Accepting with an uncapped p / q is not a wrong rule here: u < p / q and u < min(1, p / q)
    are the same event for u in [0, 1).)
    """

    def wrong_chain(keys, p, q, drafts):
        b, g1, v = p.shape
        gamma = g1 - 1
        valid = drafts >= 0  # -1: the drafter abstained (as in jaxspec.acceptance)
        q = jax.nn.one_hot(drafts, v, dtype=p.dtype) if q is None else jnp.where(valid[..., None], q, 0.0)
        drafts = jnp.where(valid, drafts, 0)
        key_u = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
        key_r = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
        u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(key_u)
        p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        if rule == "always_accept":
            accepted = valid
        elif rule == "double_ratio":
            accepted = valid & (u * q_d < 2 * p_d)
        elif rule == "inverted_ratio":
            accepted = valid & (u * p_d < q_d)
        else:
            accepted = valid & (u * q_d < p_d)
        n_acc = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
        at = jnp.where(n_acc == gamma, gamma - 1, n_acc) if rule == "bonus_off_by_one" else n_acc
        p_next = jnp.take_along_axis(p, at[:, None, None], axis=1)[:, 0]
        q_pad = jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1)
        q_next = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
        if rule == "resample_from_p":
            residual = p_next
        else:
            residual = jnp.maximum(p_next - q_next, 0.0)
            mass = residual.sum(-1, keepdims=True)
            residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
        nxt = sample(key_r, residual)
        drafts_pad = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
        tokens = jnp.where(jnp.arange(g1)[None] < n_acc[:, None], drafts_pad, nxt[:, None])
        return n_acc, tokens.astype(jnp.int32)

    def wrong(keys, p, q, tree):  # the chain as the tree engine hands it over
        drafts = jnp.where(tree.valid[:, 1:], tree.tokens[:, 1:], -1)
        n_acc, tokens = wrong_chain(keys, p, q, drafts)
        path = jnp.minimum(jnp.arange(p.shape[1])[None], n_acc[:, None]).astype(jnp.int32)
        return acceptance.Accepted(n_acc, path, tokens)

    return wrong


@pytest.fixture
def clean_compile_caches():
    """Compiled programs traced with a patched rule must not outlive the test (nor may the
    real ones serve it): drop them before and after, keeping the real ones for later tests."""
    saved = dict(jaxspec.api._COMPILED)
    jaxspec.api._COMPILED.clear()
    jaxspec.api._jitted.cache_clear()
    yield
    jaxspec.api._COMPILED.clear()
    jaxspec.api._COMPILED.update(saved)
    jaxspec.api._jitted.cache_clear()


@pytest.mark.parametrize(
    "rule,gamma",
    core([("resample_from_p", 2), ("always_accept", 2), ("double_ratio", 2), ("inverted_ratio", 2), ("bonus_off_by_one", 1)],
         [("resample_from_p", 2), ("bonus_off_by_one", 1)]),
)
def test_wrong_rule_is_detected(models, inputs_factory, monkeypatch, clean_compile_caches, rule, gamma):
    """The same test (draft model, T = 1, N_DETECT rows, gamma as in the passing cases) rejects a
    speculative sampler whose acceptance rule is wrong: the engine calls
    ``acceptance.accept`` through the module, so patching the module attribute and
    re-tracing swaps the rule. (The bonus is only observed at gamma 1: with 3 new tokens a
    gamma-2 window never keeps its bonus.)"""
    monkeypatch.setattr(acceptance, "accept", _wrong_accept(rule))
    counts, _ = _sample_counts(models, inputs_factory, "model", gamma, SETTINGS["T=1"], seed=SEED_STRIDE * 20,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(counts, _exact_probs(SETTINGS["T=1"]), f"wrong rule {rule}", max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect a wrong rule: {info}"


def _counts_without_drafts(history, tree, width):
    """Wrong: every window position scored with the counts at the start of the step, as if
    penalties were fed only by the tokens committed before the window."""
    return jnp.broadcast_to(history.counts[:, None], (history.counts.shape[0], width, history.counts.shape[-1]))


@pytest.mark.parametrize("kind", core(["model", "ngram"], ["model"]))
def test_penalties_from_committed_tokens_only_are_detected(models, inputs_factory, monkeypatch, clean_compile_caches,
                                                           kind):
    """Penalties that ignore the drafts inside the verify window (the peer bug of feeding
    them only the tokens accepted before the step) change the distribution, and the harness
    rejects it; plain decoding is unaffected by the patch (one token per step)."""
    monkeypatch.setattr(jaxspec.sampling, "window_counts", _counts_without_drafts)
    counts, _ = _sample_counts(models, inputs_factory, kind, 2, SETTINGS["penalties"], seed=SEED_STRIDE * 21,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(counts, _exact_probs(SETTINGS["penalties"]), f"penalties without drafts ({kind})",
                           max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect penalties that skip the drafts: {info}"


# ---------------------------------------------------------------------------- wrong tree rules


def _wrong_tree_accept(rule: str):
    """``acceptance.accept`` with one deliberate mistake in the sibling loop:

    - ``sibling_kept``: a rejected sibling is not removed from the residual (r stays as it
      was), so the next sibling, or the final draw, can emit it again;
    - ``resample_from_p``: the final draw comes from the current node's p, ignoring every
      rejection's residual.
    """

    def wrong(keys, p, q, tree):
        b, w, v = p.shape
        n = w - 1
        key_u, key_r = jaxspec.sampling.fold_rows(keys, 0), jaxspec.sampling.fold_rows(keys, 1)
        u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(key_u)
        rows = jnp.arange(b)

        def visit(i, carry):
            current, depth, residual, path, emitted = carry
            node = i + 1
            token = tree.tokens[:, node]
            candidate = tree.valid[:, node] & (tree.parent[:, node] == current)
            q_i = jax.nn.one_hot(token, v, dtype=p.dtype) if q is None else q[:, i]
            accepted = candidate & (u[:, i] * q_i[rows, token] < residual[rows, token])
            left = jnp.maximum(residual - q_i, 0.0)
            mass = jnp.sum(left, axis=-1, keepdims=True)
            left = jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), residual)
            if rule == "sibling_kept":
                left = residual
            rejected = candidate & ~accepted
            residual = jnp.where(accepted[:, None], p[:, node], jnp.where(rejected[:, None], left, residual))
            depth = depth + accepted
            path = jnp.where(accepted[:, None] & (jnp.arange(w)[None] >= depth[:, None]), node, path)
            emitted = emitted.at[rows, jnp.where(accepted, depth - 1, w)].set(token, mode="drop")
            return jnp.where(accepted, node, current), depth, residual, path, emitted

        zeros = jnp.zeros((b,), jnp.int32)
        init = (zeros, zeros, p[:, 0], jnp.zeros((b, w), jnp.int32), jnp.zeros((b, w), jnp.int32))
        current, n_acc, residual, path, emitted = jax.lax.fori_loop(0, n, visit, init)
        if rule == "resample_from_p":
            residual = jnp.take_along_axis(p, current[:, None, None], axis=1)[:, 0]
        emitted = emitted.at[rows, n_acc].set(sample(key_r, residual))
        return acceptance.Accepted(n_acc, path, emitted)

    return wrong


def _counts_over_whole_window(history, tree, width):
    """Wrong: every window entry scored with the counts of ALL valid nodes of the tree (the
    whole window), not only its own ancestors."""
    if tree is None:
        return jnp.broadcast_to(history.counts[:, None], (history.counts.shape[0], width, history.counts.shape[-1]))
    nodes = jax.nn.one_hot(tree.tokens[:, 1:], history.counts.shape[-1], dtype=jnp.int32) * tree.valid[:, 1:, None]
    return history.counts[:, None] + jnp.sum(nodes, axis=1, keepdims=True)


@pytest.mark.parametrize("rule,kind", core([("sibling_kept", "model_tree"), ("resample_from_p", "sampled_siblings")],
                                           [("sibling_kept", "model_tree")]))
def test_wrong_tree_rule_is_detected(models, inputs_factory, monkeypatch, clean_compile_caches, rule, kind):
    """The harness rejects tree samplers with a wrong sibling rule (T = 1, as the passing cases)."""
    monkeypatch.setattr(acceptance, "accept", _wrong_tree_accept(rule))
    gamma = 1 if kind == "sampled_siblings" else 2
    counts, _ = _sample_counts(models, inputs_factory, kind, gamma, SETTINGS["T=1"], seed=SEED_STRIDE * 22,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(counts, _exact_probs(SETTINGS["T=1"]), f"wrong tree rule {rule} ({kind})", max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect a wrong tree rule: {info}"


def test_tree_penalties_over_the_whole_window_are_detected(models, inputs_factory, monkeypatch, clean_compile_caches):
    """Penalties counted over every node of the tree instead of each node's ancestors change
    the distribution (siblings penalise each other), and the harness rejects it."""
    monkeypatch.setattr(jaxspec.sampling, "window_counts", _counts_over_whole_window)
    counts, _ = _sample_counts(models, inputs_factory, "model_tree", 2, SETTINGS["penalties"], seed=SEED_STRIDE * 23,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(counts, _exact_probs(SETTINGS["penalties"]), "tree penalties over the whole window",
                           max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect window-wide tree penalties: {info}"


class PeekingHistory(HistoryDrafter):
    """WRONG: the history drafter that drafts only when the row's first acceptance uniform is
    below 1/2, and abstains otherwise: a draft chosen after looking at the row's own
    acceptance draws. It reads them from its step keys, which ``_keys_shared_with_acceptance``
    makes the acceptance's keys (``jax.random.uniform``'s first value does not depend on how
    many are drawn, so it is the first node's uniform at any window width)."""

    def propose(self, params, state, context):
        from jaxspec.sampling import fold_rows

        state, proposal = super().propose(params, state, context)
        u0 = jax.vmap(lambda k: jax.random.uniform(k, (1,))[0])(fold_rows(context.keys, 0))
        return state, dataclasses.replace(proposal, valid=proposal.valid & (u0 < 0.5)[:, None])


def _keys_shared_with_acceptance(fold):
    """``engine.fold_rows`` with index 1 (the acceptance's keys of a step) folded as index 0
    (the drafter's keys): exact still for a drafter that ignores its keys, as HistoryDrafter."""
    return lambda keys, i: fold(keys, 0 if isinstance(i, int) and i == 1 else i)


def test_history_drafter_that_peeks_is_detected(models, inputs_factory, monkeypatch, clean_compile_caches):
    """The history drafter's exactness rests on drafts that do not depend on the row's own
    acceptance draws (siblings and earlier rollouts are random, but drawn before the step, with
    other keys). One that looks at them is rejected by the same test; the honest drafter under
    the same shared keys passes it."""
    monkeypatch.setattr(engine, "fold_rows", _keys_shared_with_acceptance(engine.fold_rows))
    exact = _exact_probs(SETTINGS["T=1"])
    honest, _ = _sample_counts(models, inputs_factory, "history", 3, SETTINGS["T=1"], seed=SEED_STRIDE * 25,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(honest, exact, "history drafter, shared keys", max_tv=None)
    assert p_value > ALPHA, info
    peeked, _ = _sample_counts(models, inputs_factory, "history_peeking", 3, SETTINGS["T=1"], seed=SEED_STRIDE * 26,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(peeked, exact, "history drafter peeking at its acceptance draws", max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect drafts chosen from the acceptance draws: {info}"


def test_acceptance_gate_keeps_the_distribution(models, inputs_factory, monkeypatch):
    """Rows that the acceptance gate turns off mid-call still sample the target exactly. With
    a window of one step and gamma 1, a row whose first verify step emitted one token (its
    draft rejected) has tau 1: under its threshold 2 it decodes its last token plainly, while
    rows of threshold 1 keep drafting in the same steps (drafts masked per row, the drafter
    still running): the gate decides from the row's past only, so the emitted tokens keep
    the target's distribution (T = 1)."""
    monkeypatch.setattr(policy, "GATE_WINDOW", 1)  # read when the program is traced (fresh below)
    drafter, dparams = _drafter("model", 1, models)
    inputs = inputs_factory([PROMPT] * N, max_new_tokens=N_NEW, seed=SEED_STRIDE * 97, vocab_size=V, temperature=1.0)
    gate_tau = jnp.where(jnp.arange(N) % 2 == 0, 2.0, 1.0).astype(jnp.float32)
    inputs = dataclasses.replace(inputs, gate_tau=gate_tau)
    state = jax.device_get(_program(drafter, fresh=True)(models["target"], dparams, inputs))
    lp = len(PROMPT)
    np.testing.assert_array_equal(state.seq_lens, lp + N_NEW)
    gated = ~state.speculating
    # threshold 2: gated exactly where the first step's draft was rejected; threshold 1: never
    assert not gated[1::2].any()
    np.testing.assert_array_equal(gated[0::2], state.n_accepted[0::2] == 0)
    assert 0.2 < gated[0::2].mean() < 0.8, gated[0::2].mean()
    np.testing.assert_array_equal(state.n_drafted[gated], 1)  # drafted at step 1 only
    assert (state.n_drafted[1::2][state.n_steps[1::2] == 2] == 2).all()  # kept drafting at step 2
    x = state.tokens[:, lp : lp + N_NEW].astype(np.int64)
    counts = np.bincount((x[:, 0] * V + x[:, 1]) * V + x[:, 2], minlength=V**N_NEW)
    p_value, info = _check(counts, _exact_probs(SETTINGS["T=1"]), "model gamma 1 T=1, acceptance gate")
    assert p_value > ALPHA, info


# ---------------------------------------------------------------------------- structured output

# Tokens 0..7 spell "a".."h"; the grammar allows a or b then d or e, or c then f (forced),
# then anything: the first two tokens are constrained (the second by the first), the third free.
GRAMMAR = "([ab][de]|cf)[a-h]*"


def _grammar_allowed(generated) -> set[int]:
    """The tokens ``GRAMMAR`` allows after ``generated``, written out by hand (independent of
    outlines-core and ``jaxspec.grammar``)."""
    if not generated:
        return {0, 1, 2}
    if len(generated) == 1:
        return {3, 4} if generated[0] in (0, 1) else {5}
    return set(range(V))


def _grammar_exact(settings: dict) -> np.ndarray:
    """``_exact_probs`` under ``GRAMMAR``: each factor's logits masked to the allowed tokens."""
    logits = _prefix_logits("target", TARGET_SEED).copy()
    last = len(PROMPT) - 1
    for x1 in range(V):
        for x2 in range(V):
            for j, gen in enumerate(([], [x1], [x1, x2])):
                banned = [t for t in range(V) if t not in _grammar_allowed(gen)]
                logits[x1 * V + x2, last + j, banned] = -np.inf
    return _exact_probs(settings, logits)


def _grammar_counts(models, inputs_factory, kind, gamma, settings, seed, n=N, fresh=False):
    from jaxspec import grammar
    from jaxspec.tokenizer import Tokenizer

    tok = Tokenizer(list("abcdefgh"), merges=[], name="dist-bytes")
    tables = grammar.tables([grammar.compile_pattern(GRAMMAR, tok)] * n, (), V)
    drafter, dparams = _drafter(kind, gamma, models)
    inputs = inputs_factory([PROMPT] * n, max_new_tokens=N_NEW, seed=seed, vocab_size=V, **settings)
    inputs = dataclasses.replace(inputs, grammar=tables.device())
    state = jax.device_get(_program(drafter, fresh)(models["target"], dparams, inputs))
    lp = len(PROMPT)
    np.testing.assert_array_equal(state.seq_lens, lp + N_NEW)
    x = state.tokens[:, lp : lp + N_NEW].astype(np.int64)
    return np.bincount((x[:, 0] * V + x[:, 1]) * V + x[:, 2], minlength=V**N_NEW), state


GRAMMAR_CASES = [("plain", 0, "T=1"), ("model", 2, "T=1"), ("model", 1, "penalties"), ("ngram", 2, "T=0.7"),
                 ("model_tree", 2, "T=1"), ("early_exit", 2, "top_p=0.8")]


@pytest.mark.parametrize("kind,gamma,name", core(GRAMMAR_CASES, [("model", 2, "T=1"), ("ngram", 2, "T=0.7"),
                                                                ("model_tree", 2, "T=1")]))
def test_grammar_sampling_matches_constrained_target(models, inputs_factory, kind, gamma, name):
    """Under a grammar, plain and speculative sampling (a draft model's masked q, n-gram and
    top-k tree drafts without q, which the grammar fills and prunes) draw exactly the target's
    distribution masked to the grammar: the chi-square test against the hand-masked
    reference; continuations outside the grammar have probability 0 and are never drawn."""
    seed = SEED_STRIDE * (GRAMMAR_CASES.index((kind, gamma, name)) + 60)
    counts, state = _grammar_counts(models, inputs_factory, kind, gamma, SETTINGS[name], seed)
    exact = _grammar_exact(SETTINGS[name])
    assert counts[exact == 0].sum() == 0
    if kind != "plain":
        assert (state.n_accepted > 0).mean() > 0.05, (state.n_accepted > 0).mean()
    p_value, info = _check(counts, exact, f"grammar {kind} gamma {gamma} {name}")
    assert p_value > ALPHA, info


def _root_state_everywhere(tables, state, tree):
    """Wrong: every window entry masked with the root's state (the state at the start of the
    step), not the state after the path to it."""
    return jnp.broadcast_to(state[:, None], tree.tokens.shape)


def test_grammar_mask_of_the_step_start_is_detected(models, inputs_factory, monkeypatch, clean_compile_caches):
    """A verify window masked with the step's first state at every entry (one mask for the
    whole window) changes the distribution, and the harness rejects it."""
    from jaxspec import grammar

    monkeypatch.setattr(grammar, "window_states", _root_state_everywhere)
    counts, _ = _grammar_counts(models, inputs_factory, "model", 2, SETTINGS["T=1"], SEED_STRIDE * 70, n=N_DETECT,
                                fresh=True)
    p_value, info = _check(counts, _grammar_exact(SETTINGS["T=1"]), "grammar: one mask per window", max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect a window masked with the step's first state: {info}"


def test_hybrid_with_the_model_q_on_lookup_nodes_is_detected(models, inputs_factory, monkeypatch, clean_compile_caches):
    """A hybrid's window mixes rows of deterministic lookup nodes (q one-hot on the node's
    token) with rows of the draft model's sampled chain (its q). Giving the lookup nodes a
    q they were not drawn from (here uniform over the vocabulary: accepted with min(1, V p)
    instead of p) is rejected by the same test that the hybrid passes."""
    from jaxspec.drafters import hybrid

    monkeypatch.setattr(hybrid, "_q", lambda proposal, vocab: jnp.full(proposal.tokens.shape + (vocab,), 1.0 / vocab)
                        if proposal.q is None else proposal.q)
    counts, _ = _sample_counts(models, inputs_factory, "hybrid", 3, SETTINGS["T=1"], seed=SEED_STRIDE * 27,
                               n=N_DETECT, fresh=True)
    p_value, info = _check(counts, _exact_probs(SETTINGS["T=1"]), "hybrid, uniform q on lookup nodes", max_tv=None)
    assert p_value < ALPHA, f"the harness did not detect a wrong q on the lookup nodes: {info}"
