"""``jaxspec.acceptance.accept`` on exact small arrays: chains (Leviathan et al. 2023, Alg. 1)
through ``accept_chain`` (drafts ``[B, gamma]``, -1 = no draft), and trees (SpecInfer, Miao et
al. 2024, Sec. 4.2; EAGLE-2's rule for distinct deterministic siblings).

Frequencies are checked against exact probabilities with a 5-sigma binomial bound: for n
independent rows and probability pr the count's standard deviation is sqrt(n pr (1 - pr)),
and a correct rule leaves it more than 5 sigma away with probability < 6e-7 per check
(the seeds are fixed, so the tests are deterministic; the bound says how lucky a seed
would have to be for a wrong rule to pass, or a right rule to fail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import acceptance
from jaxspec.tree import Proposal, Tree


@jax.jit
def accept(keys, p, q, drafts):
    """Chain verification: ``(n_accepted [B], tokens [B, gamma + 1])``."""
    proposal = Proposal.chain(jnp.maximum(drafts, 0), valid=drafts >= 0, q=q)
    out = acceptance.accept(keys, p, q, Tree.of(jnp.zeros(drafts.shape[:1], jnp.int32), proposal))
    return out.n_accepted, out.tokens


@jax.jit
def accept_tree(keys, p, q, tokens, parents, valid):
    """Tree verification of nodes ``[B, N]``: ``Accepted``."""
    proposal = Proposal(tokens, parents, valid, q)
    return acceptance.accept(keys, p, q, Tree.of(jnp.zeros(tokens.shape[:1], jnp.int32), proposal))


def _keys(b: int, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), b)


def _one_hot(ids, v: int) -> jax.Array:
    return jax.nn.one_hot(jnp.asarray(ids, jnp.int32), v, dtype=jnp.float32)


def _within_5_sigma(count: int, n: int, pr: float) -> bool:
    return abs(count - n * pr) <= 5 * np.sqrt(n * pr * (1 - pr)) + 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_accepts_up_to_first_mismatch(seed):
    """One-hot p and q: n_accepted is the first index where the draft differs from the
    target's argmax (a later match does not count), the emitted tokens are the accepted
    drafts then the target's argmax at that index; all matched: bonus = argmax of p[gamma].
    Independent of the keys."""
    v = 10
    target = np.array([[3, 1, 4, 1, 5], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2], [9, 9, 9, 9, 6], [0, 0, 0, 0, 0]])
    drafts = np.array([[7, 1, 4, 1], [3, 1, 0, 1], [2, 7, 1, 8], [9, 9, 9, 0], [0, 0, 0, 0]])
    n, tokens = accept(_keys(5, seed), _one_hot(target, v), _one_hot(drafts, v), jnp.asarray(drafts, jnp.int32))
    n, tokens = np.asarray(n), np.asarray(tokens)
    np.testing.assert_array_equal(n, [0, 2, 4, 3, 4])
    expected = [[3], [3, 1, 4], [2, 7, 1, 8, 2], [9, 9, 9, 9], [0, 0, 0, 0, 0]]
    for b, want in enumerate(expected):
        assert tokens[b, : n[b] + 1].tolist() == want, b


def test_all_accepted_draws_bonus_from_last_distribution():
    """Drafts the target is sure of are all accepted; the bonus token follows p[gamma]
    (support {2, 5} with probabilities 0.3 / 0.7)."""
    v, gamma, b = 8, 3, 4000
    drafts = np.tile([4, 4, 1], (b, 1))
    p = np.zeros((b, gamma + 1, v), np.float32)
    p[:, :gamma] = np.asarray(_one_hot(drafts, v))
    p[:, gamma, 2], p[:, gamma, 5] = 0.3, 0.7
    n, tokens = accept(_keys(b), jnp.asarray(p), None, jnp.asarray(drafts, jnp.int32))
    n, tokens = np.asarray(n), np.asarray(tokens)
    np.testing.assert_array_equal(n, gamma)
    np.testing.assert_array_equal(tokens[:, :gamma], drafts)
    bonus = tokens[:, gamma]
    assert set(np.unique(bonus)) == {2, 5}
    assert _within_5_sigma(int((bonus == 5).sum()), b, 0.7), (bonus == 5).mean()


def test_gamma_zero_is_a_sample_from_p0():
    """Plain decoding is gamma = 0: no draft, the one emitted token is drawn from p[0]
    (one-hot rows: exactly the hot index; a spread row: its frequencies)."""
    v, b = 5, 4000
    p0 = np.tile(np.array([0.1, 0.0, 0.2, 0.3, 0.4], np.float32), (b, 1))
    p0[:3] = np.asarray(_one_hot([4, 0, 3], v))
    for q in (jnp.zeros((b, 0, v), jnp.float32), None):
        n, tokens = accept(_keys(b, 3), jnp.asarray(p0[:, None]), q, jnp.zeros((b, 0), jnp.int32))
        n, tokens = np.asarray(n), np.asarray(tokens)
        assert tokens.shape == (b, 1)
        np.testing.assert_array_equal(n, 0)
        assert tokens[:3, 0].tolist() == [4, 0, 3]
        rest = tokens[3:, 0]
        assert not (rest == 1).any(), "a zero-probability token was drawn"
        for tok, pr in [(0, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]:
            assert _within_5_sigma(int((rest == tok).sum()), b - 3, pr), (tok, (rest == tok).mean())


def test_deterministic_drafter_q_none_equals_one_hot_q():
    """``q=None`` (n-gram drafts) is exactly the rule with q one-hot on the drafts: same
    keys, same accepted counts and tokens, bit for bit, on spread (non-greedy) p."""
    b, gamma, v = 256, 3, 8
    p = jax.nn.softmax(2 * jax.random.normal(jax.random.key(7), (b, gamma + 1, v)), axis=-1)
    drafts = jax.random.randint(jax.random.key(8), (b, gamma), 0, v)
    n0, t0 = accept(_keys(b), p, None, drafts)
    n1, t1 = accept(_keys(b), p, _one_hot(drafts, v), drafts)
    np.testing.assert_array_equal(np.asarray(n0), np.asarray(n1))
    np.testing.assert_array_equal(np.asarray(t0), np.asarray(t1))
    # not vacuous: some rows accept a draft and some reject the first one
    assert 0 < int((np.asarray(n0) > 0).sum()) < b


def test_accept_probability_and_residual_exact_example():
    """One draft d = 1 with p = [.5, .3, .2, 0], q = [.2, .6, .2, 0]: accepted with
    probability min(1, .3/.6) = 1/2, then the bonus from p[1] (one-hot 3); rejected, the
    replacement is from norm(max(0, p - q)) = one-hot 0. Draft d = 0 (p/q = 2.5) is always
    accepted."""
    b, v = 4000, 4
    p = np.zeros((b, 2, v), np.float32)
    p[:, 0] = [0.5, 0.3, 0.2, 0.0]
    p[:, 1, 3] = 1.0
    q = np.zeros((b, 1, v), np.float32)
    q[:, 0] = [0.2, 0.6, 0.2, 0.0]
    n, tokens = accept(_keys(b), jnp.asarray(p), jnp.asarray(q), jnp.ones((b, 1), jnp.int32))
    n, tokens = np.asarray(n), np.asarray(tokens)
    acc = n == 1
    assert _within_5_sigma(int(acc.sum()), b, 0.5), acc.mean()
    np.testing.assert_array_equal(tokens[acc], np.tile([1, 3], (int(acc.sum()), 1)))
    np.testing.assert_array_equal(tokens[~acc, 0], 0)
    n, tokens = accept(_keys(b), jnp.asarray(p), jnp.asarray(q), jnp.zeros((b, 1), jnp.int32))
    np.testing.assert_array_equal(np.asarray(n), 1)
    np.testing.assert_array_equal(np.asarray(tokens), np.tile([0, 3], (b, 1)))


@pytest.mark.parametrize("gamma", [1, 2])
def test_drafts_from_q_emit_exactly_p(gamma):
    """The theorem the rule exists for: with d_i ~ q_i, each emitted token follows p. Here
    with the same (p, q) at every position, the first emitted token's frequencies match p
    and so do the second's among rows that emitted >= 2 tokens (p and q far apart: TV 0.4)."""
    b, v = 20000, 4
    p_row = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    q_row = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    rng = np.random.default_rng(gamma)
    drafts = rng.choice(v, size=(b, gamma), p=q_row).astype(np.int32)
    p = jnp.asarray(np.broadcast_to(p_row, (b, gamma + 1, v)))
    q = jnp.asarray(np.broadcast_to(q_row, (b, gamma, v)))
    n, tokens = accept(_keys(b, 11), p, q, jnp.asarray(drafts))
    n, tokens = np.asarray(n), np.asarray(tokens)
    assert 0.3 < (n > 0).mean() < 0.9, "acceptance is degenerate: the test would not exercise both paths"
    for pos in range(2):
        rows = n >= pos  # rows whose emitted tokens reach index pos
        for tok in range(v):
            count = int((tokens[rows, pos] == tok).sum())
            assert _within_5_sigma(count, int(rows.sum()), float(p_row[tok])), (pos, tok, count / rows.sum())


def test_rows_depend_only_on_their_own_key():
    """Permuting the rows (data and keys together) permutes the results."""
    b, gamma, v = 64, 3, 8
    p = jax.nn.softmax(jax.random.normal(jax.random.key(1), (b, gamma + 1, v)), axis=-1)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(2), (b, gamma, v)), axis=-1)
    drafts = jax.random.randint(jax.random.key(3), (b, gamma), 0, v)
    keys = _keys(b, 5)
    perm = np.random.default_rng(0).permutation(b)
    n, tokens = accept(keys, p, q, drafts)
    n2, tokens2 = accept(keys[perm], p[perm], q[perm], drafts[perm])
    np.testing.assert_array_equal(np.asarray(n)[perm], np.asarray(n2))
    np.testing.assert_array_equal(np.asarray(tokens)[perm], np.asarray(tokens2))


def test_abstained_drafts_are_forced_rejections_replaced_from_p():
    """A draft of -1 ("nothing to propose", n-gram lookup without a match) is rejected, and
    its replacement is drawn from p itself (q is ignored there: residual max(0, p - 0)).
    Row 0 abstains at once; row 1 has one real, certain draft, then abstains; with or
    without q."""
    b, gamma, v = 4000, 2, 4
    p_row = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    p = np.broadcast_to(p_row, (b, gamma + 1, v)).copy()
    p[1::2, 0] = np.asarray(_one_hot([2], v))  # row type 1: draft 2 is certain at position 0
    drafts = np.full((b, gamma), -1, np.int32)
    drafts[1::2, 0] = 2
    q_spread = jnp.asarray(np.broadcast_to(np.float32([0.7, 0.1, 0.1, 0.1]), (b, gamma, v)))
    for q in (None, q_spread):
        n, tokens = accept(_keys(b, 4), jnp.asarray(p), q, jnp.asarray(drafts))
        n, tokens = np.asarray(n), np.asarray(tokens)
        np.testing.assert_array_equal(n[0::2], 0)
        np.testing.assert_array_equal(n[1::2], 1)
        np.testing.assert_array_equal(tokens[1::2, 0], 2)
        replaced = np.concatenate([tokens[0::2, 0], tokens[1::2, 1]])
        for tok in range(v):
            assert _within_5_sigma(int((replaced == tok).sum()), b, float(p_row[tok])), (tok, (replaced == tok).mean())


def test_tiny_temperature_is_a_valid_distribution():
    """T = 1e-10 under jit: dividing raw logits by T overflowed to inf - inf = NaN (found by
    review); subtracting the max first gives the greedy one-hot, exactly."""
    from jaxspec.sampling import SamplingParams, processed_probs

    logits = jnp.array([[1.0, 3.0, 2.0], [-50.0, 40.0, 39.9]])
    probs = jax.jit(processed_probs)(logits, SamplingParams.make(2, temperature=[1e-10, 1e-30]))
    np.testing.assert_array_equal(np.asarray(probs), [[0, 1, 0], [0, 1, 0]])


def _siblings(b, tokens):
    """``(tokens, parents, valid)`` for one level of siblings under the root."""
    n = len(tokens)
    return (jnp.asarray(np.broadcast_to(np.int32(tokens), (b, n))), jnp.full((b, n), -1, jnp.int32),
            jnp.ones((b, n), bool))


def test_distinct_deterministic_siblings_emit_exactly_p():
    """EAGLE-2's rule: siblings 0 then 1 (no q): accept 0 with p(0) = 0.5; else 1 with
    p(1) / (1 - p(0)) = 0.6; else draw from p without {0, 1}. Each outcome's exact
    probability: emitted 0 w.p. 0.5, 1 w.p. 0.3, 2 w.p. 0.2 (path node 1, 2 or none)."""
    b, v = 20000, 3
    p = jnp.asarray(np.broadcast_to(np.float32([0.5, 0.3, 0.2]), (b, 3, v)))
    out = accept_tree(_keys(b, 7), p, None, *_siblings(b, [0, 1]))
    first = np.where(np.asarray(out.n_accepted) > 0, np.asarray(out.tokens)[:, 0], np.asarray(out.tokens)[:, 0])
    for tok, pr in enumerate([0.5, 0.3, 0.2]):
        assert _within_5_sigma(int((first == tok).sum()), b, pr), (tok, (first == tok).mean())
    path = np.asarray(out.path)[:, 1]
    np.testing.assert_array_equal(path[first == 0], 1)  # sibling 0 is window entry 1
    np.testing.assert_array_equal(path[first == 1], 2)
    np.testing.assert_array_equal(np.asarray(out.n_accepted)[first == 2], 0)


def test_greedy_tree_takes_the_argmax_branch_and_goes_deep():
    """Greedy: the path follows the argmax at each level, whichever sibling holds it.
    Nodes: 0 and 1 under the root (tokens 3, 1), 2 under 0 (token 2), 3 under 1 (token 0);
    the argmax is 1 at the root and 0 after it, then 2: accepted path 1 -> 3, bonus 2."""
    v = 4
    tokens = jnp.asarray([[3, 1, 2, 0]], jnp.int32)
    parents = jnp.asarray([[-1, -1, 0, 1]], jnp.int32)
    argmax = [1, 0, 0, 0, 2]  # per window entry: root, nodes 0..3
    p = _one_hot([argmax], v)
    out = accept_tree(_keys(1), p, None, tokens, parents, jnp.ones((1, 4), bool))
    assert int(out.n_accepted[0]) == 2
    np.testing.assert_array_equal(np.asarray(out.tokens)[0, :3], [1, 0, 2])
    np.testing.assert_array_equal(np.asarray(out.path)[0, :3], [0, 2, 4])


def test_siblings_sampled_from_q_emit_exactly_p():
    """SpecInfer's multi-candidate rule: 3 siblings drawn i.i.d. from q, each with its q; after
    each rejection the residual is norm(max(0, r - q)). The emitted token follows p. A wrong
    rule that keeps r = p after a rejection (the rejected candidate not removed) must fail."""
    b, v = 30000, 4
    p_row = np.float32([0.1, 0.2, 0.3, 0.4])
    q_row = np.float32([0.4, 0.3, 0.2, 0.1])
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.choice(v, size=(b, 3), p=q_row).astype(np.int32))
    p = jnp.asarray(np.broadcast_to(p_row, (b, 4, v)))
    q = jnp.asarray(np.broadcast_to(q_row, (b, 3, v)))
    out = accept_tree(_keys(b, 9), p, q, tokens, jnp.full((b, 3), -1, jnp.int32), jnp.ones((b, 3), bool))
    first = np.asarray(out.tokens)[:, 0]
    for tok in range(v):
        assert _within_5_sigma(int((first == tok).sum()), b, float(p_row[tok])), (tok, (first == tok).mean())
    # The wrong rule: each sibling tested against p itself (no residual update).
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (3,)))(jax.vmap(lambda k: jax.random.fold_in(k, 0))(_keys(b, 9))))
    t = np.asarray(tokens)
    ok = u * q_row[t] < p_row[t]
    wrong = np.where(ok[:, 0], t[:, 0], np.where(ok[:, 1], t[:, 1], np.where(ok[:, 2], t[:, 2], -1)))
    fallback = rng.choice(v, size=b, p=p_row)
    wrong = np.where(wrong >= 0, wrong, fallback)
    assert not all(_within_5_sigma(int((wrong == tok).sum()), b, float(p_row[tok])) for tok in range(v))


def test_invalid_nodes_and_their_subtrees_are_never_accepted():
    """Node 0 is invalid: even where its token and its child's token are the argmax, the
    path never enters it; node 2 (valid, under the root) is taken instead."""
    v = 4
    tokens = jnp.asarray([[1, 2, 3]], jnp.int32)
    parents = jnp.asarray([[-1, 0, -1]], jnp.int32)
    valid = jnp.asarray([[False, True, True]])
    p = _one_hot([[1, 2, 0, 0]], v)  # root's argmax 1 (node 0's token), node 0's argmax 2
    out = accept_tree(_keys(1), p, None, tokens, parents, valid)
    assert int(out.n_accepted[0]) == 0
    assert int(out.tokens[0, 0]) == 1  # the replacement is the argmax itself
