"""Sampling settings under speculation (issue 3) on the tiny models: penalties, stop ids, stop
strings, ``min_new_tokens``, logprobs, ``n`` and seeds, and their bad-input errors.

Greedy cases assert speculative == plain exactly (float32 CPU). A tiny byte-level tokenizer
over the tiny vocabulary (64 tokens of 1-4 characters) gives the tiny models text, so stop
strings can be chosen from the plain output itself: spanning two tokens, ending inside a
token, or completing in the middle of an accepted block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.api
from jaxspec import stopping
from jaxspec.cache import KVCache
from jaxspec import models
from jaxspec.tokenizer import Tokenizer
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

# 64 tokens in GPT-2's byte alphabet (Ġ = space, Ċ = newline), no merges: decode-only.
TOKENS = (list("abcdefghijklmnopqrstuvwxyz") + ["Ġ", ",", ".", "Ċ"] + list("0123456789")
          + ["ab", "ba", "an", "na", "Ġa", "Ġb", "ing", "Ġthe", "er", "re", "on", "no", "at", "ta", "Ġc", "es",
             "se", "ed", "de", "or", "ro", "en", "ne", "it"])
DRAFTERS = ["ngram", "early_exit", "model_small", "model_self"]
PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer(TOKENS, merges=[], name="tiny-bytes")
    assert t.vocab_size == 64
    return t


def _gen(tiny, tok, prompts, kind="plain", gamma=4, **kw):
    return tiny.generate(prompts, kind, gamma, tokenizer=tok, **kw)


def _text_spans(tok, tokens):
    """(start, end) character span of each token in ``tok.decode(tokens)``."""
    spans, pos = [], 0
    for i in range(len(tokens)):
        end = len(tok.decode(tokens[: i + 1]))
        spans.append((pos, end))
        pos = end
    return spans


# ---------------------------------------------------------------------------- greedy: spec == plain


@pytest.mark.parametrize("kind", core(DRAFTERS, ["ngram", "model_small"]))
def test_penalties_greedy_spec_equals_plain(tiny, plain_greedy, kind):
    """Repetition, frequency and presence penalties change the greedy output (so they act)
    and speculative decoding reproduces it exactly with every drafter."""
    plain = tiny.generate(tiny.prompts, **PENALTIES).tokens
    assert plain != plain_greedy
    assert tiny.generate(tiny.prompts, kind, 4, **PENALTIES).tokens == plain


def _pick_split_stop(tok, tokens, block_end_ok: bool):
    """A stop string made of the last character of token k and the first of token k + 1,
    first occurring there; with ``block_end_ok=False``, k and k+1 lie in one gamma-4 block
    of an all-accepting drafter (tokens 1-5, 6-10, ...: prefill emits token 0)."""
    text = tok.decode(tokens)
    spans = _text_spans(tok, tokens)
    for k in range(1, len(tokens) - 1):
        (a0, a1), (b0, b1) = spans[k], spans[k + 1]
        if a1 - a0 < 1 or b1 - b0 < 1 or (not block_end_ok and (k - 1) // 5 != k // 5):
            continue
        stop = text[a1 - 1 : b0 + 1]
        if text.find(stop) == a1 - 1:
            return k, stop, text
    raise AssertionError("no usable split in this output")


@pytest.mark.parametrize("kind", core(DRAFTERS, ["early_exit", "model_self"]))
def test_stop_string_split_across_two_accepted_tokens(tiny, tok, plain_greedy, kind):
    """A stop string spanning tokens k and k + 1 ends the output at token k + 1, its text
    just before the stop string, the same for plain and speculative decoding. With
    ``model_self`` every draft is accepted, and tokens k, k + 1 sit inside one block, so the
    stop completes in the middle of an accepted block."""
    prompt = tiny.prompts[0]
    k, stop, text = _pick_split_stop(tok, plain_greedy[0], block_end_ok=False)
    plain = _gen(tiny, tok, [prompt], stop=[stop])
    assert plain.tokens[0] == plain_greedy[0][: k + 2]
    assert plain.texts[0] == text[: text.find(stop)]
    assert plain.finish_reasons == ["stop"] and plain.stop_reasons == [stop]
    spec = _gen(tiny, tok, [prompt], kind, stop=[stop])
    assert (spec.tokens, spec.texts, spec.stop_reasons) == (plain.tokens, plain.texts, plain.stop_reasons)
    if kind == "model_self":
        assert spec.metrics.accepted[0] >= k, "the block holding the stop was not accepted whole"
    kept = _gen(tiny, tok, [prompt], kind, stop=[stop], include_stop_str_in_output=True)
    assert kept.texts[0] == text[: text.find(stop) + len(stop)] and kept.tokens == plain.tokens


def test_two_stop_strings_in_one_block_earlier_wins(tiny, tok, plain_greedy):
    """Two stop strings completing in the same accepted block: the one completing first ends
    the output (tokens and text), whichever order they are listed in."""
    prompt = tiny.prompts[0]
    k, early, text = _pick_split_stop(tok, plain_greedy[0], block_end_ok=False)
    spans = _text_spans(tok, plain_greedy[0])
    late_end = spans[min(k + 2, (k // 5) * 5 + 5)][1]  # ends in a later token of the same block
    late = text[late_end - 3 : late_end]
    assert text.find(late) + len(late) > text.find(early) + len(early)
    for stops in ([early, late], [late, early]):
        for kind in ("plain", "model_self"):
            r = _gen(tiny, tok, [prompt], kind, stop=stops)
            assert r.tokens[0] == plain_greedy[0][: k + 2] and r.stop_reasons == [early], (kind, stops)
            assert r.texts[0] == text[: text.find(early)]


def test_stop_strings_ending_in_one_token_cut_at_the_earliest_end(tok):
    """Host-side cut: of two stop strings completing in the same token the one that ends
    first wins (ties: the longer, which starts first); ``before`` ignores earlier matches."""
    assert stopping.cut_text("abcdef", ["cde", "bc"]) == ("a", "bc")
    assert stopping.cut_text("abcdef", ["bcd", "cd"]) == ("a", "bcd")
    assert stopping.cut_text("abcdef", ["cd"], include=True) == ("abcd", "cd")
    assert stopping.cut_text("ab ab", ["ab"], before=3) == ("ab ", "ab")
    assert stopping.cut_text("abc", ["x"]) == ("abc", None)


@pytest.mark.parametrize("index,what", [(1, "first drafted token"), (5, "bonus token")])
def test_stop_id_as_first_draft_and_as_bonus(tiny, plain_greedy, index, what):
    """With gamma 4 and an all-accepting drafter, token 1 is the first draft of the first
    block and token 5 its bonus token: a stop id there ends the output right after it."""
    row = next(i for i, t in enumerate(plain_greedy) if t.index(t[index]) == index)
    stop = plain_greedy[row][index]
    for kind in ("plain", "model_self", "ngram"):
        r = tiny.generate([tiny.prompts[row]], kind, 4, stop_token_ids=[stop])
        assert r.tokens[0] == plain_greedy[row][: index + 1], (kind, what)
        assert r.finish_reasons == ["stop"] and r.stop_reasons == [stop]


@pytest.mark.parametrize("kind", ["plain", "model_self", "ngram"])
def test_max_new_tokens_one(tiny, plain_greedy, kind):
    r = tiny.generate(tiny.prompts, kind, 4, max_new_tokens=1)
    assert r.tokens == [t[:1] for t in plain_greedy]
    assert r.finish_reasons == ["length"] * 3


@pytest.mark.parametrize("kind", ["model_self", "ngram", "model_small"])
def test_min_new_tokens_suppresses_stops(tiny, tok, plain_greedy, kind):
    """``min_new_tokens=6`` with the first greedy token as a stop id: the stop id cannot be
    emitted among the first 6 tokens (its probability is 0 there), and a stop string
    completing before token 6 does not count; speculative == plain."""
    prompt, first = tiny.prompts[0], plain_greedy[0][0]
    plain = _gen(tiny, tok, [prompt], stop_token_ids=[first], min_new_tokens=6)
    assert first not in plain.tokens[0][:6] and len(plain.tokens[0]) >= 6
    assert _gen(tiny, tok, [prompt], kind, stop_token_ids=[first], min_new_tokens=6).tokens == plain.tokens
    early = tok.decode(plain_greedy[0][:2])  # completes at token 1 < 6 in the unconstrained text
    free = _gen(tiny, tok, [prompt], stop=[early], min_new_tokens=6)
    spec = _gen(tiny, tok, [prompt], kind, stop=[early], min_new_tokens=6)
    assert len(free.tokens[0]) >= 6 and spec.tokens == free.tokens and spec.texts == free.texts


# ---------------------------------------------------------------------------- logprobs


@functools.partial(jax.jit, static_argnums=1)
def _teacher_forced_logprobs(params, config, tokens):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits = models.forward(params, config, tokens, positions, KVCache.zeros(config, b, t, jnp.float32)).logits
    return jax.nn.log_softmax(logits, axis=-1)


@pytest.mark.parametrize("kind", ["model_noisy", "ngram", "early_exit"])
def test_logprobs_spec_equals_plain_and_full_forward(tiny, kind):
    """Greedy: speculative logprobs (chosen and top 3, same ids) equal plain decoding's within
    1e-5 (float32: the (gamma+1)-token window and the 1-token forward sum in different orders;
    measured gaps are ~2e-7, one ulp of values near 3). Sampled (T = 1): every
    emitted token's logprob equals the log-softmax of an uncached full forward over prompt +
    output within 1e-5 (docs/design.md: invariant 4's tolerance for cached vs uncached logits)."""
    plain = tiny.generate(tiny.prompts, logprobs=3)
    spec = tiny.generate(tiny.prompts, kind, 4, logprobs=3)
    assert spec.tokens == plain.tokens
    for a, b, ta, tb in zip(spec.logprobs, plain.logprobs, spec.top_logprobs, plain.top_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
        assert [[i for i, _ in alts] for alts in ta] == [[i for i, _ in alts] for alts in tb]
        np.testing.assert_allclose([[lp for _, lp in alts] for alts in ta], [[lp for _, lp in alts] for alts in tb],
                                   atol=1e-5)
    for row in plain.top_logprobs:
        for alts in row:
            assert [lp for _, lp in alts] == sorted((lp for _, lp in alts), reverse=True)
    sampled = tiny.generate(tiny.prompts, kind, 4, logprobs=3, temperature=1.0, seed=5)
    assert spec.metrics.accepted.sum() > 0 and sampled.tokens != plain.tokens
    for prompt, toks, lps in zip(tiny.prompts, sampled.tokens, sampled.logprobs):
        full = np.asarray(_teacher_forced_logprobs(tiny.params, tiny.cfg, jnp.asarray([prompt + toks])))[0]
        ref = full[len(prompt) - 1 + np.arange(len(toks)), toks]
        np.testing.assert_allclose(lps, ref, atol=1e-5)


def test_processed_logprobs(tiny):
    """``logprobs_mode="processed"``: under greedy the chosen token has log-probability 0 (it
    is certain); under top-k 5 the five alternatives hold all the mass; raw logprobs differ."""
    # greedy and sampled rows run one program (the temperature is a value, not a shape)
    greedy = tiny.generate(tiny.prompts[:1], "model_noisy", 4, logprobs=5, logprobs_mode="processed")
    assert all(lp == 0.0 for lp in greedy.logprobs[0])
    assert all(lp == -np.inf for alts in greedy.top_logprobs[0] for _, lp in alts[1:])
    r = tiny.generate(tiny.prompts[:1], "model_noisy", 4, logprobs=5, logprobs_mode="processed", temperature=1.0,
                      top_k=5, seed=1)
    for alts in r.top_logprobs[0]:
        assert sum(np.exp(lp) for _, lp in alts) == pytest.approx(1.0, abs=1e-5)
    raw = tiny.generate(tiny.prompts[:1], "model_noisy", 4, logprobs=5, temperature=1.0, top_k=5, seed=1)
    assert raw.tokens == r.tokens and raw.logprobs != r.logprobs


# ---------------------------------------------------------------------------- n, seeds, recompiles


def test_n_samples_and_seeds(tiny):
    """``n=3``: rows are prompt-major, sample r of the call is seeded seed + r, so each row
    equals a single-prompt call with that seed (rows are independent); per-prompt seeds give
    sample j of prompt i the seed seed_i + j; the same seed reproduces the output."""
    kw = dict(temperature=1.0, top_p=0.9, max_new_tokens=12)
    many = tiny.generate(tiny.prompts[:2], "model_noisy", 4, n=3, seed=7, **kw)
    assert len(many.tokens) == 6 and len(set(map(tuple, many.tokens[:3]))) > 1
    for r, tokens in enumerate(many.tokens):
        single = tiny.generate([tiny.prompts[r // 3]], "model_noisy", 4, seed=7 + r, **kw)
        assert single.tokens[0] == tokens
    assert tiny.generate(tiny.prompts[:2], "model_noisy", 4, n=3, seed=7, **kw).tokens == many.tokens
    per_prompt = tiny.generate(tiny.prompts[:2], "model_noisy", 4, n=3, seed=[100, 200], **kw)
    assert per_prompt.tokens[4] == tiny.generate([tiny.prompts[1]], "model_noisy", 4, seed=201, **kw).tokens[0]


def test_changing_values_does_not_recompile(tiny, tok):
    """New temperatures, top-k/p, min-p, penalties, min_new_tokens, seeds and stop strings
    (within the 4-string bucket) reuse the compiled program."""
    _gen(tiny, tok, tiny.prompts, "ngram", temperature=0.5, stop=["ab"])
    n = len(jaxspec.api._COMPILED)
    r = _gen(tiny, tok, tiny.prompts, "ngram", temperature=[0.0, 1.2, 0.7], top_k=[0, 5, 3], top_p=0.8, min_p=0.05,
             repetition_penalty=1.2, frequency_penalty=-0.5, presence_penalty=1.0, min_new_tokens=2, seed=99,
             stop=["Ġthe", "xy", "ing"])
    assert r.metrics.compile_s == 0.0 and len(jaxspec.api._COMPILED) == n


# ---------------------------------------------------------------------------- stop strings on device


def test_device_stop_matcher_equals_python(tok):
    """``stopping.append`` token by token flags exactly the tokens whose bytes complete the
    first occurrence of a stop string in the generated bytes (python ``bytes.find``), on
    random token sequences, with multi-byte stops spanning up to 4 tokens."""
    rng = np.random.default_rng(0)
    stops = ["an", "Ġthe ", "ing,", "a.b", "zzzz"]
    tables = stopping.make_tables([s.replace("Ġ", " ") for s in stops],
                                  stopping.token_byte_table(tok.token_bytes()))
    pieces = tok.token_bytes()
    seqs = rng.integers(0, 64, size=(200, 12))
    seqs[:, 3:6] = rng.integers(40, 64, size=(200, 3))  # more multi-character tokens
    tail, hits = stopping.empty_tail(200, tables), []
    append = jax.jit(stopping.append)
    for j in range(seqs.shape[1]):
        tail, hit = append(tables, tail, jnp.asarray(seqs[:, j], jnp.int32))
        hits.append(np.asarray(hit))
    hits = np.stack(hits, axis=1)
    targets = [s.replace("Ġ", " ").encode() for s in stops]
    n_hits = 0
    for row, seq in enumerate(seqs):
        text = b""
        for j, t in enumerate(seq):
            before = len(text)
            text += pieces[t]
            expect = any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in targets)
            assert hits[row, j] == expect, (row, j, text)
            n_hits += expect
    assert n_hits > 50


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), r"temperature must be finite and >= 0"),
        (dict(top_p=0.0), r"top_p must be finite and in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be finite and in \(0, 1\]"),
        (dict(top_k=-1), r"top_k must be an integer in \[0, 2\*\*31 - 1\] \(0 = off\), got -1"),
        (dict(top_k=2.5), r"top_k must be an integer"),
        (dict(min_p=1.2), r"min_p must be finite and in \[0, 1\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be finite and > 0"),
        (dict(frequency_penalty=3.0), r"frequency_penalty must be finite and in \[-2, 2\]"),
        (dict(presence_penalty=-2.5), r"presence_penalty must be finite and in \[-2, 2\]"),
        (dict(min_new_tokens=9, max_new_tokens=8), r"min_new_tokens \(9\) must be <= max_new_tokens \(8\)"),
        (dict(min_new_tokens=-1), r"min_new_tokens must be an integer in \[0, 2\*\*31 - 1\], got -1"),
        (dict(n=0), r"n \(samples per prompt\) must be an integer in \[1, 2\*\*31 - 1\], got 0"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
        (dict(logprobs_mode="softmax"), r"logprobs_mode must be 'raw' or 'processed'"),
        (dict(stop=[""]), r"stop must be non-empty strings"),
        (dict(stop_token_ids=[64]), r"stop_token_ids has token id 64 outside the vocabulary \[0, 64\)"),
        (dict(temperature=[0.5, 1.0]), r"temperature has 2 values; give one value or one per prompt \(3\)"),
        (dict(stop=["x"], tokenizer=None), r"stop strings need a tokenizer"),
    ],
)
def test_bad_settings_raise_before_compile(tiny, tok, kwargs, match):
    kwargs = {"tokenizer": tok, **kwargs}
    n = len(jaxspec.api._COMPILED)
    with pytest.raises(ValueError, match=match):
        tiny.generate(tiny.prompts, "ngram", 4, **kwargs)
    assert len(jaxspec.api._COMPILED) == n


def test_unknown_setting_is_a_type_error(tiny):
    with pytest.raises(TypeError, match=r"unknown settings \['top_q'\]"):
        tiny.generate(tiny.prompts, top_q=0.9)


def test_truncation_thresholds_equal_sorting():
    """``sampling.truncate`` (bisection thresholds, no sort) keeps exactly the tokens a
    vocabulary sort keeps (Hugging Face's top-k, then top-p on the renormalised top-k, then
    min-p), on 64 rows of 1000 distinct-valued probabilities, each row its own k/p/min-p;
    kept probabilities renormalised equal within 1e-6 (float32 sums of <= 1000 terms)."""
    from jaxspec.sampling import truncate

    rng = np.random.default_rng(3)
    b, v = 64, 1000
    logits = rng.normal(size=(b, v)) * rng.uniform(0.5, 4, size=(b, 1))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    top_k = rng.choice([0, 1, 7, 50, 999, 2000], size=b).astype(np.int32)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], size=b).astype(np.float32)
    min_p = rng.choice([0.0, 0.01, 0.2], size=b).astype(np.float32)
    ours = np.asarray(jax.jit(truncate)(jnp.asarray(probs[:, None]), jnp.asarray(top_k), jnp.asarray(top_p),
                                        jnp.asarray(min_p)))[:, 0]
    for i in range(b):
        x = probs[i].astype(np.float64)
        order = np.argsort(-x)
        keep = np.ones(v, bool)
        if top_k[i] > 0:
            keep[order[top_k[i]:]] = False
        y = np.where(keep, x, 0) / np.where(keep, x, 0).sum()
        if top_p[i] < 1:
            above = np.cumsum(y[order]) - y[order]
            keep[order[above >= top_p[i]]] = False
        y = np.where(keep, x, 0)
        keep &= y >= min_p[i] * y.max()
        expect = np.where(keep, x, 0) / np.where(keep, x, 0).sum()
        np.testing.assert_array_equal(ours[i] > 0, keep, err_msg=f"row {i}: k {top_k[i]} p {top_p[i]} min_p {min_p[i]}")
        np.testing.assert_allclose(ours[i], expect, atol=1e-6)
    assert len({int((ours[i] > 0).sum()) for i in range(b)}) > 10  # the settings really vary the kept sets


def test_draft_model_with_another_tokenizer_is_refused(tiny, tok):
    """A draft ``Model`` whose tokenizer spells an id differently (same vocabulary size) is
    refused by ``generate`` before compiling, naming the id and both strings."""
    other = Tokenizer(TOKENS[:-2] + TOKENS[-1:] + TOKENS[-2:-1], merges=[], name="swapped")
    target = jaxspec.Model(tiny.params, tiny.cfg, tok)
    draft = jaxspec.Model(tiny.draft_params, tiny.draft_cfg, other)
    n = len(jaxspec.api._COMPILED)
    with pytest.raises(ValueError, match=r"draft model token 62 is 'it' .* but the target's is 'ne'"):
        jaxspec.generate(target, [[1, 2]], drafter=jaxspec.ModelDrafter(tiny.draft_cfg, gamma=2), drafter_params=draft)
    assert len(jaxspec.api._COMPILED) == n
    same = jaxspec.Model(tiny.draft_params, tiny.draft_cfg, tok)
    r = jaxspec.generate(target, [[1, 2]], drafter=jaxspec.ModelDrafter(tiny.draft_cfg, gamma=2), drafter_params=same,
                         max_new_tokens=4)
    assert len(r.tokens[0]) == 4
