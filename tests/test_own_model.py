"""A model of the user's own as the target (``jaxspec.models.target``): a tiny flax.nnx decoder
(``tests/support/nnx_tiny.py``) through ``jaxspec.models.nnx.NnxTarget``.

- Plain decoding in jaxspec's loop gives the module's own greedy tokens (its full-sequence
  forward, outside the engine).
- Greedy speculation gives plain decoding's tokens and logprobs bit for bit, with every
  drafter that needs only tokens: n-gram chain and tree, lookahead, a draft model's chain and
  tree (the module uses jaxspec's row-invariant ``linear`` and ``attention``).
- Speculative sampling passes tests/test_distribution.py's chi-square test against the exact
  distribution enumerated from the module's own logits.
- Bad input is refused before anything compiles, naming what is missing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

import jaxspec  # noqa: E402
import jaxspec.api  # noqa: E402
from jaxspec import engine, models  # noqa: E402
from jaxspec.models import eagle3  # noqa: E402
from jaxspec.models.nnx import NnxTarget  # noqa: E402
from jaxspec.models.target import MaskedTarget  # noqa: E402
from support.nnx_tiny import TinyNnxDecoder  # noqa: E402

import test_distribution as dist  # noqa: E402  (the chi-square harness and its constants)

V = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7]]
NEW = 24
DRAFT = jaxspec.ModelConfig(vocab_size=V, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
                            max_position=256, name="own-draft")


@pytest.fixture(scope="module")
def own():
    module = TinyNnxDecoder(vocab=V, scale=2.0)
    target, params = NnxTarget.split(module, name="tiny-nnx", vocab_size=V, max_position=256)
    return module, target, params


@pytest.fixture(scope="module")
def plain(own):
    _, target, params = own
    return jaxspec.generate(params, PROMPTS, config=target, max_new_tokens=NEW, logprobs=2)


def test_plain_decoding_is_the_modules_own_greedy(own, plain):
    """jaxspec's loop over the protocol (prefill, then 1-token passes into the cache) gives
    the tokens of the module's own uncached forward over the whole sequence, step by step."""
    module = own[0]
    full = jax.jit(lambda t: module.full_logits(t))
    for prompt, got in zip(PROMPTS, plain.tokens):
        seq = list(prompt)
        for _ in range(NEW):
            seq.append(int(jnp.argmax(full(jnp.asarray([seq], jnp.int32))[0, -1])))
        assert got == seq[len(prompt):]


DRAFTERS = {
    "ngram": lambda: jaxspec.NGramDrafter(gamma=4),
    "ngram_tree": lambda: jaxspec.NGramDrafter(gamma=3, branches=3),
    "lookahead": lambda: jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=3),
    "model": lambda: jaxspec.ModelDrafter(DRAFT, gamma=3),
    "model_tree": lambda: jaxspec.ModelDrafter(DRAFT, gamma=3, tree_nodes=6, branching=2),
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_speculation_is_plain_decoding(own, plain, kind):
    """Tokens, logprobs and top-2 alternatives identical (==) to plain decoding. The n-gram
    and lookahead drafters had drafts accepted (the cache's path writes did work); the random
    draft model's drafts are verified and all rejected here (its acceptances are exercised by
    the sampling test below, at V = 8)."""
    _, target, params = own
    drafter = DRAFTERS[kind]()
    dparams = models.init_params(DRAFT, jax.random.key(1), scale=2.0) if kind.startswith("model") else None
    out = jaxspec.generate(params, PROMPTS, config=target, drafter=drafter, drafter_params=dparams,
                           max_new_tokens=NEW, logprobs=2, disable_by_acceptance=None)
    assert out.tokens == plain.tokens
    assert out.logprobs == plain.logprobs and out.top_logprobs == plain.top_logprobs
    assert out.metrics.drafted.sum() > 0 and (kind.startswith("model") or out.metrics.accepted.sum() > 0)


def test_a_batch_wide_write_index_runs_row_by_row(own, plain):
    """A module that writes every row at ``write_at[0]`` (one cache index for the batch, like
    the gemma library's ``end_index``): with ``row_offsets=False`` the adapter runs it row by
    row and speculation gives the per-row module's plain tokens and logprobs; taken as
    per-row (the default), its rows of different lengths overwrite each other's cache and the
    tokens differ, so the flag is what makes it right."""
    _, _, params = own
    shared = TinyNnxDecoder(vocab=V, scale=2.0, shared_offset=True)
    for row_offsets in (False, True):
        target, _ = NnxTarget.split(shared, name="shared", vocab_size=V, max_position=256, row_offsets=row_offsets)
        out = jaxspec.generate(params, PROMPTS, config=target, drafter=jaxspec.NGramDrafter(gamma=3, branches=3),
                               max_new_tokens=NEW, logprobs=2, disable_by_acceptance=None)
        if row_offsets:
            assert out.tokens != plain.tokens
        else:
            assert out.tokens == plain.tokens and out.logprobs == plain.logprobs


# ---------------------------------------------------------------------------- sampling: exact distribution

DIST_V = 8


@pytest.fixture(scope="module")
def dist_own():
    module = TinyNnxDecoder(vocab=DIST_V, dim=16, seed=3, scale=1.0)
    target, params = NnxTarget.split(module, name="dist-nnx", vocab_size=DIST_V, max_position=64)
    prefixes = np.array([[a, b] for a in range(DIST_V) for b in range(DIST_V)], np.int32)
    tokens = np.concatenate([np.tile(dist.PROMPT, (len(prefixes), 1)), prefixes], axis=1)
    logits = np.asarray(jax.jit(module.full_logits)(jnp.asarray(tokens)), np.float64)
    return target, params, logits


SAMPLING_CASES = [("ngram", 4, "T=1"), ("ngram_tree", 2, "penalties"), ("model", 2, "top_p=0.8"),
                  ("model_tree", 2, "T=0.7")]


@pytest.mark.parametrize("kind,gamma,name", SAMPLING_CASES)
def test_speculative_sampling_matches_the_own_model(dist_own, inputs_factory, kind, gamma, name):
    """N rows of 3 sampled tokens pass the chi-square test (tests/test_distribution.py's
    ``_check``: p > ALPHA, detectable TV <= 0.025) against the distribution enumerated from
    the module's own logits; drafts were accepted and rejected in a fair share of rows."""
    target, params, logits = dist_own
    drafter = {"ngram": jaxspec.NGramDrafter(gamma=gamma, max_n=2, min_n=1),
               "ngram_tree": jaxspec.NGramDrafter(gamma=gamma, max_n=2, min_n=1, branches=3, branch_min_n=1),
               "model": jaxspec.ModelDrafter(dist.DRAFT, gamma=gamma, confidence=0.0),
               "model_tree": jaxspec.ModelDrafter(dist.DRAFT, gamma=gamma, tree_nodes=5, branching=2)}[kind]
    dparams = models.init_params(dist.DRAFT, jax.random.key(dist.DRAFT_SEED), scale=1.0) if kind[:5] == "model" \
        else None
    settings = dist.SETTINGS[name]
    seed = dist.SEED_STRIDE * (SAMPLING_CASES.index((kind, gamma, name)) + 70)
    inputs = inputs_factory([dist.PROMPT] * dist.N, max_new_tokens=dist.N_NEW, seed=seed, vocab_size=DIST_V,
                            **settings)
    program = jax.jit(functools.partial(engine.run_program, config=target, drafter=drafter, max_len=dist.MAX_LEN))
    state = jax.device_get(program(params, dparams, inputs))
    lp = len(dist.PROMPT)
    np.testing.assert_array_equal(state.seq_lens, lp + dist.N_NEW)
    x = state.tokens[:, lp: lp + dist.N_NEW].astype(np.int64)
    counts = np.bincount((x[:, 0] * DIST_V + x[:, 1]) * DIST_V + x[:, 2], minlength=DIST_V ** dist.N_NEW)
    accepted_some = float((state.n_accepted > 0).mean())
    rejected_some = float((state.n_accepted < state.n_steps * gamma).mean())
    assert accepted_some > 0.05 and rejected_some > 0.02, (accepted_some, rejected_some)
    p_value, info = dist._check(counts, dist._exact_probs(settings, logits), f"nnx {kind} gamma {gamma} {name}")
    assert p_value > dist.ALPHA, info


# ---------------------------------------------------------------------------- bad input, refused before compiling


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args):
        raise AssertionError("compiled a program for a call that should have been refused")

    monkeypatch.setattr(jaxspec.api, "_run", refuse)


def test_drafters_that_read_the_decoder_are_refused(own, no_compile):
    _, target, params = own
    with pytest.raises(ValueError, match="EarlyExitDrafter reads the target's first layers.*NGramDrafter"):
        jaxspec.EarlyExitDrafter(target, n_layers=1)
    tiny = jaxspec.ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64,
                               max_position=256, name="decoder")
    head = jaxspec.EagleDrafter(eagle3.EagleConfig(tiny, draft_vocab=V), gamma=2)
    with pytest.raises(ValueError, match="EagleDrafter reads the target's layer outputs"):
        jaxspec.generate(params, PROMPTS[0], config=target, drafter=head, drafter_params={}, max_new_tokens=4)
    with pytest.raises(ValueError, match="an EAGLE-3 head reads the target's layer outputs"):
        eagle3.EagleConfig(target, draft_vocab=V)
    with pytest.raises(ValueError, match="a trained eagle3 head reads the target's hidden states"):
        jaxspec.load_eagle_head("/nonexistent", params, config=target)
    medusa = jaxspec.MedusaDrafter(tiny, topk=(1, 1))
    with pytest.raises(ValueError, match="MedusaDrafter reads the target's final hidden state"):
        jaxspec.generate(params, PROMPTS[0], config=target, drafter=medusa, drafter_params={}, max_new_tokens=4)


def test_other_bad_input_is_refused(own, no_compile):
    _, target, params = own
    other = dataclasses.replace(DRAFT, vocab_size=V + 1, name="wide-draft")
    with pytest.raises(ValueError, match=r"draft model vocabulary \(65 tokens, wide-draft\) differs .*\(64 tokens"):
        jaxspec.generate(params, PROMPTS[0], config=target, drafter=jaxspec.ModelDrafter(other, gamma=2),
                         drafter_params=models.init_params(other, jax.random.key(0)), max_new_tokens=4)
    with pytest.raises(ValueError, match="run it without a mesh"):
        jaxspec.generate(params, PROMPTS[0], config=target, mesh=jaxspec.make_mesh(1, 1), max_new_tokens=4)
    with pytest.raises(ValueError, match="config must be a jaxspec.ModelConfig or a target model .*lacks "
                                         "max_position, bos_id"):
        jaxspec.generate(params, PROMPTS[0], config=_Partial(), max_new_tokens=4)
    with pytest.raises(ValueError, match="token id 64 .*vocabulary"):
        jaxspec.generate(params, [1, 64], config=target, max_new_tokens=4)


class _Partial:
    name, vocab_size = "partial", V


def _masked(own, apply, **changes):
    module, _, params = own
    target = MaskedTarget(apply=apply, head=lambda p, h: module.head(h),
                          make_cache=lambda p, b, s: module.init_cache(b, s), name="masked", vocab_size=V,
                          max_position=256, **changes)
    return target, params


def test_a_model_that_ignores_the_mask_is_refused(own, no_compile):
    """The probe at setup (``check_mask``): a model attending causally by slot, whatever the
    mask, lets a draft node see its sibling; refused before any compile. The same module
    honouring the mask passes the probe."""
    module = own[0]

    def causal_only(params, tokens, positions, cache, write_at, mask):
        slots = jnp.arange(mask.shape[-1])
        fixed = slots[None, None, :] <= (write_at[:, None] + jnp.arange(tokens.shape[1])[None])[:, :, None]
        return module(tokens, positions, cache, write_at, fixed)

    target, params = _masked(own, causal_only)
    with pytest.raises(ValueError, match="masked ignores the attention mask"):
        jaxspec.generate(params, PROMPTS[0], config=target, max_new_tokens=4)
    honest, params = _masked(own, lambda p, *a: module(*a))
    jaxspec.models.target.check_mask(honest, params)  # no error


def test_cache_leaves_must_have_the_slot_axis(own):
    module, _, params = own
    target = MaskedTarget(apply=lambda p, *a: module(*a), head=lambda p, h: module.head(h),
                          make_cache=lambda p, b, s: (jnp.zeros((s, b)),), name="flat-cache", vocab_size=V,
                          max_position=256)
    with pytest.raises(ValueError, match=r"flat-cache: every cache leaf must be \[batch, max_len, ...\]"):
        target.init_cache(params, 2, 8)
