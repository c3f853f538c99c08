"""Rollouts for RL post-training: the policy's weights change every step, the program stays.

A training loop samples with ``generate``, takes a gradient step and samples again with the
new params. Params are an input of the compiled program, never a static, so new values of the
same shapes and dtypes reuse it (``Metrics.compiled`` says when a call compiled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.drafters.history import find_siblings, frequency_tree

PROMPT = [5, 6, 7, 8, 5, 6]
GROUP = 4  # samples per prompt
NEW = 12


def _nll(params, cfg, tokens):
    """Mean next-token negative log-likelihood of ``tokens [B, T]`` (teacher forcing)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t - 1), (b, t - 1))
    out = models.forward(params, cfg, tokens[:, :-1], positions, KVCache.zeros(cfg, b, t - 1, jnp.float32))
    logp = jax.nn.log_softmax(out.logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def test_ten_optax_updates_compile_once(tiny):
    """Ten rollouts, each after an Adam step on the last rollout's likelihood: the first call
    may compile, the nine others must not (``_COMPILED`` does not grow; the step's greedy
    speculative and plain calls neither); the weights do move
    (the greedy rollout changes), and speculative greedy output stays the new target's own."""
    params, opt = tiny.params, optax.adam(3e-2)
    opt_state = opt.init(params)
    drafter = jaxspec.NGramDrafter(gamma=3, max_n=3, min_n=1)
    compiled, greedy = [], []
    for step in range(10):
        kw = dict(config=tiny.cfg, max_new_tokens=NEW, ignore_eos=True)
        res = jaxspec.generate(params, [PROMPT], drafter=drafter, n=GROUP, temperature=1.0, seed=step, **kw)
        spec = jaxspec.generate(params, [PROMPT], drafter=drafter, **kw)
        plain = jaxspec.generate(params, [PROMPT], **kw)
        compiled.append((any(r.metrics.compiled for r in (res, spec, plain)), len(jaxspec.api._COMPILED)))
        spec, plain = spec.tokens, plain.tokens
        assert spec == plain, step  # exactness holds for whatever weights the call is given
        greedy.append(plain[0])
        batch = jnp.asarray([PROMPT + t for t in res.tokens])
        grads = jax.grad(_nll)(params, tiny.cfg, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert not any(c for c, _ in compiled[1:]), compiled
    assert len({n for _, n in compiled}) == 1, compiled  # the program count never moved after step 0
    assert len({tuple(g) for g in greedy}) > 1  # the updates changed what the policy generates


def test_new_dtype_compiles_and_says_so(tiny):
    """Params of another dtype are another program: the call compiles and its metrics say so."""
    kw = dict(config=tiny.cfg, max_new_tokens=NEW, ignore_eos=True)
    jaxspec.generate(tiny.params, [PROMPT], **kw)
    again = jaxspec.generate(jax.tree_util.tree_map(lambda x: x * 1.0, tiny.params), [PROMPT], **kw)
    assert not again.metrics.compiled and again.metrics.summary()["compiled"] is False
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny.params)
    res = jaxspec.generate(half, [PROMPT], **kw)
    assert res.metrics.compiled and res.metrics.compile_s > 0
    assert np.isfinite(res.metrics.host_s) and res.metrics.host_s >= 0


# ---------------------------------------------------------------------------- the rollout-history drafter

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11], [5, 6, 7, 8, 5, 6]]  # rows 0 and 2 share their prompt


def test_find_siblings_groups_equal_prompts():
    """Rows with equal prompts (and lengths) are siblings, the lowest rows first; a prompt that
    is a prefix of another's, or padded alike but shorter, is not."""
    prompt = jnp.array([[1, 2, 0], [3, 0, 0], [1, 2, 0], [1, 2, 0], [3, 0, 0], [1, 2, 3], [1, 2, 0]])
    lens = jnp.array([2, 1, 2, 2, 1, 3, 3])  # row 6: "1 2 0", three tokens
    np.testing.assert_array_equal(find_siblings(prompt, lens, 2),
                                  [[2, 3], [4, -1], [0, 3], [0, 2], [1, -1], [-1, -1], [-1, -1]])
    assert find_siblings(prompt[:1], lens[:1], 4).shape == (1, 0)


def test_frequency_tree_ranks_shared_prefixes():
    """Nodes are prefixes ranked by how many continuations share them, ties to the shallower;
    parents come first; a token past a continuation's end is no node."""
    conts = jnp.array([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]])
    ok = jnp.array([[True] * 3, [True] * 3, [True] * 3, [True, False, False]])
    tokens, parents, valid = map(np.asarray, frequency_tree(conts, ok, 8))
    # "1" x3, "1 2" x2, then count 1 by depth: "7", "1 5", "1 2 3", "1 2 4", "1 5 6"; "7 8" is past the end
    np.testing.assert_array_equal(tokens[:7], [1, 2, 7, 5, 3, 4, 6])
    np.testing.assert_array_equal(parents[:7], [-1, 0, -1, 0, 1, 1, 3])
    np.testing.assert_array_equal(valid, [True] * 7 + [False])


def _history(tiny, capacity=8):
    return jaxspec.RolloutHistory(vocab_size=tiny.cfg.vocab_size, capacity=capacity, max_tokens=64)


def test_history_drafter_greedy_is_plain(tiny):
    """Greedy speculative output with siblings, with and without earlier rollouts, equals plain
    decoding's token for token; the history's drafts are accepted more."""
    kw = dict(config=tiny.cfg, max_new_tokens=24, ignore_eos=True, n=2)
    plain = jaxspec.generate(tiny.params, PROMPTS, **kw).tokens
    drafter = jaxspec.HistoryDrafter(gamma=4, tree_nodes=8, min_n=1)
    own = jaxspec.generate(tiny.params, PROMPTS, drafter=drafter, **kw)
    assert own.tokens == plain and own.history is None and own.metrics.history_misses is None
    sampled = jaxspec.generate(tiny.params, PROMPTS, drafter=drafter, drafter_params=_history(tiny),
                               temperature=1.0, seed=3, **kw)
    assert sampled.metrics.history_misses == 6  # no prompt had a rollout yet
    again = jaxspec.generate(tiny.params, PROMPTS, drafter=drafter, drafter_params=sampled.history, **kw)
    assert again.tokens == plain and again.metrics.history_misses == 0
    learned = jaxspec.generate(tiny.params, PROMPTS, drafter=drafter, drafter_params=again.history, **kw)
    assert learned.tokens == plain and not learned.metrics.compiled  # new history values: same program
    off = jaxspec.generate(tiny.params, PROMPTS, drafter=drafter, drafter_params=learned.history,
                           disable_by_batch_size=1, **kw)
    assert off.metrics.speculation is not None and off.metrics.history_misses == 0  # the policy decoded plainly
    assert len(off.history) == 16 and off.history.rollouts(PROMPTS[1])[0] == off.tokens[3]  # it took the rollouts
    assert learned.metrics.tau > own.metrics.tau  # its own greedy rollouts are in the history now


def test_history_keeps_the_newest_per_prompt(tiny):
    """``add`` keeps ``capacity`` rollouts per prompt, newest first, each after its prompt's tail."""
    h = _history(tiny, capacity=3)
    h = h.add([[1, 2], [1, 2], [3]], [[10], [11], [12]])
    h = h.add([[1, 2], [1, 2]], [[13], [14]])
    assert h.rollouts([1, 2]) == [[14], [13], [11]] and h.rollouts([3]) == [[12]] and len(h) == 4
    rows = h.rows([[1, 2], [4], [3]], batch=4)
    assert h.misses([[1, 2], [4], [3]]) == 1 and rows.tokens.shape == (4, 3, 64)
    np.testing.assert_array_equal(rows.lens[:, 0], [3, 0, 2, 0])  # prompt tail + 1 output token
    np.testing.assert_array_equal(rows.tokens[0, 0, :3], [1, 2, 14])
    assert rows.starts[0, 0] == 2


def test_history_bad_input(tiny):
    """Errors before compile: a history of another vocabulary, a history with another drafter,
    more rollouts of one prompt than the capacity, capacities out of range."""
    kw = dict(config=tiny.cfg, max_new_tokens=4)
    other = jaxspec.RolloutHistory(vocab_size=100)
    with pytest.raises(ValueError, match="vocabulary of 100 tokens"):
        jaxspec.generate(tiny.params, PROMPTS, drafter=jaxspec.HistoryDrafter(), drafter_params=other, **kw)
    with pytest.raises(ValueError, match="drafter_params of a jaxspec.HistoryDrafter"):
        jaxspec.generate(tiny.params, PROMPTS, drafter=jaxspec.NGramDrafter(), drafter_params=_history(tiny), **kw)
    with pytest.raises(ValueError, match="capacity=2 per prompt"):
        _history(tiny, capacity=2).add([[1]] * 3, [[2]] * 3)
    with pytest.raises(ValueError, match="samples 3 rollouts of one prompt but the history keeps capacity=2"):
        jaxspec.generate(tiny.params, [PROMPTS[0]], n=3, drafter=jaxspec.HistoryDrafter(),
                         drafter_params=_history(tiny, capacity=2), **kw)
    with pytest.raises(ValueError, match="capacity must be an integer in"):
        jaxspec.RolloutHistory(vocab_size=64, capacity=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _history(tiny).add([[1]], [[64]])
    with pytest.raises(ValueError, match="tree_nodes must be an integer in"):
        jaxspec.HistoryDrafter(gamma=6, tree_nodes=4)


def test_grpo_example_runs(monkeypatch, capsys):
    """examples/grpo_rollouts.py on a tiny random model for 2 steps: the weights change every
    step (a reward the random model earns unevenly: the answer's length in characters), no call after the first of
    each method compiles, and the last line is the summary JSON."""
    from examples import grpo_rollouts

    monkeypatch.setattr(grpo_rollouts, "reward", lambda text, answer: float(len(text)))
    out = grpo_rollouts.main(["--model", "random-tiny", "--steps", "2", "--problems", "2", "--group", "4",
                              "--max-new-tokens", "12", "--lr", "1e-2"])
    assert out["steps"] == 2 and out["recompiles"] == 0
    assert all(n > 0 for n in out["update_norm"]), out["update_norm"]
    assert len(out["reward_plain"]) == len(out["reward_spec"]) == 2 and out["tau_last_epoch"] >= 1.0
    import json

    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
