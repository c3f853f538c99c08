"""Lookahead decoding on device (issue 12): the window's mask is the paper's, the pool follows
its stated policy (a plain-Python reference), greedy output equals plain decoding, sampling
has exactly the target's distribution (and a wrong sibling rule is caught), the loop stays
one program, bad settings are refused before anything compiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.api
from jaxspec import acceptance, engine
from jaxspec.drafters.base import Committed, Prefill
from jaxspec.tree import Proposal, Tree
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

# ------------------------------------------------------------------ the window is Fig. 2(b)'s mask


def test_window_is_the_papers_2d_mask():
    """Level l, column i of the lookahead branch sits at depth i + 1 + l and sees exactly the
    root, level 0's columns 0..i and its own column's levels 0..l (Fu et al. 2024, Fig. 2(b):
    each level a row of W tokens one position further right, each column a trajectory); the
    candidate trie never sees the window, nor the window the trie."""
    d = jaxspec.LookaheadDrafter(window=3, ngram=4, guesses=2, pool_size=16)
    n_trie, w, levels = d.first_window_node, d.window, d.ngram - 1
    parents = np.concatenate([[-1, 0, 1, -1, 3, 4], d.window_parents()])  # two chains of 3, then the window
    proposal = Proposal(jnp.zeros((1, d.n_nodes), jnp.int32), jnp.asarray(parents[None]),
                        jnp.asarray(np.arange(d.n_nodes) < n_trie)[None])
    tree = jax.jit(Tree.of)(jnp.zeros((1,), jnp.int32), proposal)
    depth, seen = np.asarray(tree.depth[0]), np.asarray(tree.ancestors[0])

    def entry(lv, col):  # window index of (level, column)
        return 1 + n_trie + lv * w + col

    for lv in range(levels):
        for col in range(w):
            e = entry(lv, col)
            assert depth[e] == col + 1 + lv
            expected = {0} | {entry(0, c) for c in range(col + 1)} | {entry(k, col) for k in range(lv + 1)}
            assert set(np.flatnonzero(seen[e])) == expected, (lv, col)
    assert not seen[1 : 1 + n_trie, 1 + n_trie :].any() and not seen[1 + n_trie :, 1 : 1 + n_trie].any()
    assert d.n_nodes == (3 + 2) * (4 - 1) and d.gamma == 3


# ------------------------------------------------------------------ the pool: a plain-Python reference


class ReferenceLookahead:
    """The drafter's bookkeeping in plain Python, from the module docstring: levels as lists,
    the pool as {n-gram: last-seen stamp}, LRU over ``pool_size`` entries."""

    def __init__(self, d, prompt):
        self.d, self.pool, self.clock = d, {}, 0
        w, n, size = d.window, d.ngram, len(prompt)
        self.levels = [[prompt[(size - (w + n - 2) + i + lv) % size] for i in range(w)] for lv in range(n - 1)]
        self.see([tuple(prompt[e - n + 1 : e + 1]) if e >= n - 1 else None for e in range(size)])  # stamp e

    def see(self, items):
        """``items``: n-grams in order, None for the ones that do not count."""
        last = {g: self.clock + j for j, g in enumerate(items) if g is not None}
        new = []
        for g, stamp in last.items():
            if g in self.pool:
                self.pool[g] = stamp
            else:
                new.append((stamp, g))
        for stamp, g in sorted(new)[-self.d.pool_size :]:
            if len(self.pool) >= self.d.pool_size:
                del self.pool[min(self.pool, key=self.pool.get)]
            self.pool[g] = stamp
        self.clock += len(items)

    def candidates(self, root):
        mine = sorted((g for g in self.pool if g[0] == root), key=self.pool.get, reverse=True)
        return [g[1:] for g in mine[: self.d.guesses]]

    def commit(self, text, start, seq_len, argmax):
        n, w = self.d.ngram, self.d.window
        new = [argmax[1 + self.d.first_window_node + (n - 2) * w + i] for i in range(w)]
        columns = [tuple(self.levels[lv][i] for lv in range(n - 1)) + (new[i],) for i in range(w)]
        grams = [tuple(text[e - n + 1 : e + 1]) if n - 1 <= e < seq_len else None for e in range(start, start + n + 1)]
        self.see(grams + columns)
        self.levels = self.levels[1:] + [new]


def test_pool_and_window_equal_a_python_reference():
    """Two rows (prompts of 9 and 3 tokens over a 4-token vocabulary, so n-grams repeat and
    are refreshed) through ``init`` and 12 ``commit``s of random emitted tokens and random
    target argmaxes, with an 8-slot pool (so the LRU evicts): the pool ({n-gram: stamp}), the
    levels, the clock and every root's candidates equal the plain-Python reference's."""
    d = jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2, pool_size=8)
    rng = np.random.default_rng(0)
    prompts = [[0, 1, 2, 0, 1, 3, 0, 1, 2], [2, 3, 2]]
    b, s, width = 2, 64, d.n_nodes + 1
    padded = np.zeros((b, 12), np.int32)
    for r, p in enumerate(prompts):
        padded[r, : len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    state = jax.jit(d.init, static_argnums=(0, 2))(None, Prefill(jnp.asarray(padded), jnp.asarray(lens), (),
                                                                 jnp.zeros((b, 12, 1))), s)
    refs = [ReferenceLookahead(d, p) for p in prompts]
    text = [list(p) + [int(rng.integers(4))] for p in prompts]  # + the prefill's token
    seq_lens = lens + 1
    commit = jax.jit(d.commit, static_argnums=0)
    for _ in range(12):
        start = seq_lens - 1
        emitted = rng.integers(1, d.ngram + 1, b)  # 1 .. gamma + 1 tokens
        for r in range(b):
            text[r] += [int(t) for t in rng.integers(0, 4, emitted[r])]
        seq_lens = seq_lens + emitted
        argmax = rng.integers(0, 4, (b, width)).astype(np.int32)
        buf = np.zeros((b, s), np.int32)
        for r in range(b):
            buf[r, : len(text[r])] = text[r]
        committed = Committed(jnp.asarray(buf), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(emitted - 1),
                              jnp.zeros((b, width), jnp.int32), jnp.asarray(start, jnp.int32),
                              jnp.zeros((b, width, 1)), (), jnp.asarray(argmax))
        state = commit(None, state, committed)
        for r in range(b):
            refs[r].commit(text[r], int(start[r]), int(seq_lens[r]), argmax[r].tolist())
    pool, seen = np.asarray(state.pool), np.asarray(state.seen)
    for r, ref in enumerate(refs):
        ours = {tuple(int(t) for t in pool[r, k]): int(seen[r, k]) for k in range(d.pool_size) if seen[r, k] >= 0}
        assert ours == ref.pool
        assert len(ours) == d.pool_size  # full: the LRU evicted
        assert np.asarray(state.levels[r]).tolist() == ref.levels and int(state.clock[r]) == ref.clock
    candidates = jax.jit(d.candidates)
    for root in range(4):
        conts, found = candidates(state, jnp.full((b,), root, jnp.int32))
        for r, ref in enumerate(refs):
            ours = [tuple(c) for c, f in zip(np.asarray(conts[r]).tolist(), np.asarray(found[r])) if f]
            assert ours == ref.candidates(root), (r, root)


def test_last_copies_by_sort_equal_the_pairwise_definition():
    """The pool's dedupe (one sort, so a long prompt needs no [U, U] table) marks exactly the
    counted items whose n-gram is not counted again later: 20 random batches of 40 trigrams
    over 3 tokens (many repeats), 30% not counted."""
    from jaxspec.drafters.lookahead import _last_copies

    rng = np.random.default_rng(1)
    last_copies = jax.jit(_last_copies)
    for _ in range(20):
        items, ok = rng.integers(0, 3, (40, 3)).astype(np.int32), rng.random(40) < 0.7
        expected = [bool(ok[i]) and not any(ok[j] and (items[j] == items[i]).all() for j in range(i + 1, 40))
                    for i in range(40)]
        assert np.asarray(last_copies(jnp.asarray(items), jnp.asarray(ok))).tolist() == expected


# ------------------------------------------------------------------ greedy == plain

# (window, ngram, guesses): the smallest n-gram (2: one level, one-token candidates), a
# middle size, and a deeper window than candidates.
SHAPES = [(2, 2, 1), (3, 3, 2), (4, 4, 3)]
CASES = [(SHAPES[0], 3), (SHAPES[1], 1), (SHAPES[2], 1), (SHAPES[2], 3)]


@pytest.fixture(scope="module")
def tok():
    from test_trees import TOKENS

    from jaxspec.tokenizer import Tokenizer

    return Tokenizer(TOKENS, merges=[], name="tiny-bytes")


def _gen(tiny, prompts, drafter=None, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_new_tokens", tiny.max_new)
    return jaxspec.generate(tiny.params, prompts, config=tiny.cfg, drafter=drafter, **kw)


@pytest.mark.parametrize("shape,batch", core(CASES, CASES[:2]), ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else f"b{x}")
def test_greedy_lookahead_equals_plain(tiny, tok, shape, batch):
    """Invariant 1 (docs/design.md): greedy lookahead output == plain greedy output, token for token, plain,
    with penalties (counted along each candidate's own ancestors, never the window's) and
    with a stop string met on the accepted path; candidates are accepted (tau > 1)."""
    w, n, g = shape
    d = jaxspec.LookaheadDrafter(window=w, ngram=n, guesses=g, pool_size=32)
    prompts = tiny.prompts[:batch]
    plain = _gen(tiny, prompts, tokenizer=tok)
    spec = _gen(tiny, prompts, d, tokenizer=tok)
    assert spec.tokens == plain.tokens
    assert spec.metrics.accepted.sum() > 0 and spec.metrics.tau > 1.0, spec.metrics.tau
    assert int(spec.metrics.drafted.max()) <= spec.metrics.target_forwards.max() * g * (n - 1)
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
    penalised = _gen(tiny, prompts, tokenizer=tok, **penalties)
    assert penalised.tokens != plain.tokens
    assert _gen(tiny, prompts, d, tokenizer=tok, **penalties).tokens == penalised.tokens
    text = tok.decode(plain.tokens[0])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plain_stop = _gen(tiny, prompts, tokenizer=tok, stop=[stop])
    assert plain_stop.finish_reasons[0] == "stop"
    spec_stop = _gen(tiny, prompts, d, tokenizer=tok, stop=[stop])
    assert (spec_stop.tokens, spec_stop.texts) == (plain_stop.tokens, plain_stop.texts)


def test_lookahead_logprobs_min_new_tokens_and_stop_ids_equal_plain(tiny):
    """The other settings along the accepted path, as for every tree drafter: logprobs of the
    emitted tokens (and their top alternatives) equal plain decoding's, ``min_new_tokens``
    suppresses a stop id the same way, a stop id ends the row at the same token. Tolerance
    1e-5: a wide and a 1-token float32 pass differ by a few ulps in the logits."""
    d = jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2, pool_size=32)
    free = _gen(tiny, tiny.prompts)
    stop_id = free.tokens[0][3]  # row 0's 4th token: min_new_tokens 6 suppresses it there
    kw = dict(logprobs=2, stop_token_ids=[stop_id], min_new_tokens=6)
    plain, spec = _gen(tiny, tiny.prompts, **kw), _gen(tiny, tiny.prompts, d, **kw)
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    assert plain.tokens[0][3] != stop_id and spec.metrics.accepted.sum() > 0
    for a, b in zip(spec.logprobs, plain.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(spec.top_logprobs, plain.top_logprobs):
        assert [[i for i, _ in alts] for alts in a] == [[i for i, _ in alts] for alts in b]


def test_lookahead_is_one_program_without_host_calls(tiny, inputs_factory):
    """The pool, the window and the candidates live in the loop state: the generation lowers
    to one ``stablehlo.while`` with no host callback, send/recv, infeed or outfeed."""
    d = jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2, pool_size=32)
    inputs = inputs_factory(tiny.prompts, max_new_tokens=tiny.max_new)
    fn = jax.jit(functools.partial(engine.run_program, config=tiny.cfg, drafter=d, max_len=64))
    text = fn.lower(tiny.params, None, inputs).as_text()
    assert text.count("stablehlo.while") >= 1
    for marker in ("callback", "stablehlo.send", "stablehlo.recv", "infeed", "outfeed"):
        assert marker not in text, marker


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kw,message", [
    (dict(window=0), r"window must be an integer in \[1, 64\] \(W, lookahead window columns\), got 0"),
    (dict(ngram=1), r"ngram must be an integer in \[2, 16\] \(N, n-gram size"),
    (dict(guesses=0), r"guesses must be an integer in \[1, 64\] \(G, candidates verified per step\), got 0"),
    (dict(window=2.5), r"window must be an integer"),
    (dict(window=4, ngram=3, pool_size=7), r"pool_size must be an integer in \[8, 65536\] \(one step offers "
                                           r"window \+ ngram \+ 1 = 8 n-grams"),
])
def test_bad_settings_are_refused_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.LookaheadDrafter(**kw)


def test_window_larger_than_the_cache_is_refused_before_compile(tiny):
    """(4 + 4) x (4 - 1) = 24 nodes + the root do not fit max_len 20: the error names the
    budget, the limit and the settings, and nothing is compiled."""
    compiled = len(jaxspec.api._COMPILED)
    d = jaxspec.LookaheadDrafter(window=4, ngram=4, guesses=4, pool_size=32)
    with pytest.raises(ValueError, match=r"node budget \(24 nodes \+ the root\) does not fit max_len \(20\) with "
                                         r"LookaheadDrafter\(window=4, ngram=4, guesses=4.*window, ngram or guesses"):
        _gen(tiny, tiny.prompts[:1], d, max_new_tokens=2, max_len=20)
    assert len(jaxspec.api._COMPILED) == compiled


@pytest.mark.parametrize("flags,message", [
    (["--drafter", "lookahead", "--window", "0"], r"--window must be an integer in \[1, 64\]"),
    (["--drafter", "lookahead", "--ngram", "1"], r"--ngram must be an integer in \[2, 16\]"),
    (["--drafter", "lookahead", "--guesses", "65"], r"--guesses must be an integer in \[1, 64\]"),
    (["--drafter", "lookahead", "--pool-size", "3"], r"--pool-size must be an integer in \[10, 65536\]"),
    (["--drafter", "lookahead", "--gamma", "8"], r"--gamma applies to .*, not --drafter lookahead \(its depth is"),
    (["--drafter", "lookahead", "--tree-nodes", "8"], r"--tree-nodes applies to .*, not --drafter lookahead"),
    (["--drafter", "ngram", "--window", "3", "--guesses", "2"],
     r"--window, --guesses do not apply to --drafter ngram \(--window: --drafter lookahead; --guesses: --drafter "
     r"lookahead\)"),
])
def test_cli_refuses_bad_lookahead_flags_before_loading(flags, message, monkeypatch):
    """A bad value, or a flag that would be ignored, exits naming the flag, before any load."""
    from jaxspec import cli

    monkeypatch.setattr(jaxspec, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "hi", "--no-compile-cache", *flags])


def test_cli_builds_the_lookahead_drafter():
    from jaxspec import cli

    args = cli._parse(["generate", "hi", "--drafter", "lookahead", "--window", "3", "--ngram", "5",
                       "--guesses", "2", "--pool-size", "64"])
    drafter, params = cli._make_drafter(args, None, None)
    assert (drafter, params) == (jaxspec.LookaheadDrafter(window=3, ngram=5, guesses=2, pool_size=64), None)
    args = cli._parse(["generate", "hi", "--drafter", "lookahead"])
    assert cli._make_drafter(args, None, None) == (jaxspec.LookaheadDrafter(), None)  # the class's defaults


# ------------------------------------------------------------------ sampling: exactly the target's distribution


_PROGRAMS: dict = {}


@pytest.fixture(autouse=True, scope="module")
def drop_sampling_programs():
    """The 80,000-row programs are not kept past this module."""
    yield
    _PROGRAMS.clear()


def _lookahead_counts(inputs_factory, td, drafter, settings, seed, fresh=False, n=None):
    """Counts of ``n`` (default ``td.N``) sampled 3-token continuations (the harness of
    ``test_distribution``), and the fractions of rows that accepted a candidate and that were
    offered some but accepted none. ``fresh``: trace anew (a patched rule) instead of reusing
    the program compiled for ``drafter``."""
    params = td.decoder.init_params(td.TARGET, jax.random.key(td.TARGET_SEED), scale=1.0)
    inputs = inputs_factory([td.PROMPT] * (n or td.N), max_new_tokens=td.N_NEW, seed=seed, vocab_size=td.V, **settings)
    fn = None if fresh else _PROGRAMS.get(drafter)
    if fn is None:
        fn = jax.jit(functools.partial(engine.run_program, config=td.TARGET, drafter=drafter, max_len=td.MAX_LEN))
        if not fresh:
            _PROGRAMS[drafter] = fn
    state = jax.device_get(fn(params, None, inputs))
    lp = len(td.PROMPT)
    np.testing.assert_array_equal(state.seq_lens, lp + td.N_NEW)
    x = state.tokens[:, lp : lp + td.N_NEW].astype(np.int64)
    counts = np.bincount((x[:, 0] * td.V + x[:, 1]) * td.V + x[:, 2], minlength=td.V**td.N_NEW)
    accepted = float((state.n_accepted > 0).mean())
    rejected = float(((state.n_drafted > 0) & (state.n_accepted == 0)).mean())
    return counts, accepted, rejected


# window 1, 3-grams, 2 guesses: 6 nodes + the root fit the harness's 16-slot cache.
SAMPLING = dict(window=1, ngram=3, guesses=2, pool_size=8)


@pytest.mark.parametrize("name", ["T=1", "penalties"])
def test_lookahead_sampling_matches_target(inputs_factory, name):
    """Invariant 2 with the multi-candidate rule (Fu et al. 2024, Sec. 3.3: accept candidate
    c with probability r(c), else remove c from r and renormalise): 80,000 sampled
    continuations pass the chi-square test against the enumerated target distribution
    (detectable TV <= 0.025 at 95% power, level 1e-3: ``test_distribution``'s harness)."""
    import test_distribution as td

    seed = td.SEED_STRIDE * (60 + ["T=1", "penalties"].index(name))
    d = jaxspec.LookaheadDrafter(**SAMPLING)
    counts, accepted, rejected = _lookahead_counts(inputs_factory, td, d, td.SETTINGS[name], seed)
    print(f"rows accepting a candidate {accepted:.3f}, rows rejecting one {rejected:.3f}")
    assert accepted > 0.05 and rejected > 0.05, (accepted, rejected)
    p_value, info = td._check(counts, td._exact_probs(td.SETTINGS[name]), f"lookahead {name}")
    assert p_value > td.ALPHA, info


def test_lookahead_wrong_sibling_rule_is_detected(inputs_factory, monkeypatch):
    """The same test (on ``td.N_DETECT`` rows) rejects lookahead sampling whose rejected
    candidate stays in the residual (``lade`` without its ``probs_next[draft_guess] = 0``):
    the candidate can then be emitted again, at probability r(c) (2 - r(c)) instead of r(c)."""
    import test_distribution as td

    monkeypatch.setattr(acceptance, "accept", td._wrong_tree_accept("sibling_kept"))
    d = jaxspec.LookaheadDrafter(**SAMPLING)
    counts, _, _ = _lookahead_counts(inputs_factory, td, d, td.SETTINGS["T=1"], td.SEED_STRIDE * 62,
                                  fresh=True, n=td.N_DETECT)
    p_value, info = td._check(counts, td._exact_probs(td.SETTINGS["T=1"]), "lookahead, rejected sibling kept",
                              max_tv=None)
    assert p_value < td.ALPHA, f"the harness did not detect a wrong sibling rule: {info}"
