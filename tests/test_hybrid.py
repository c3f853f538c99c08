"""HybridDrafter: a lookup drafter's proposal where it finds a match, a draft model's elsewhere.

Exactness under sampling is tests/test_distribution.py's ("hybrid" cases); here: greedy
output equals plain decoding's for each fallback kind, each row takes the drafter the rule
says, the draft model reads the tokens it did not draft, and bad input is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.drafters.base import Context, Prefill
from jaxspec.sampling import History, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [5, 6, 7, 8, 5, 6]]  # rows 0 and 2 share their prompt


def _history(tiny):
    return jaxspec.RolloutHistory(vocab_size=tiny.cfg.vocab_size, capacity=8, max_tokens=64)


def test_hybrid_greedy_is_plain(tiny):
    """Greedy output equals plain decoding's: the rollout history with a draft model's chain
    (the history filled by a sampled call first), prompt lookup with a draft model's tree, and
    prompt lookup with early exit; the pair's history comes back updated."""
    kw = dict(config=tiny.cfg, max_new_tokens=24, ignore_eos=True, n=2)
    plain = jaxspec.generate(tiny.params, PROMPTS, **kw).tokens
    hybrid = jaxspec.HybridDrafter(jaxspec.HistoryDrafter(gamma=4, tree_nodes=8, min_n=2),
                                   jaxspec.ModelDrafter(tiny.draft_cfg, gamma=3))
    sampled = jaxspec.generate(tiny.params, PROMPTS, drafter=hybrid, drafter_params=(_history(tiny), tiny.draft_params),
                               temperature=1.0, seed=3, **kw)
    assert sampled.metrics.history_misses == 6 and len(sampled.history) == 6
    res = jaxspec.generate(tiny.params, PROMPTS, drafter=hybrid, drafter_params=(sampled.history, tiny.draft_params),
                           **kw)
    assert res.tokens == plain and res.metrics.history_misses == 0 and len(res.history) == 12
    tree = jaxspec.HybridDrafter(jaxspec.NGramDrafter(gamma=4, min_n=2),
                                 jaxspec.ModelDrafter(tiny.draft_cfg, gamma=3, tree_nodes=6, branching=2))
    assert jaxspec.generate(tiny.params, PROMPTS, drafter=tree, drafter_params=(None, tiny.draft_params),
                            **kw).tokens == plain
    early = jaxspec.HybridDrafter(jaxspec.NGramDrafter(gamma=4, min_n=2),
                                  jaxspec.EarlyExitDrafter(tiny.cfg, n_layers=1, gamma=2))
    assert jaxspec.generate(tiny.params, PROMPTS, drafter=early, drafter_params=(None, None), **kw).tokens == plain


def _context(tokens, seq_lens, vocab):
    b = tokens.shape[0]
    return Context(tokens, seq_lens, jax.vmap(jax.random.key)(jnp.arange(b)), SamplingParams.make(b),
                   History.from_prompt(tokens, seq_lens, vocab))


def test_hybrid_takes_first_where_it_proposes(tiny):
    """Row 0's text repeats a bigram, so prompt lookup proposes its continuation there; row 1's
    does not, and gets the draft model's chain, with its q. Before drafting, the draft model
    read the 5 positions its cache lacked (two forwards of gamma + 1 = 4 tokens), so its cache
    holds what reading the whole text at once gives. A step where every row matches runs no
    draft model: its cache and ``fed`` stay as they were."""
    lookup = jaxspec.NGramDrafter(gamma=3, max_n=2, min_n=2)
    model = jaxspec.ModelDrafter(tiny.draft_cfg, gamma=2, confidence=0.0)
    hybrid = jaxspec.HybridDrafter(lookup, model)
    tokens = jnp.array([[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 4, 9, 10, 0, 0]], jnp.int32)
    lens = jnp.array([6, 6], jnp.int32)
    prefill = Prefill(tokens[:, :1], jnp.array([1, 1], jnp.int32), (), jnp.zeros((2, 1, tiny.cfg.dim)))
    params = (None, tiny.draft_params)
    state = hybrid.init(params, prefill, 16)
    propose = jax.jit(hybrid.propose)
    after, proposal = propose(params, state, _context(tokens, lens, tiny.cfg.vocab_size))
    np.testing.assert_array_equal(proposal.tokens[0], [7, 8, 5])  # after "5 6": prompt lookup
    np.testing.assert_array_equal(proposal.valid[0], [True, True, True])
    np.testing.assert_array_equal(proposal.q[0], jax.nn.one_hot(jnp.array([7, 8, 5]), tiny.cfg.vocab_size))
    assert proposal.valid[1].tolist() == [True, True, False]  # the model's chain of 2, padded to 3
    assert proposal.tokens[1, 2] == 0 and proposal.parents[1, 2] == -1  # the pad: an invalid node
    assert np.allclose(proposal.q[1, :2].sum(-1), 1) and after.fed.tolist() == [6, 6]
    full = Prefill(tokens[:, :6], lens, (), jnp.zeros((2, 6, tiny.cfg.dim)))
    ref = model.init(tiny.draft_params, full, 16)
    for got, want in zip(after.fallback.cache.k, ref.cache.k):
        np.testing.assert_allclose(got[:, :6], want[:, :6], atol=1e-5)
    both = tokens.at[1].set(tokens[0])  # every row matches: no draft model
    again, proposal = propose(params, state, _context(both, lens, tiny.cfg.vocab_size))
    assert proposal.valid.all() and again.fed.tolist() == [1, 1]
    for got, before in zip(again.fallback.cache.k, state.fallback.cache.k):
        np.testing.assert_array_equal(got, before)


def test_hybrid_bad_input(tiny):
    """Refused, before any compile: a first drafter that never abstains, a fallback that is no
    draft model, params that are not a pair, a history beside a first drafter that reads none.
    (Under a mesh: tests/support/sharded_cases.py, ``2x4-hybrid-b4``.)"""
    model = jaxspec.ModelDrafter(tiny.draft_cfg, gamma=2)
    for first in (jaxspec.ModelDrafter(tiny.draft_cfg, gamma=2, confidence=0.0), jaxspec.LookaheadDrafter(),
                  jaxspec.GrammarDrafter()):  # never abstains; never abstains; proposes nothing itself
        with pytest.raises(ValueError, match="first drafter must propose where it finds a match, abstain"):
            jaxspec.HybridDrafter(first, model)
    with pytest.raises(ValueError, match="fallback must be a ModelDrafter or EarlyExitDrafter"):
        jaxspec.HybridDrafter(jaxspec.NGramDrafter(), jaxspec.NGramDrafter())
    hybrid = jaxspec.HybridDrafter(jaxspec.NGramDrafter(), model)
    kw = dict(config=tiny.cfg, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"must be the pair \(first's params, fallback's params\)"):
        jaxspec.generate(tiny.params, PROMPTS, drafter=hybrid, drafter_params=tiny.draft_params, **kw)
    with pytest.raises(ValueError, match=r"drafter_params\[1\] \(ModelDrafter's\): .*needs drafter_params"):
        jaxspec.generate(tiny.params, PROMPTS, drafter=hybrid, drafter_params=(None, None), **kw)
    with pytest.raises(ValueError, match="first part of a HybridDrafter's pair"):
        jaxspec.generate(tiny.params, PROMPTS, drafter=hybrid, drafter_params=(_history(tiny), tiny.draft_params),
                         **kw)
