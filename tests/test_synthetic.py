"""Synthetic acceptance (``jaxspec.synthetic``, benchmarks only, NOT lossless): the rule on a
hand-made tree (exact arrays), the engine hook on the tiny target (rates 0 give plain
decoding's tokens, rates 1 accept every draft and then the target's own token, per-position
frequencies match the rates), the marks on every result, and the refusals before any compile."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import api, cli, synthetic
from jaxspec.synthetic import SyntheticAcceptance, SyntheticAcceptanceWarning
from jaxspec.tree import Proposal, Tree

GAMMA = 3


def _run(tiny, rates, drafter=None, **kw):
    """``generate`` on the tiny target's three prompts with synthetic acceptance (warning caught)."""
    drafter = drafter or jaxspec.RepeatDrafter(GAMMA)
    with pytest.warns(SyntheticAcceptanceWarning, match="NOT the model's output"):
        out = jaxspec.generate(tiny.params, tiny.prompts, config=tiny.cfg, drafter=drafter, ignore_eos=True,
                               synthetic_acceptance=SyntheticAcceptance(rates), allow_synthetic_acceptance=True,
                               **{"max_new_tokens": tiny.max_new, **kw})
    assert out.synthetic and out.metrics.synthetic and out.metrics.synthetic_rates == tuple(map(float, rates))
    summary = out.metrics.summary()
    assert summary["synthetic"] is True and summary["synthetic_acceptance_rates"] == list(map(float, rates))
    assert out.metrics.row(0)["synthetic"] is True
    return out


def test_rule_follows_first_valid_child_and_stops_at_the_path_depth():
    """Window [root, n0..n3], parents (-1, -1, 1, 0): the first-child path is n0 -> n3 (window 1,
    4), depth 2, so rates 1 accept 2 drafts however many the coins allow; with n0 invalid the
    path is n1 -> n2 (window 2, 3). The token after the path is the argmax of p there (one-hot)."""
    v = 16
    tokens = jnp.array([[3, 4, 5, 6]])
    argmax = jnp.array([[7, 8, 9, 10, 11]])  # the target's token after each window entry
    p = jax.nn.one_hot(argmax, v)

    @jax.jit
    def rule(valid, rates):
        tree = Tree.of(jnp.array([1]), Proposal(tokens, jnp.array([[-1, -1, 1, 0]]), valid))
        return synthetic.accept(jax.random.key(0)[None], p, tree, rates)

    for valid, path, emitted in (([True] * 4, [0, 1, 4, 4, 4], [3, 6, 11]), ([False, True, True, True], [0, 2, 3, 3, 3],
                                                                            [4, 5, 10])):
        acc = rule(jnp.array([valid]), jnp.ones((1, 3)))
        assert acc.n_accepted.tolist() == [2]
        assert acc.path.tolist() == [path]
        assert acc.tokens[0, :3].tolist() == emitted
    zero = rule(jnp.array([valid]), jnp.zeros((1, 3)))
    assert zero.n_accepted.tolist() == [0] and zero.tokens[0, 0] == 7  # nothing kept: the root's next token


def test_rates_zero_give_plain_decoding(tiny, plain_greedy):
    """Accepting nothing emits the target's token after the root, which is plain decoding:
    same tokens (greedy, and sampled with the same seed: the same key draws the token), while
    every step still verifies and counts the full window of gamma drafts."""
    out = _run(tiny, (0.0,) * GAMMA)
    assert out.tokens == plain_greedy
    steps = out.metrics.verify_steps
    assert out.metrics.accepted.tolist() == [0, 0, 0] and (out.metrics.drafted == GAMMA * steps).all()
    assert steps.tolist() == [tiny.max_new - 1] * 3 and out.metrics.tau == 1.0
    sampled = dict(temperature=0.9, seed=7)
    assert _run(tiny, (0.0,) * GAMMA, **sampled).tokens == tiny.generate(tiny.prompts, **sampled).tokens


def test_rates_one_accept_every_draft_then_the_target_token(tiny):
    """Rates 1: each step keeps the gamma drafts (RepeatDrafter: the root repeated) and adds the
    target's greedy token after them: tau = gamma + 1 exactly (24 = 6 x 4 tokens after the
    first), and the token after step 2's drafts is plain decoding's next token for that text."""
    out = _run(tiny, (1.0,) * GAMMA, max_new_tokens=25)
    assert out.metrics.tau == GAMMA + 1 and (out.metrics.accepted == GAMMA * out.metrics.verify_steps).all()
    for toks in out.tokens:
        for k in range(6):
            assert toks[4 * k + 1: 4 * k + 4] == [toks[4 * k]] * GAMMA
    prefixes = [p + t[:8] for p, t in zip(tiny.prompts, out.tokens)]
    assert [t[0] for t in tiny.generate(prefixes, max_new_tokens=1).tokens] == [t[8] for t in out.tokens]


def test_frequencies_match_the_rates(tiny):
    """Position i is accepted in a fraction a_1...a_i of steps: 3 seeds x 3 rows x 59 steps
    (531 steps); tolerance 4.5 binomial standard deviations (a false failure ~1e-5 per
    position; the seeds are fixed, so the test is deterministic)."""
    rates = (0.9, 0.5, 0.3)
    accepted_at, steps = np.zeros(GAMMA), 0
    for seed in range(3):
        out = _run(tiny, rates, max_new_tokens=150, seed=seed)
        accepted_at += out.metrics.accepted_at.sum(axis=0)
        steps += int(out.metrics.verify_steps.sum())
        assert (out.metrics.drafted == GAMMA * out.metrics.verify_steps).all()
    expected = np.cumprod(rates)
    sigma = np.sqrt(expected * (1 - expected) / steps)
    assert steps >= 500
    assert np.all(np.abs(accepted_at / steps - expected) < 4.5 * sigma), (accepted_at / steps, expected)


def test_tree_drafter_with_abstentions_verifies_the_full_window(tiny):
    """An n-gram tree (2 branches x gamma 2) abstains where nothing matches; under synthetic
    acceptance every node still counts (4 per step) and rates 1 accept the first branch's 2."""
    out = _run(tiny, (1.0, 1.0), drafter=jaxspec.NGramDrafter(gamma=2, branches=2, min_n=1, branch_min_n=1))
    steps = out.metrics.verify_steps
    assert (out.metrics.drafted == 4 * steps).all() and (out.metrics.accepted == 2 * steps).all()


def test_from_tau():
    assert SyntheticAcceptance.from_tau(1, 4).rates == (0.0,) * 4
    assert SyntheticAcceptance.from_tau(5, 4).rates == (1.0,) * 4
    assert SyntheticAcceptance.from_tau(1.7, 1).rates == pytest.approx((0.7,), abs=1e-12)
    for tau in (1.5, 2.0, 3.0, 4.0):
        s = SyntheticAcceptance.from_tau(tau, 4)
        assert s.gamma == 4 and s.expected_tau == pytest.approx(tau, abs=1e-9) and len(set(s.rates)) == 1
    assert SyntheticAcceptance((0.9, 0.5, 0.2)).expected_tau == pytest.approx(1 + 0.9 + 0.45 + 0.09)


@pytest.mark.parametrize("make, match", [
    (lambda: SyntheticAcceptance((1.2,)), r"synthetic acceptance rate 1 must be in \[0, 1\], got 1.2"),
    (lambda: SyntheticAcceptance((0.5, -0.1)), r"rate 2 must be in \[0, 1\], got -0.1"),
    (lambda: SyntheticAcceptance((math.nan,)), r"rate 1 must be in \[0, 1\], got nan"),
    (lambda: SyntheticAcceptance(()), "non-empty sequence"),
    (lambda: SyntheticAcceptance(0.5), "non-empty sequence"),
    (lambda: SyntheticAcceptance.from_tau(0.5, 4), r"tau must be in \[1, gamma \+ 1\] = \[1, 5\] for gamma 4, got 0.5"),
    (lambda: SyntheticAcceptance.from_tau(5.5, 4), r"= \[1, 5\] for gamma 4, got 5.5"),
    (lambda: SyntheticAcceptance.from_tau(2, 0), "gamma must be an integer >= 1"),
])
def test_bad_rates(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("kw, match", [
    (dict(synthetic_acceptance=SyntheticAcceptance((0.5,) * GAMMA)), "allow_synthetic_acceptance=True"),
    (dict(synthetic_acceptance=SyntheticAcceptance((0.5,) * GAMMA), allow_synthetic_acceptance="yes"),
     "allow_synthetic_acceptance=True"),
    (dict(synthetic_acceptance=SyntheticAcceptance((0.5,) * 2), allow_synthetic_acceptance=True),
     "has 2 rates but the drafter's gamma is 3"),
    (dict(synthetic_acceptance=(0.5,) * GAMMA, allow_synthetic_acceptance=True), "must be a jaxspec.SyntheticAcceptance"),
    (dict(synthetic_acceptance=SyntheticAcceptance((0.5,) * GAMMA), allow_synthetic_acceptance=True, drafter=None),
     "needs a drafter"),
])
def test_refused_before_compile(tiny, monkeypatch, kw, match):
    def fail(*args, **kwargs):
        raise AssertionError("reached compilation: the error must come before")

    monkeypatch.setattr(api, "_jitted", fail)
    kw = {"drafter": jaxspec.RepeatDrafter(GAMMA), **kw}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused calls do not get as far as the warning
        with pytest.raises(ValueError, match=match):
            jaxspec.generate(tiny.params, tiny.prompts, config=tiny.cfg, max_new_tokens=4, **kw)


@pytest.mark.parametrize("flags, message", [
    (["--synthetic-acceptance", "0.5"], "NOT lossless .* add --allow-synthetic-acceptance"),
    (["--synthetic-tau", "2"], "--synthetic-tau is NOT lossless"),
    (["--synthetic-acceptance", "1.5", "--allow-synthetic-acceptance"], r"rate 1 must be in \[0, 1\], got 1.5"),
    (["--synthetic-acceptance", "0.5,0.5", "--allow-synthetic-acceptance"], "2 rates given but the drafter.s gamma is 4"),
    (["--synthetic-tau", "6", "--allow-synthetic-acceptance"], r"--synthetic-tau: .*\[1, 5\]"),
    (["--synthetic-tau", "2", "--allow-synthetic-acceptance", "--drafter", "none"], "needs a drafter"),
    (["--synthetic-tau", "2", "--synthetic-acceptance", "0.5", "--allow-synthetic-acceptance"], "not both"),
    (["--allow-synthetic-acceptance"], "--allow-synthetic-acceptance applies only with --synthetic-acceptance or "
                                       "--synthetic-tau"),
])
def test_cli_refusals(flags, message):
    """Checked before the model is loaded (no model name is valid here)."""
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "hi", "--model", "no-such-model", *flags])


def test_cli_one_rate_covers_every_position():
    args = cli._parser().parse_args(["generate", "hi", "--gamma", "3", "--synthetic-acceptance", "0.25",
                                     "--allow-synthetic-acceptance", "--drafter", "repeat"])
    assert cli._synthetic(args) == SyntheticAcceptance((0.25, 0.25, 0.25))
