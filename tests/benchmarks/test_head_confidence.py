"""benchmarks/experiments/head_confidence.py (issue 11's diagnosis of the EAGLE head's acceptance): its bins
add up, and a "trained" set holds only rows the head trained on. That it scores the drafts the
engine makes: tests/test_eagle.py (it needs a trained head)."""

from __future__ import annotations

import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def head_confidence(bench_module):
    return bench_module("experiments.head_confidence")


def test_summarize_bins(head_confidence):
    p_max = np.array([0.1, 0.35, 0.6, 0.8, 0.95, 1.0, 0.2, 0.92])
    top1 = np.array([0, 1, 0, 1, 1, 1, 0, 0], bool)
    s = head_confidence.summarize(p_max, top1, top1 | (p_max < 0.3))
    assert s["positions"] == 8 and s["agreement"] == 0.5
    assert [b["share"] for b in s["bins"]] == [0.25, 0.125, 0.125, 0.125, 0.375]
    assert [b["agreement"] for b in s["bins"]] == [0.0, 1.0, 0.0, 1.0, 0.667]
    assert s["bins"][0]["topk_coverage"] == 1.0 and s["bins"][-1]["p_max"] == "[0.9, 1.0]"


def test_training_rows_leave_out_what_the_split_held_out(head_confidence):
    """The shipped SmolLM2 head trained on two files concatenated (884 + 997 answers, seed 0,
    holdout 0.1: its head.json); of the second file's first 26 rows, 6, 14 and 24 fell in the
    held-out tenth (head_dataset.split_indices), so a "trained" set must not hold them."""
    from conftest import smollm2

    data = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "checkpoints_tools", "data")
    files = [os.path.join(data, "smollm2-135m-answers.json"), os.path.join(data, "smollm2-135m-instruct-answers.json")]
    rows = head_confidence.training_rows(files, smollm2().params, seed=0, holdout=0.1)
    assert [len(rows[os.path.abspath(f)]) for f in files] == [884 - 87, 997 - 101]
    assert [i for i in range(26) if i not in rows[os.path.abspath(files[1])]] == [6, 14, 24]
