"""Draft trees (issue 9): chains through the tree code give the pinned tokens of the chain
engine; greedy trees equal plain decoding for every drafter; per-row and per-call topologies
reuse the compiled program; the model interface's tree mask equals running each path alone."""

from __future__ import annotations

import json
import os

import pytest
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

PINNED = json.load(open(os.path.join(os.path.dirname(__file__), "data", "pinned_chains.json")))


# CI: every pinned kind and gamma but the two whose (drafter, gamma) no other case shares, each
# its own compile (ngram g4 with a repetition penalty, model_noisy g3 with a presence penalty and
# min_new_tokens: ~20 s each); penalties and min_new_tokens are in CI in test_distribution and
# test_sampling_settings.
PINNED_CI = [c for c in PINNED if (c["kind"], c["gamma"]) not in {("ngram", 4), ("model_noisy", 3)}]


@pytest.mark.parametrize("case", core(PINNED, PINNED_CI),
                         ids=lambda c: f"{c['kind']}-g{c['gamma']}-{'-'.join(c['settings']) or 'greedy'}")
def test_chains_give_the_pinned_tokens(tiny, case):
    """The tokens (and drafted/accepted counts) of the chain engine before trees (commit
    b0ce9ac, ``tests/support/pin_chains.py``) for the same keys: a chain is the special case.

    The pinned accepted counts are verification's (drafts accepted, emitted or not); since
    issue 10 part 7 the metric counts only emitted drafts, so a row may report fewer: at most
    the drafts of its last window, which max_new_tokens or a stop cut (all other windows
    emit every accepted draft)."""
    out = tiny.generate(tiny.prompts, case["kind"], case["gamma"], **case["settings"])
    assert out.tokens == case["tokens"]
    assert out.metrics.drafted.tolist() == case["drafted"]
    cut = np.asarray(case["accepted"]) - out.metrics.accepted
    assert np.all((cut >= 0) & (cut <= case["gamma"])), (out.metrics.accepted, case["accepted"])


# ------------------------------------------------------------------ greedy trees == plain decoding

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec  # noqa: E402
import jaxspec.api  # noqa: E402
from jaxspec.drafters.base import Capabilities  # noqa: E402
from jaxspec.drafters.model import DraftState  # noqa: E402
from jaxspec.tokenizer import Tokenizer  # noqa: E402
from jaxspec.tree import Proposal, Tree  # noqa: E402

# Topologies of 6 nodes (parents) and the node on the "spine" at depths 1.. (-1: none): the
# spine carries the target's own greedy continuation, every other node a wrong token.
TOPOLOGIES = {
    "unbalanced": ([-1, -1, 1, 1, 3, 0], [1, 3, 4, -1, -1, -1]),
    "wide": ([-1, -1, -1, -1, -1, -1], [4, -1, -1, -1, -1, -1]),
    "chain": ([-1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]),
    "two_deep": ([-1, 0, -1, 2, 3, 2], [2, 5, -1, -1, -1, -1]),
}


@dataclasses.dataclass(frozen=True)
class ShapedDrafter:
    """A test drafter whose tree topology is DATA (``drafter_params``): per row, parents [N]
    and a spine [N] of node ids per depth. Spine nodes hold the greedy drafts of an inner
    chain ``ModelDrafter`` run on the target's own weights (so under greedy the spine is
    accepted as deep as it goes); other nodes hold wrong tokens."""

    config: jaxspec.ModelConfig
    n_nodes: int = 6
    capabilities = Capabilities()
    kind = "shaped"

    def localized(self, model_shards):
        raise ValueError("a test drafter: never split")

    @property
    def gamma(self) -> int:
        return self.n_nodes

    @property
    def inner(self):
        return jaxspec.ModelDrafter(self.config, gamma=self.n_nodes, confidence=0.0)

    def select_params(self, target_params, drafter_params):
        return {"model": target_params, **drafter_params}

    def validate(self, target_config, drafter_params):
        return None

    def init(self, params, prefill, max_len):
        return self.inner.init(params["model"], prefill, max_len)

    def propose(self, params, state, context):
        state, chain = self.inner.propose(params["model"], state, context)
        b = context.tokens.shape[0]  # generate may pad the batch (buckets): extra rows reuse row 0's tree
        rows = jnp.minimum(jnp.arange(b), params["parents"].shape[0] - 1)
        parents, spine = params["parents"][rows], params["spine"][rows]
        n = parents.shape[1]
        depth = Tree.of(jnp.zeros((b,), jnp.int32), Proposal(jnp.zeros((b, n), jnp.int32), parents,
                                                             jnp.ones((b, n), bool))).depth[:, 1:]
        node = jnp.arange(n)[None]
        at_depth = jnp.take_along_axis(chain.tokens, depth - 1, axis=1)
        on_spine = jnp.take_along_axis(spine, depth - 1, axis=1) == node
        tokens = jnp.where(on_spine, at_depth, (at_depth + 1 + node) % self.config.vocab_size)
        slots = jnp.where(on_spine & (depth < n), depth, -1).astype(jnp.int32)
        return DraftState(state.cache, slots), Proposal(tokens, parents, jnp.ones((b, n), bool), None)

    def commit(self, params, state, committed):
        return self.inner.commit(params["model"], state, committed)


def shaped_params(names):
    parents = np.array([TOPOLOGIES[n][0] for n in names], np.int32)
    spine = np.array([TOPOLOGIES[n][1] for n in names], np.int32)
    return {"parents": jnp.asarray(parents), "spine": jnp.asarray(spine)}


ROW_TOPOLOGIES = ["unbalanced", "wide", "chain"]  # batch 3: a different tree per row
TREE_DRAFTERS = ["ngram_tree", "ngram_adaptive", "model_tree", "self_tree", "early_exit_tree", "shaped"]
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
TOKENS = (list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", ",", ".", "Ċ"] + list("0123456789")
          + ["ab", "ba", "an", "na", "Ġa", "Ġb", "ing", "Ġthe", "er", "re", "on", "no", "at", "ta", "Ġc", "es",
             "se", "ed", "de", "or", "ro", "en", "ne", "it"])


def tree_drafter(tiny, kind: str, batch: int):
    """``(drafter, drafter_params)`` in tree mode."""
    cfg = tiny.cfg
    if kind == "ngram_tree":
        return jaxspec.NGramDrafter(gamma=3, branches=3, min_n=1, branch_min_n=1), None
    if kind == "ngram_adaptive":  # the tiny target loops: matches extending over 3 tokens are common
        return jaxspec.NGramDrafter(gamma=5, branches=2, min_n=1, short_gamma=2, long_match=3, branch_min_n=1), None
    if kind == "model_tree":
        return jaxspec.ModelDrafter(cfg, gamma=3, tree_nodes=8, branching=3), tiny.noisy_params
    if kind == "self_tree":
        return jaxspec.ModelDrafter(cfg, gamma=4, tree_nodes=7, branching=2), tiny.params
    if kind == "early_exit_tree":
        return jaxspec.EarlyExitDrafter(cfg, n_layers=1, gamma=3, tree_nodes=6, branching=2), None
    if kind == "shaped":
        return ShapedDrafter(cfg), shaped_params(ROW_TOPOLOGIES[:batch] if batch > 1 else ["unbalanced"])
    raise ValueError(kind)


def gen(tiny, prompts, drafter=None, dparams=None, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("max_new_tokens", tiny.max_new)
    return jaxspec.generate(tiny.params, prompts, config=tiny.cfg, drafter=drafter, drafter_params=dparams, **kw)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOKENS, merges=[], name="tiny-bytes")


# Batch 3 runs every kind (its row 0 is batch 1's prompt, with other rows beside it); batch 1
# runs the kinds whose batch-1 case is not a row of batch 3: ``shaped`` gives batch 1 its own
# topology ("unbalanced"), and the n-gram trie is the CLI's default tree.
CASES = [(kind, 3) for kind in TREE_DRAFTERS] + [("shaped", 1), ("ngram_tree", 1)]


@pytest.mark.parametrize("kind,batch", core(CASES, [("model_tree", 3), ("self_tree", 3), ("shaped", 3), ("ngram_tree", 1)]))
def test_greedy_tree_equals_plain(tiny, tok, kind, batch):
    """Invariant 1 for trees: greedy output == plain greedy output for every drafter in tree
    mode (a different topology per row for ``shaped``), plain, with penalties (counted along
    each node's own ancestors) and with a stop string that completes on the accepted path."""
    prompts = tiny.prompts[:batch]
    drafter, dparams = tree_drafter(tiny, kind, batch)
    plain = gen(tiny, prompts)
    spec = gen(tiny, prompts, drafter, dparams)
    assert spec.tokens == plain.tokens
    assert spec.metrics.accepted.sum() > 0, "no draft accepted: the test would not exercise the tree path"
    if kind in ("self_tree", "shaped"):
        assert spec.metrics.tau > 2.0, spec.metrics.tau  # the target's own drafts go deep
    penalised = gen(tiny, prompts, **PENALTIES)
    assert penalised.tokens != plain.tokens
    assert gen(tiny, prompts, drafter, dparams, **PENALTIES).tokens == penalised.tokens
    text = tok.decode(plain.tokens[0])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plain_stop = gen(tiny, prompts, tokenizer=tok, stop=[stop])
    assert plain_stop.finish_reasons[0] == "stop"
    spec_stop = gen(tiny, prompts, drafter, dparams, tokenizer=tok, stop=[stop])
    assert (spec_stop.tokens, spec_stop.texts) == (plain_stop.tokens, plain_stop.texts)


def test_new_topology_per_call_and_row_reuses_the_program(tiny):
    """Topologies are data: permuting the rows' trees, or giving every row the same one,
    compiles nothing new and still equals plain decoding."""
    drafter = ShapedDrafter(tiny.cfg)
    plain = gen(tiny, tiny.prompts).tokens
    assert gen(tiny, tiny.prompts, drafter, shaped_params(ROW_TOPOLOGIES)).tokens == plain
    compiled = len(jaxspec.api._COMPILED)
    for names in (["chain", "unbalanced", "wide"], ["two_deep"] * 3, ["wide", "two_deep", "chain"]):
        assert gen(tiny, tiny.prompts, drafter, shaped_params(names)).tokens == plain
    assert len(jaxspec.api._COMPILED) == compiled


@pytest.mark.parametrize("make,message", [
    (lambda cfg: jaxspec.NGramDrafter(gamma=2, branches=0), r"branches must be an integer in \[1, 16\], got 0"),
    (lambda cfg: jaxspec.NGramDrafter(gamma=2, branches=17), r"branches must be an integer in \[1, 16\], got 17"),
    (lambda cfg: jaxspec.NGramDrafter(gamma=4, short_gamma=4),
     r"short_gamma must be an integer in \[1, 3\] \(below gamma; 0: off\), got 4"),
    (lambda cfg: jaxspec.NGramDrafter(gamma=4, short_gamma=2, long_match=1),
     r"long_match must be an integer in \[2, 256\], got 1"),
    (lambda cfg: jaxspec.NGramDrafter(gamma=4, branches=2, max_n=3, branch_min_n=4),
     r"branch_min_n must be an integer in \[2, 3\] \(the n-gram sizes matched\), got 4"),
    (lambda cfg: jaxspec.ModelDrafter(cfg, gamma=2, tree_nodes=7, branching=2),
     r"tree_nodes must be an integer in \[1, 6\] \(0 = chain; a tree of depth gamma=2 with branching=2 grows 6"),
    (lambda cfg: jaxspec.ModelDrafter(cfg, gamma=2, tree_nodes=-1), r"tree_nodes must be an integer in \[1, "),
    (lambda cfg: jaxspec.EarlyExitDrafter(cfg, 1, gamma=3, tree_nodes=4, branching=0),
     r"branching must be an integer in \[1, 64\], got 0"),
])
def test_bad_tree_settings_are_refused_at_construction(tiny, make, message):
    with pytest.raises(ValueError, match=message):
        make(tiny.cfg)


def test_ngram_adaptive_tree_drafts_the_copying_match_alone():
    """With adaptive depth a tree drafts every match's branch cut to ``short_gamma`` (the trie
    ``merge_branches`` gives) unless the best match is copying; then the best match alone,
    as one chain of ``gamma``. The node budget is ``max(gamma, branches x short_gamma)``."""
    from jaxspec.drafters import ngram

    # "1 2 3 4 9 7 3 4 8 | 1 2 3 4": "2 3 4" matched at slot 1 (continues at 4, extends over
    # 4 tokens), "3 4" at slot 6 (continues at 8)
    row = jnp.array([1, 2, 3, 4, 9, 7, 3, 4, 8, 1, 2, 3, 4, 0, 0, 0], jnp.int32)
    n = jnp.int32(13)
    starts, sizes = ngram.match_starts(row, n, 2, 3, 2)
    np.testing.assert_array_equal(np.asarray(starts), [4, 8])
    np.testing.assert_array_equal(np.asarray(sizes), [3, 2])
    assert int(ngram.match_extent(row, n, jnp.int32(4), 16)) == 4
    assert int(ngram.match_extent(row, n, jnp.int32(4), 3)) == 3

    def ctx():
        return None

    ctx.tokens, ctx.seq_lens = row[None], n[None]
    for long_match in (4, 5):
        d = jaxspec.NGramDrafter(gamma=6, short_gamma=2, branches=2, long_match=long_match, branch_min_n=2)
        assert d.n_nodes == 6 and d.capabilities.verify_widths == (2, 4, 6)
        _, prop = d.propose(None, None, ctx)
        tokens, parents, valid = (np.asarray(x[0]) for x in (prop.tokens, prop.parents, prop.valid))
        if long_match == 4:  # copying: one chain of 6
            np.testing.assert_array_equal(tokens, [9, 7, 3, 4, 8, 1])
            np.testing.assert_array_equal(parents, [-1, 0, 1, 2, 3, 4])
            assert valid.all()
        else:  # two branches of 2, then invalid slots
            want = ngram.merge_branches(jnp.array([[9, 7], [8, 1]], jnp.int32), jnp.array([True, True]))
            for got, w in zip((tokens, parents, valid), want):
                np.testing.assert_array_equal(got[:4], np.asarray(w))
            assert not valid[4:].any()
    # by default (branch_min_n = max_n = 3) the 2-gram match drafts no branch: the best one alone
    _, prop = jaxspec.NGramDrafter(gamma=6, short_gamma=2, branches=2, long_match=5).propose(None, None, ctx)
    np.testing.assert_array_equal(np.asarray(prop.valid[0]), [True, True, False, False, False, False])
    np.testing.assert_array_equal(np.asarray(prop.tokens[0])[:2], [9, 7])
    for long_match, depth in ((4, 6), (5, 2)):  # a chain (branches=1): the depth alone adapts
        d = jaxspec.NGramDrafter(gamma=6, short_gamma=2, long_match=long_match)
        assert d.n_nodes == 6 and d.capabilities.verify_widths == (2, 6)
        _, prop = d.propose(None, None, ctx)
        assert np.asarray(prop.valid[0]).sum() == depth
        np.testing.assert_array_equal(np.asarray(prop.tokens[0])[:depth], [9, 7, 3, 4, 8, 1][:depth])
    assert jaxspec.NGramDrafter(gamma=16, short_gamma=4, branches=2).n_nodes == 16
    assert jaxspec.NGramDrafter(gamma=4, short_gamma=3, branches=2).n_nodes == 6


def test_tree_larger_than_max_len_is_refused_before_compile(tiny):
    compiled = len(jaxspec.api._COMPILED)
    drafter = jaxspec.NGramDrafter(gamma=4, branches=4)  # 16 nodes + root
    with pytest.raises(ValueError, match=r"node budget \(16 nodes \+ the root\) does not fit max_len \(12\)"):
        gen(tiny, tiny.prompts[:1], drafter, max_new_tokens=2, max_len=12)
    assert len(jaxspec.api._COMPILED) == compiled


def test_drafters_receive_the_targets_hidden_states(tiny):
    """The protocol is real: a drafter that asks for layers gets, at ``init``, the target's
    outputs of those layers over the prompt, and at ``commit`` the target's final hidden
    states along the accepted path; both equal an uncached forward over the final text."""
    import functools

    from conftest import make_inputs
    from jaxspec import engine, models
    from jaxspec.cache import KVCache

    @dataclasses.dataclass(frozen=True)
    class Spy(jaxspec.NGramDrafter):
        """Keeps a [B, S, D] record: layer 1's output over the prompt (from init), then the
        final hidden state of every committed position (from commit)."""

        capabilities = Capabilities(capture=(1,))

        def init(self, params, prefill, max_len):
            record = jnp.zeros((prefill.prompt.shape[0], max_len, tiny.cfg.dim))
            return record.at[:, : prefill.prompt.shape[1]].set(prefill.captured[0])

        def commit(self, params, state, committed):
            w = committed.path.shape[1]
            rows = jnp.arange(state.shape[0])[:, None]
            slots = committed.start[:, None] + jnp.arange(w)[None]
            keep = jnp.arange(w)[None] <= committed.n_accepted[:, None]
            return state.at[rows, jnp.where(keep, slots, state.shape[1])].set(committed.hidden, mode="drop")

    inputs = make_inputs(tiny.prompts[:1], max_new_tokens=12)
    state = jax.jit(functools.partial(engine.run_program, config=tiny.cfg, drafter=Spy(gamma=3, min_n=1),
                                      max_len=64))(tiny.params, None, inputs)
    n, p = int(state.seq_lens[0]), len(tiny.prompts[0])
    assert int(state.n_accepted[0]) > 0, "no draft accepted: paths of length 1 only"
    full = models.forward(tiny.params, tiny.cfg, state.tokens[:, :n], jnp.arange(n)[None],
                          KVCache.zeros(tiny.cfg, 1, n, jnp.float32), capture=(1,))
    record = np.asarray(state.drafter_state[0])
    # float32 on CPU: a T-token and a 1-token pass differ by a few ulps (sum order); 2e-5 bounds
    # it at these magnitudes (|h| < 10), far below the differences between positions (~1).
    np.testing.assert_allclose(record[:p], np.asarray(full.captured[0][0, :p]), atol=2e-5)
    np.testing.assert_allclose(record[p : n - 1], np.asarray(full.hidden[0, p : n - 1]), atol=2e-5)


@pytest.mark.parametrize("kind", ["ngram_tree", "model_tree", "shaped"])
def test_tree_logprobs_min_new_tokens_and_stop_ids_equal_plain(tiny, kind):
    """Along the accepted path: logprobs of the emitted tokens (and their top alternatives)
    equal plain decoding's, ``min_new_tokens`` suppresses a stop id the same way, and a stop
    id ends the row at the same token. Tolerance 1e-5: a T-token and a 1-token float32 pass
    differ by a few ulps in the logits (docs/design.md, invariant 4); these logprobs are O(1)."""
    drafter, dparams = tree_drafter(tiny, kind, 3)
    plain_free = gen(tiny, tiny.prompts)
    stop_id = plain_free.tokens[0][3]  # the 4th token of row 0: min_new_tokens 6 suppresses it there
    kw = dict(logprobs=2, stop_token_ids=[stop_id], min_new_tokens=6)
    plain = gen(tiny, tiny.prompts, **kw)
    spec = gen(tiny, tiny.prompts, drafter, dparams, **kw)
    assert spec.tokens == plain.tokens and spec.finish_reasons == plain.finish_reasons
    assert len(plain.tokens[0]) >= 6 and plain.tokens[0][:3] == plain_free.tokens[0][:3]
    assert plain.tokens[0][3] != stop_id  # suppressed before min_new_tokens
    for a, b in zip(spec.logprobs, plain.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(spec.top_logprobs, plain.top_logprobs):
        assert [[i for i, _ in alts] for alts in a] == [[i for i, _ in alts] for alts in b]


@pytest.mark.parametrize("write", [True, False])
@pytest.mark.parametrize("family", ["tiny", "sliding"])
def test_tree_forward_equals_each_path_run_alone(tiny, family, write):
    """Invariant 4's tree twin: one forward over a tree (ancestor mask, positions committed +
    depth, after 7 committed tokens) gives every node the logits of an uncached forward over
    the committed text plus that node's own path; and once the path is kept the cache serves
    the next token exactly as if only that path had been written. ``write``: the tree written
    into the cache, then ``keep_path``; or (the engine's verify) the cache only read and the
    path's own keys and values written with ``KVCache.write``. ``sliding``: a 3-token sliding
    window on every layer, which tree positions must respect."""
    from jaxspec import models
    from jaxspec.cache import KVCache

    forward = jax.jit(models.forward, static_argnums=1, static_argnames="write")  # eager op dispatch: 40 s more

    cfg = tiny.cfg if family == "tiny" else dataclasses.replace(tiny.cfg, sliding_window=3, name="tiny-sliding")
    params = tiny.params
    rng = np.random.default_rng(0)
    committed = rng.integers(0, cfg.vocab_size, (1, 7)).astype(np.int32)
    parents = np.array([-1, -1, 0, 0, 2, 1], np.int32)
    nodes = rng.integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
    cache = forward(params, cfg, jnp.asarray(committed[:, :6]), jnp.arange(6)[None],
                           KVCache.zeros(cfg, 1, 32, jnp.float32)).cache
    tree = Tree.of(jnp.asarray(committed[:, 6]), Proposal(jnp.asarray(nodes), jnp.asarray(parents[None]),
                                                          jnp.ones((1, 6), bool)))
    start = jnp.full((1,), 6, jnp.int32)
    positions = start[:, None] + tree.depth
    out = forward(params, cfg, tree.tokens, positions, cache, write_at=start,
                         mask=models.TreeMask(start, tree.ancestors, positions), write=write)

    def path_to(i):  # window entries root .. node i
        path = [i + 1]
        while parents[path[-1] - 1] >= 0:
            path.append(parents[path[-1] - 1] + 1)
        return [0] + path[::-1]

    window = np.concatenate([committed[:, 6:], nodes], axis=1)[0]
    for i in range(6):
        seq = np.concatenate([committed[0], window[path_to(i)[1:]]])[None]
        full = forward(params, cfg, jnp.asarray(seq), jnp.arange(seq.shape[1])[None],
                              KVCache.zeros(cfg, 1, seq.shape[1], jnp.float32)).logits
        np.testing.assert_allclose(np.asarray(out.logits[0, i + 1]), np.asarray(full[0, -1]), atol=2e-5)
    # keep node 4's path (root, 0, 2, 4): the next token at position 10 sees exactly that text
    path = jnp.asarray([path_to(4) + [5, 5, 5]], jnp.int32)[:, :7]
    if write:
        kept = out.cache.keep_path(start, path)
    else:
        assert out.cache.k[0].shape[1] == 7  # the window's own entries; the cache was not written
        kept = cache.write(jax.tree.map(lambda x: jnp.take_along_axis(x, path[:, :, None, None], axis=1), out.cache),
                           start)
    nxt = jnp.asarray([[5]], jnp.int32)
    step = forward(params, cfg, nxt, jnp.full((1, 1), 10), kept).logits
    seq = np.concatenate([committed[0], window[path_to(4)[1:]], [5]])[None]
    full = forward(params, cfg, jnp.asarray(seq), jnp.arange(11)[None],
                          KVCache.zeros(cfg, 1, 11, jnp.float32)).logits
    np.testing.assert_allclose(np.asarray(step[0, 0]), np.asarray(full[0, -1]), atol=2e-5)


def test_forward_without_writing_needs_a_tree_mask_over_the_new_tokens(tiny):
    from jaxspec import models
    from jaxspec.cache import KVCache

    cache = KVCache.zeros(tiny.cfg, 1, 16, jnp.float32)
    tokens, positions = jnp.zeros((1, 2), jnp.int32), jnp.arange(2)[None]
    with pytest.raises(ValueError, match=r"forward\(write=False\) needs a TreeMask over the new tokens"):
        models.forward(tiny.params, tiny.cfg, tokens, positions, cache, write=False)


def test_bfloat16_greedy_spec_equals_plain(tiny):
    """In bfloat16 a verify window's tokens get the logits plain decoding gives them: the
    verify attends to the cache and to the window's own keys apart (``forward(write=False)``)
    and must round the two parts' sum once, as one product over both would (rounding each
    part made rows 0 and 2 of seed 0 differ from plain at tokens 19 and 35; 10 of 60 rows over
    seeds 0-19). Exact equality is what the write-then-read forward gave on these seeds."""
    from jaxspec import models

    for seed in range(3):
        params = models.init_params(tiny.cfg, jax.random.key(seed), scale=0.5, dtype=jnp.bfloat16)
        kw = dict(config=tiny.cfg, ignore_eos=True, max_new_tokens=40)
        plain = jaxspec.generate(params, tiny.prompts, **kw).tokens
        spec = jaxspec.generate(params, tiny.prompts, drafter=jaxspec.NGramDrafter(gamma=4, min_n=1), **kw).tokens
        assert spec == plain, seed
