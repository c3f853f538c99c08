"""Draft trees (issue 9): chains through the tree code give the pinned tokens of the chain
engine; greedy trees equal plain decoding for every drafter; per-row and per-call topologies
reuse the compiled program; the model interface's tree mask equals running each path alone."""

from __future__ import annotations

import json
import os

import pytest

PINNED = json.load(open(os.path.join(os.path.dirname(__file__), "data", "pinned_chains.json")))


@pytest.mark.parametrize("case", PINNED, ids=lambda c: f"{c['kind']}-g{c['gamma']}-{'-'.join(c['settings']) or 'greedy'}")
def test_chains_give_the_pinned_tokens(tiny, case):
    """The tokens (and drafted/accepted counts) of the chain engine before trees (commit
    b0ce9ac, ``tests/pin_chains.py``) for the same keys: a chain is the special case."""
    out = tiny.generate(tiny.prompts, case["kind"], case["gamma"], **case["settings"])
    assert out.tokens == case["tokens"]
    assert out.metrics.accepted.tolist() == case["accepted"]
    assert out.metrics.drafted.tolist() == case["drafted"]
