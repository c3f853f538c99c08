"""benchmarks/head_confidence.py (issue 11's diagnosis of the EAGLE head's acceptance): its bins
add up. That it scores the drafts the engine makes: tests/test_eagle.py (it needs a trained head)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def head_confidence(bench_module):
    return bench_module("head_confidence")


def test_summarize_bins(head_confidence):
    p_max = np.array([0.1, 0.35, 0.6, 0.8, 0.95, 1.0, 0.2, 0.92])
    top1 = np.array([0, 1, 0, 1, 1, 1, 0, 0], bool)
    s = head_confidence.summarize(p_max, top1, top1 | (p_max < 0.3))
    assert s["positions"] == 8 and s["agreement"] == 0.5
    assert [b["share"] for b in s["bins"]] == [0.25, 0.125, 0.125, 0.125, 0.375]
    assert [b["agreement"] for b in s["bins"]] == [0.0, 1.0, 0.0, 1.0, 0.667]
    assert s["bins"][0]["topk_coverage"] == 1.0 and s["bins"][-1]["p_max"] == "[0.9, 1.0]"
