"""Medusa-1 heads (issue 11): the drafter's static tree is exact whatever the heads say
(random heads here); training them (train-medusa) is not written yet."""

from __future__ import annotations

import jax
import pytest

import jaxspec
from jaxspec.drafters import medusa


@pytest.mark.parametrize("topk", [(2, 2, 1)])  # (1, 1, 1), a chain, passes too (one compile each)
def test_greedy_medusa_equals_plain(tiny, plain_greedy, topk):
    """Invariant 1 for a static tree of 2 + 4 + 4 nodes from the heads' top-k, batch 3."""
    drafter = jaxspec.MedusaDrafter(tiny.cfg, topk=topk)
    heads = medusa.init_heads(tiny.cfg, 3, jax.random.key(7), scale=2.0)
    out = jaxspec.generate(tiny.params, tiny.prompts, config=tiny.cfg, drafter=drafter, drafter_params=heads,
                           max_new_tokens=tiny.max_new, ignore_eos=True)
    assert out.tokens == plain_greedy
    assert out.metrics.drafted.sum() > 0 and drafter.n_nodes == {(1, 1, 1): 3, (2, 2, 1): 10}[topk]


def test_bad_medusa_settings_are_refused(tiny):
    with pytest.raises(ValueError, match=r"topk entries must be an integer in \[1, 16\], got 0"):
        jaxspec.MedusaDrafter(tiny.cfg, topk=(2, 0))
    heads = medusa.init_heads(tiny.cfg, 2, jax.random.key(0))
    with pytest.raises(ValueError, match=r"needs >= 3 heads in drafter_params\['heads'\], got 2"):
        jaxspec.generate(tiny.params, tiny.prompts[:1], config=tiny.cfg, drafter=jaxspec.MedusaDrafter(tiny.cfg, (1, 1, 1)),
                         drafter_params=heads, max_new_tokens=4)
