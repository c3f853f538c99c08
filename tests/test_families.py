"""Every family loads from a checkpoint transformers wrote itself and gives transformers' logits.

Tiny random models (``tests/support/hf_tiny.py``): Llama, Llama 3.1 RoPE scaling, Mistral (sliding
window on every layer), Qwen2 (q/k/v bias), Qwen3 (q/k norm), Gemma 3 (sliding and full
layers with their own RoPE bases, linear scaling on full layers, q/k norm, sandwich norms,
embedding scale, query_pre_attn_scalar, final soft-capping; its config also sets
attn_logit_softcapping, which transformers ignores for Gemma 3, as must we).

Tolerance ATOL = 1e-4: both sides are float32 with different summation orders; the measured
gap is <= 3.1e-6 on logits of magnitude <= 9 (gemma3), so 1e-4 is 30x that, while dropping any
one feature (window, scaling, bias, norm offset) moves logits by > 0.05 (checked below).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxspec.cache import KVCache  # noqa: E402
from jaxspec.checkpoints.hf import read_hf  # noqa: E402
from jaxspec import models  # noqa: E402
from support.hf_tiny import FAMILIES, TOKENS, write_tiny  # noqa: E402  (tiny_hf fixture: conftest)
from support.ci import core  # tests/support/ci.py: the cases CI runs (the rest are slow)

ATOL = 1e-4


def logits(params, cfg, tokens=TOKENS):
    t = len(tokens)
    cache = KVCache.zeros(cfg, 1, 32, jnp.float32)
    out = models.forward(params, cfg, jnp.asarray([tokens], jnp.int32), jnp.arange(t)[None], cache).logits
    return np.asarray(out[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoint_matches_transformers(tiny_hf, family):
    path, ref = tiny_hf(family)
    params, cfg = read_hf(path, dtype=jnp.float32)
    np.testing.assert_allclose(logits(params, cfg), ref, atol=ATOL, rtol=0)


def test_multimodal_gemma3_language_model(tiny_hf):
    """A Gemma3ForConditionalGeneration directory (vision tower + ``language_model.`` prefixes):
    its language model gives transformers' logits on text-only input."""
    path, ref = tiny_hf("gemma3_multimodal")
    params, cfg = read_hf(path, dtype=jnp.float32)
    assert cfg.family == "gemma3" and cfg.layer_types == ("sliding", "full", "sliding")
    np.testing.assert_allclose(logits(params, cfg), ref, atol=ATOL, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path):
    ref = write_tiny("qwen2", str(tmp_path), max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    params, cfg = read_hf(str(tmp_path), dtype=jnp.float32)
    np.testing.assert_allclose(logits(params, cfg), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, change", [
    ("mistral", {"sliding_window": 0}),
    ("llama3_scaled", {"rope_scaling": None}),
    ("qwen3", {"qk_norm": False}),
    ("gemma3", {"norm_offset": 0.0}),
    ("gemma3", {"rope_local_theta": 0.0}),
    ("gemma3", {"final_softcap": 0.0}),
    ("gemma3", {"embed_scale": 1.0}),
])
def test_each_switch_matters(tiny_hf, family, change):
    """The tolerance above can fail: turning off one feature moves the logits far past it."""
    path, ref = tiny_hf(family)
    params, cfg = read_hf(path, dtype=jnp.float32)
    cfg = dataclasses.replace(cfg, **change)
    assert np.abs(logits(params, cfg) - ref).max() > 0.05


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_one_token_steps_equal_one_pass(tiny_hf, family):
    """Invariant 4 (docs/design.md) on sliding-window layers: T one-token cached steps give the logits of one
    T-token pass, past the window too. XLA:CPU's matmuls sum differently for 1 and 20 rows:
    measured gap <= 2.8e-6, allowed 2e-5; a window off by one moves logits by > 0.05."""
    params, cfg = read_hf(tiny_hf(family)[0], dtype=jnp.float32)
    full = logits(params, cfg)
    cache = KVCache.zeros(cfg, 1, 32, jnp.float32)
    rows = []
    for i, tok in enumerate(TOKENS):
        step = models.forward(params, cfg, jnp.full((1, 1), tok, jnp.int32), jnp.full((1, 1), i), cache)
        out, cache = step.logits, step.cache
        rows.append(np.asarray(out[0, 0]))
    np.testing.assert_allclose(np.stack(rows), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", core(["ngram", "early_exit", "model"], ["early_exit"]))
def test_gemma3_speculative_greedy_equals_plain(tiny_hf, kind):
    """Invariant 1 on a Gemma 3 model whose 5-token sliding window is far shorter than the
    generation: rejected drafts must not disturb the window's keys."""
    import jaxspec

    params, cfg = read_hf(tiny_hf("gemma3")[0], dtype=jnp.float32)
    cfg = dataclasses.replace(cfg, eos_ids=())  # no stop: every row runs all 24 tokens
    prompts = [TOKENS[:9], TOKENS[4:7] * 3]
    kw = dict(config=cfg, max_new_tokens=24)
    plain = jaxspec.generate(params, prompts, **kw)
    drafter, dparams = {
        "ngram": (jaxspec.NGramDrafter(gamma=4, max_n=3, min_n=1), None),
        "early_exit": (jaxspec.EarlyExitDrafter(cfg, n_layers=2, gamma=3), None),
        "model": (jaxspec.ModelDrafter(cfg, gamma=3), params),  # the target itself: all accepted
    }[kind]
    spec = jaxspec.generate(params, prompts, drafter=drafter, drafter_params=dparams, **kw)
    assert spec.tokens == plain.tokens
    assert int(spec.metrics.accepted.sum()) > 0
