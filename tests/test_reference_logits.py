"""Invariant 5 (docs/design.md): SmolLM2-135M logits match an independent implementation (transformers).

The reference logits in ``tests/data/smollm2_reference_logits.npz`` were computed by Hugging
Face transformers 5.24 (torch 2.13 CPU, float32) from the same GGUF, with its own
dequantization and Q/K un-permutation; ``python -m checkpoints_tools.make_reference_logits``
regenerates them. CI does not need torch.

Tolerance: both sides compute in float32 over 30 layers with different summation orders; the
measured gap is ~1e-4 on logits of magnitude ~10-30 (relative ~1e-5). We allow 2e-3 absolute,
20x the measured gap and still far below the 0.1-1 logit differences that a wrong RoPE,
norm or permutation produces (un-permuted Q/K gives errors of ~20).
"""

import functools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec import models

DATA = pathlib.Path(__file__).parent / "data" / "smollm2_reference_logits.npz"
ATOL = 2e-3


@functools.lru_cache(maxsize=1)
def smollm2():
    try:
        return jaxspec.load("smollm2-135m", dtype=jnp.float32)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def reference(k):
    ref = np.load(DATA)
    return {name: ref[f"{name}_{k}"] for name in ("prompt", "ids", "cols", "logits", "argmax", "logsumexp", "last_logits")}


def full_logits(model, ids):
    t = len(ids)
    cache = KVCache.zeros(model.config, 1, t, jnp.float32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    logits = models.forward(model.params, model.config, jnp.asarray(ids, jnp.int32)[None], positions, cache).logits
    return np.asarray(logits[0])


@pytest.mark.parametrize("k", [0, 1, 2])
def test_logits_match_transformers(k):
    model, ref = smollm2(), reference(k)
    assert model.tokenizer.encode(str(ref["prompt"]), add_bos=False) == ref["ids"].tolist()
    ours = full_logits(model, ref["ids"])
    np.testing.assert_allclose(ours[:, ref["cols"]], ref["logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(ours[-1], ref["last_logits"], atol=ATOL, rtol=0)
    lse = np.log(np.exp(ours - ours.max(-1, keepdims=True)).sum(-1)) + ours.max(-1)
    np.testing.assert_allclose(lse, ref["logsumexp"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), ref["argmax"])


def test_cached_decode_matches_reference():
    """Prefill half the prompt, then one token at a time through the cache (invariant 4 on real weights)."""
    model, ref = smollm2(), reference(1)
    ids = jnp.asarray(ref["ids"], jnp.int32)[None]
    t, half = ids.shape[1], ids.shape[1] // 2
    cache = KVCache.zeros(model.config, 1, 64, jnp.float32)
    step = models.forward(model.params, model.config, ids[:, :half], jnp.arange(half)[None], cache)
    logits, cache = step.logits, step.cache
    rows = [np.asarray(logits[0])]
    for i in range(half, t):
        step = models.forward(model.params, model.config, ids[:, i : i + 1], jnp.full((1, 1), i), cache)
        logits, cache = step.logits, step.cache
        rows.append(np.asarray(logits[0]))
    ours = np.concatenate(rows)
    np.testing.assert_allclose(ours[:, ref["cols"]], ref["logits"], atol=ATOL, rtol=0)
