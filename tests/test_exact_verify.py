"""Speculation exact to the bit on CPU (docs/cpu_kernel.md): greedy speculative decoding emits
plain decoding's tokens AND plain decoding's logprobs, bit for bit, for every drafter kind, in
float32 and bfloat16; and under sampled settings the processed distribution at every position
of a verify window (chain or tree path) is the one plain decoding computes for the same prefix.

Why it holds: a verify window keeps its keys and values apart from the cache
(``forward(write=False)``), and the CPU attention kernel takes a query's visible keys in
position order whichever part holds them; the weight products and RoPE are row-invariant
kernels too. With the kernels off (``JAXSPEC_CPU_KERNEL=0``: XLA's attention sums the cache part
and the window part apart) the float32 cases here fail (checked by hand: logprobs differ in the
last bits while the tokens agree)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.drafters import medusa
from jaxspec.kernels import cpu_matmul
from jaxspec.models import eagle3
from jaxspec.sampling import History, SamplingParams, processed_probs
from jaxspec.tree import Proposal, Tree
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

pytestmark = pytest.mark.skipif(not cpu_matmul.active(), reason=f"the CPU kernels are off: {cpu_matmul.describe()}")

DTYPES = ("float32", "bfloat16")
KINDS = ("ngram_chain", "ngram_tree", "model", "early_exit", "eagle_chain", "eagle_tree", "medusa", "lookahead")


def _cast(tree, dtype):
    """Floating leaves of ``tree`` in ``dtype`` (integer tables such as EAGLE's d2t kept)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _drafter(tiny, kind: str, dtype):
    """``(drafter, drafter_params)`` of ``kind`` for the tiny target, weights in ``dtype``."""
    if kind == "ngram_chain":
        return jaxspec.NGramDrafter(gamma=4, max_n=3, min_n=1), None
    if kind == "ngram_tree":
        return jaxspec.NGramDrafter(gamma=4, max_n=3, min_n=1, branches=2, branch_min_n=1), None
    if kind == "model":  # the target plus noise: accepts often, rejects sometimes
        return jaxspec.ModelDrafter(tiny.cfg, gamma=4, confidence=0.0), _cast(tiny.noisy_params, dtype)
    if kind == "early_exit":
        return jaxspec.EarlyExitDrafter(tiny.cfg, n_layers=1, gamma=3), None
    if kind.startswith("eagle"):
        cfg = eagle3.EagleConfig(tiny.cfg, draft_vocab=48)
        d2t = np.sort(np.random.default_rng(0).permutation(tiny.cfg.vocab_size)[:48])
        head = {"head": eagle3.init_params(cfg, jax.random.key(5), scale=2.0), "d2t": jnp.asarray(d2t, jnp.int32)}
        tree = dict(tree_nodes=6, branching=2) if kind == "eagle_tree" else {}
        return jaxspec.EagleDrafter(cfg, gamma=3, **tree), _cast(head, dtype)
    if kind == "medusa":
        return jaxspec.MedusaDrafter(tiny.cfg, topk=(2, 1)), _cast(medusa.init_heads(tiny.cfg, 2, jax.random.key(0)), dtype)
    if kind == "lookahead":
        return jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=3, pool_size=64), None
    raise ValueError(kind)


@pytest.fixture(scope="module")
def plain(tiny):
    """dtype -> (target params in that dtype, plain greedy result with logprobs)."""
    out = {}
    for dtype in DTYPES:
        params = _cast(tiny.params, dtype)
        out[dtype] = params, jaxspec.generate(params, tiny.prompts, config=tiny.cfg, max_new_tokens=tiny.max_new,
                                              ignore_eos=True, logprobs=2)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_logprobs_bitwise_equal_plain(tiny, plain, kind, dtype):
    """Every drafter kind, float32 and bfloat16 (weights, activations, cache): the tokens, each
    emitted token's logprob and its top-2 alternatives equal plain decoding's exactly (Python
    floats compared with ==: the float32 values themselves), and drafts were accepted, so
    tokens were scored inside verify windows, not only at a window's root."""
    params, want = plain[dtype]
    drafter, dparams = _drafter(tiny, kind, dtype)
    got = jaxspec.generate(params, tiny.prompts, config=tiny.cfg, drafter=drafter, drafter_params=dparams,
                           max_new_tokens=tiny.max_new, ignore_eos=True, logprobs=2)
    assert got.tokens == want.tokens
    for row, (a, b) in enumerate(zip(got.logprobs, want.logprobs)):
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert not bad, f"row {row}: logprobs differ at tokens {bad[:8]}: {[(a[i], b[i]) for i in bad[:3]]}"
    assert got.top_logprobs == want.top_logprobs
    if kind not in ("medusa", "eagle_chain", "eagle_tree", "lookahead"):  # random heads, a cold pool: may accept nothing
        assert int(np.sum(got.metrics.accepted)) > 0


# ------------------------------------------------------------------ sampled settings, per position

SETTINGS = {
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=1.3, top_p=0.7),
    "top_k_min_p": dict(temperature=0.9, top_k=5, min_p=0.05),
    "penalties": dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
}

# A draft tree over the 6 window entries after the root: parent of each node (-1: the root).
# Nodes 0, 2, 3 are a path (depths 1..3); 1, 4 and 5 are siblings off it.
TREE_PARENTS = [-1, -1, 0, 2, 2, 1]
TREE_PATH = [0, 2, 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", core(list(SETTINGS), ["top_p", "penalties"]))
def test_processed_distribution_bitwise_equal_plain(tiny, setting, dtype):
    """Under temperature, top-p, top-k with min-p, and penalties: the distribution the engine's
    verify step samples from at each entry of a draft tree's path (``processed_probs`` over the
    window's logits, the tree's path counts for penalties) equals, bit for bit, the one plain
    decoding computes at that prefix (a 1-token pass written into the cache, the history grown
    by the tokens before it)."""
    cfg, params = tiny.cfg, _cast(tiny.params, dtype)
    prompt, generated, root = tiny.prompts[2], [3, 9], 7  # the root: the last generated token
    context = jnp.asarray([prompt + generated], jnp.int32)  # in the cache; the root is not yet
    start = context.shape[1]  # the root's position
    sp = SamplingParams.make(1, **SETTINGS[setting])
    node_tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, len(TREE_PARENTS))), jnp.int32)
    proposal = Proposal(node_tokens, jnp.asarray([TREE_PARENTS], jnp.int32), jnp.ones((1, len(TREE_PARENTS)), bool))
    history = History.from_prompt(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]), cfg.vocab_size)
    history = history.add(jnp.asarray([generated + [root]], jnp.int32), jnp.ones((1, 3), bool))

    def fwd(tokens, positions, cache, mask, write):
        return models.forward(params, cfg, tokens, positions, cache, mask=mask, write=write)

    # tokens and positions are arguments, never constants of a program: XLA folds constants with
    # its own evaluator, whose arithmetic is not the compiled program's
    @jax.jit
    def window(context, root, proposal):
        cache = fwd(context, jnp.arange(start)[None], KVCache.zeros(cfg, 1, 64, params["embed"].dtype), None,
                    True).cache
        tree = Tree.of(root, proposal)
        positions = start + tree.depth
        mask = models.TreeMask(jnp.asarray([start], jnp.int32), tree.ancestors, positions)
        out = fwd(tree.tokens, positions, cache, mask, False)  # the engine's verify (engine._verify)
        return processed_probs(out.logits, sp, history, tree), cache

    @jax.jit
    def step(token, position, cache, history):  # plain decoding's step: written first, one entry
        out = fwd(token[:, None], position[:, None], cache, None, True)
        return processed_probs(out.logits, sp, history, Tree.of(token, Proposal.empty(1)))[:, 0], out.cache

    probs, cache = window(context, jnp.asarray([root], jnp.int32), proposal)
    path_tokens = [root] + [int(node_tokens[0, i]) for i in TREE_PATH]
    hist = history
    for depth, token in enumerate(path_tokens):
        if depth:  # plain decoding generated the path's tokens up to this one
            hist = hist.add(jnp.asarray([[token]], jnp.int32), jnp.ones((1, 1), bool))
        want, cache = step(jnp.asarray([token], jnp.int32), jnp.asarray([start + depth], jnp.int32), cache, hist)
        entry = 0 if depth == 0 else 1 + TREE_PATH[depth - 1]  # window index: the root, then node i at 1 + i
        got = np.asarray(probs[0, entry])
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want[0]).view(np.uint32),
                                      err_msg=f"{setting} {dtype}: path depth {depth}")
        assert np.count_nonzero(got) > 1  # a distribution, not a one-hot: the setting samples
