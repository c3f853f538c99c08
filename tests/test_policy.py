"""The batch-aware policy (issue 10, part 4): above ``disable_by_batch_size`` rows ``generate``
decodes plainly, says so in the metrics, and gives plain decoding's tokens."""

from __future__ import annotations

import pytest

import jaxspec
import jaxspec.api
from jaxspec import policy


def test_limit_reads_the_measured_table_and_checks_its_argument(monkeypatch):
    drafter = jaxspec.NGramDrafter(gamma=2)
    monkeypatch.setitem(policy.MEASURED, ("cpu", "ngram"), 4)
    assert policy.limit("auto", drafter, backend="cpu") == 4
    assert policy.limit("auto", drafter, backend="tpu") is None  # not measured there: never disabled
    assert policy.limit(None, drafter) is None and policy.limit(3, drafter) == 3
    for bad in (0, -1, "4", 2.5, True):
        with pytest.raises(ValueError, match=r"disable_by_batch_size must be 'auto', None or an integer >= 1"):
            policy.limit(bad, drafter)
    assert policy.decide(4, drafter, rows=4) is None
    assert policy.decide(4, None, rows=8) is None  # plain decoding asked: nothing to disable
    assert policy.decide(4, drafter, rows=8, synthetic=True) is None  # a benchmark of speculation itself
    assert policy.decide(4, drafter, rows=8).startswith("plain decoding: 8 rows > disable_by_batch_size 4 (set by")


def test_generate_decodes_plainly_above_the_limit(tiny, plain_greedy, monkeypatch):
    """3 rows over a limit of 2: plain decoding's program (nothing new compiled) and tokens,
    the reason in the metrics; at the limit, or with None, it speculates."""
    drafter = jaxspec.NGramDrafter(gamma=3, max_n=3, min_n=1)  # conftest's n-gram drafter: its program exists

    def run(rows, **kw):
        return jaxspec.generate(tiny.params, tiny.prompts[:rows], config=tiny.cfg,
                                drafter=drafter, max_new_tokens=tiny.max_new, ignore_eos=True, **kw)

    off = run(3, disable_by_batch_size=2)
    assert off.tokens == plain_greedy
    assert off.metrics.speculation.startswith("plain decoding: 3 rows > disable_by_batch_size 2")
    assert off.metrics.summary()["speculation_off"] == off.metrics.speculation
    assert off.metrics.drafted.sum() == 0 and off.metrics.tau == 1.0
    plain = jaxspec.generate(tiny.params, tiny.prompts[:3], config=tiny.cfg, max_new_tokens=tiny.max_new,
                             ignore_eos=True)
    assert plain.metrics.compile_s == 0.0  # the policy ran plain decoding's very program
    on = run(3, disable_by_batch_size=None)
    assert on.tokens == plain_greedy and on.metrics.speculation is None and on.metrics.drafted.sum() > 0
    monkeypatch.setitem(policy.MEASURED, (jax_backend(), "ngram"), 2)
    assert run(3).metrics.speculation.startswith("plain decoding: 3 rows > disable_by_batch_size 2 (measured for "
                                                 "drafter kind 'ngram' on cpu")
    assert run(3, disable_by_batch_size=3).metrics.speculation is None
    with pytest.raises(ValueError, match=r"disable_by_batch_size must be 'auto', None or an integer >= 1, got 0"):
        run(1, disable_by_batch_size=0)


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def test_batch_sweep_picks_the_limit_and_mixes_categories():
    """``benchmarks/batch_sweep.py``: the limit is the largest batch up to which every measured
    size was faster than plain; questions come round-robin over the categories."""
    from benchmarks import batch_sweep

    assert batch_sweep.policy_limit({1: 1.14, 2: 0.98, 4: 1.02}) == 1
    assert batch_sweep.policy_limit({1: 0.9, 2: 1.1}) is None
    assert batch_sweep.policy_limit({1: 1.2, 2: 1.1}) == "all"
    qs = batch_sweep.mixed_questions(batch_sweep.QUESTIONS, 20)
    cats = [q["category"] for q in qs]
    assert len(set(cats[:13])) == 13 and cats[13] == cats[0] and len(qs) == 20


def test_gate_reads_the_break_even_table_and_checks_its_argument(monkeypatch):
    drafter = jaxspec.NGramDrafter(gamma=2)  # a chain of 2: tau is at most 3
    monkeypatch.setitem(policy.BREAK_EVEN, ("cpu", "ngram", 2), 1.7)
    assert policy.gate("auto", drafter, backend="cpu") == 1.7
    assert policy.gate("auto", drafter, backend="tpu") is None  # not measured there: never gated
    assert policy.gate("auto", jaxspec.NGramDrafter(gamma=3), backend="cpu") is None  # another gamma
    tree = jaxspec.NGramDrafter(gamma=2, branches=3)  # 6 nodes of depth <= 2: the chain's entry does not apply
    assert tree.n_nodes == 6 and policy.gate("auto", tree, backend="cpu") is None
    assert policy.gate(None, drafter) is None and policy.gate(2.5, drafter) == 2.5 and policy.gate(3, drafter) == 3.0
    assert policy.gate("auto", None) is None and policy.gate(2.0, None) is None  # plain decoding: nothing to gate
    for bad in (1.0, 0.5, 3.5, "2", True, float("nan")):
        with pytest.raises(ValueError, match=r"disable_by_acceptance must be 'auto', None or a mean accepted length "
                                             r"\(tau\) in \(1, 3\] .*gamma 2 here"):
            policy.gate(bad, drafter)
    with pytest.raises(ValueError, match=r"in \(1, 3\]"):  # the most a step of the tree emits is gamma + 1 too
        policy.gate(4, tree)


def test_acceptance_gate_turns_off_rows_whose_drafts_do_not_pay(tiny, plain_greedy, monkeypatch):
    """The unrelated draft model (tau ~1.1 here) under a gate of tau 2: every row stops after
    exactly GATE_WINDOW verify steps of gamma drafts each, the tokens are plain decoding's,
    and the metrics say which rows; a row whose drafts are all accepted is never gated."""
    gamma, window = 4, policy.GATE_WINDOW
    off = tiny.generate(tiny.prompts, "model_small", gamma, disable_by_acceptance=2.0)
    assert off.tokens == plain_greedy
    assert off.metrics.gated.tolist() == [True] * 3 and off.metrics.drafted.tolist() == [window * gamma] * 3
    assert off.metrics.summary()["rows_gated"] == 3 and off.metrics.summary()["gate_tau"] == 2.0
    assert off.metrics.row(0)["gated"] is True
    on = tiny.generate(tiny.prompts, "model_small", gamma, disable_by_acceptance=None)
    assert on.tokens == plain_greedy and not on.metrics.gated.any()
    assert (on.metrics.drafted > window * gamma).all() and on.metrics.summary()["gate_tau"] is None
    monkeypatch.setitem(policy.BREAK_EVEN, (jax_backend(), "model", gamma), 2.0)
    auto = tiny.generate(tiny.prompts, "model_small", gamma)  # "auto": the table's 2.0
    assert auto.metrics.drafted.tolist() == off.metrics.drafted.tolist() and auto.metrics.gate_tau == 2.0
    # the target drafting for itself: 5 tokens a step, above any gate up to 5; with 60 new
    # tokens its last step emits 4 (the first token is the prefill's), which pulls its last
    # window below 5, but a row that step ended is not counted as gated
    for new, threshold in ((61, 4.5), (60, 5.0)):
        same = tiny.generate(tiny.prompts[:1], "model_self", gamma, max_new_tokens=new, disable_by_acceptance=threshold)
        assert same.metrics.verify_steps[0] == 12 and not same.metrics.gated.any(), new
    with pytest.raises(ValueError, match=r"disable_by_acceptance must be .* in \(1, 5\] .* got 6"):
        tiny.generate(tiny.prompts, "model_small", gamma, disable_by_acceptance=6)
    with pytest.raises(ValueError, match=r"in \(1, 5\] .* got 6"):  # checked even where the batch policy
        tiny.generate(tiny.prompts, "model_small", gamma, disable_by_acceptance=6, disable_by_batch_size=1)


def test_acceptance_gate_is_off_for_synthetic_acceptance(tiny):
    """A benchmark of the system at chosen acceptance rates is never gated."""
    res = tiny.generate(tiny.prompts[:1], "model_small", 2, disable_by_acceptance=3.0, allow_synthetic_acceptance=True,
                        synthetic_acceptance=jaxspec.SyntheticAcceptance(rates=(0.0, 0.0)))
    assert res.metrics.gate_tau is None and not res.metrics.gated.any()
