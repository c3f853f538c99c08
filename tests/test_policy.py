"""The batch-aware policy (issue 10, part 4): above ``disable_by_batch_size`` rows ``generate``
decodes plainly, says so in the metrics, and gives plain decoding's tokens."""

from __future__ import annotations

import pytest

import jaxspec
import jaxspec.api
from jaxspec import policy


def test_limit_reads_the_measured_table_and_checks_its_argument(monkeypatch):
    drafter = jaxspec.NGramDrafter(gamma=2)
    monkeypatch.setitem(policy.MEASURED, ("cpu", "NGramDrafter"), 4)
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
    run = lambda rows, **kw: jaxspec.generate(tiny.params, tiny.prompts[:rows], config=tiny.cfg,  # noqa: E731
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
    monkeypatch.setitem(policy.MEASURED, (jax_backend(), "NGramDrafter"), 2)
    assert run(3).metrics.speculation.startswith("plain decoding: 3 rows > disable_by_batch_size 2 (measured for "
                                                 "NGramDrafter on cpu")
    assert run(3, disable_by_batch_size=3).metrics.speculation is None
    with pytest.raises(ValueError, match=r"disable_by_batch_size must be 'auto', None or an integer >= 1, got 0"):
        run(1, disable_by_batch_size=0)


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def test_batch_sweep_picks_the_limit_and_mixes_categories():
    """``benchmarks/batch_sweep.py``: the limit is the largest batch up to which every measured
    size was faster than plain; questions come round-robin over the categories."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import batch_sweep

    assert batch_sweep.policy_limit({1: 1.14, 2: 0.98, 4: 1.02}) == 1
    assert batch_sweep.policy_limit({1: 0.9, 2: 1.1}) is None
    assert batch_sweep.policy_limit({1: 1.2, 2: 1.1}) == "all"
    qs = batch_sweep.mixed_questions(batch_sweep.QUESTIONS, 20)
    cats = [q["category"] for q in qs]
    assert len(set(cats[:13])) == 13 and cats[13] == cats[0] and len(qs) == 20
