"""EAGLE-3 (issue 11): the drafter behind the protocol, its head files, and training.

Exactness does not depend on training: a random head drafts mostly wrong tokens, and greedy
output must still equal plain decoding token for token (invariant 1). Training tests use a
short run on the tiny target (``checkpoints_tools.train_eagle``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models import eagle3

DRAFT_VOCAB = 48  # of the tiny target's 64 tokens


@pytest.fixture(scope="module")
def random_head(tiny):
    cfg = eagle3.EagleConfig(tiny.cfg, draft_vocab=DRAFT_VOCAB)
    d2t = np.sort(np.random.default_rng(0).permutation(tiny.cfg.vocab_size)[:DRAFT_VOCAB])
    return cfg, {"head": eagle3.init_params(cfg, jax.random.key(5), scale=2.0), "d2t": jnp.asarray(d2t, jnp.int32)}


def test_default_capture_is_the_reference_layers():
    """The inputs of layers 2, L/2 and L-3 (SafeAILab/EAGLE traineagle3, vLLM llama_eagle3) are
    the outputs of layers 1, L/2 - 1, L - 4; clamped for tiny targets."""
    assert eagle3.default_capture(30) == (1, 14, 26)  # SmolLM2-135M
    assert eagle3.default_capture(32) == (1, 15, 28)  # Llama-3-8B
    assert eagle3.default_capture(2) == (0, 0, 1)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_eagle_equals_plain(tiny, plain_greedy, random_head, mode, batch):
    """Invariant 1: greedy EAGLE output (chain gamma 3; dynamic tree of 6 nodes, depth 3,
    branching 2) equals plain greedy output for batch 1 and 3 (row 0 of the batch-3 plain run
    for batch 1: invariant 3)."""
    cfg, dparams = random_head
    tree = dict(tree_nodes=6, branching=2) if mode == "tree" else {}
    drafter = jaxspec.EagleDrafter(cfg, gamma=3, **tree)
    out = jaxspec.generate(
        tiny.params, tiny.prompts[:batch], config=tiny.cfg, drafter=drafter, drafter_params=dparams,
        max_new_tokens=tiny.max_new, ignore_eos=True)
    assert out.tokens == plain_greedy[:batch]
    assert out.metrics.drafted.sum() > 0


def test_bad_eagle_settings_are_refused(tiny, random_head):
    cfg, dparams = random_head
    with pytest.raises(ValueError, match=r"draft_vocab must be an integer in \[2, 64\] \(the target's vocabulary\), "
                                         r"got 65"):
        eagle3.EagleConfig(tiny.cfg, draft_vocab=65)
    with pytest.raises(ValueError, match=r"branching must be an integer in \[1, 48\] \(at most the draft vocabulary\)"):
        jaxspec.EagleDrafter(cfg, gamma=2, tree_nodes=4, branching=49)
    other = eagle3.EagleConfig(jaxspec.ModelConfig(**{**tiny.cfg.to_dict(), "dim": 16, "head_dim": 4}), draft_vocab=8)
    with pytest.raises(ValueError, match=r"is an EAGLE head for tiny-target, not for the target tiny-target: config "
                                         r"fields differ \(head's, target's\): \{'dim': \(16, 32\)"):
        jaxspec.generate(tiny.params, tiny.prompts[:1], config=tiny.cfg, drafter=jaxspec.EagleDrafter(other),
                         drafter_params=dparams, max_new_tokens=4)
