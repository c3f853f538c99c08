"""Templated instruction prompts (checkpoints_tools/instruct_prompts.py): deterministic per
seed, every category served in turn, distinct, and refused when asked for none."""

import pytest

from checkpoints_tools import drafter_data
from checkpoints_tools.instruct_prompts import TEMPLATES, instruct_prompts, passages


def test_prompts_are_seeded_distinct_and_cover_every_category():
    a, b = instruct_prompts(48, seed=0), instruct_prompts(48, seed=0)
    assert a == b and a != instruct_prompts(48, seed=1)
    texts = [p.messages[0]["content"] for p in a]
    assert len(set(texts)) == 48 and all(p.messages[0]["role"] == "user" and not p.text for p in a)
    cats = [p.source.split(":")[1] for p in a]
    assert cats == list(TEMPLATES) * 4  # 12 categories, each in turn
    assert all("{" not in t for t in texts)  # every field filled


def test_passages_are_prose_within_bounds():
    paras = passages()
    assert len(paras) >= 50, len(paras)  # 139 with CPython 3.11's docstrings
    assert all(200 <= len(p) <= 600 and "\n" not in p for p in paras)


def test_a_category_that_runs_out_gives_its_turn_away():
    """Translation holds 112 distinct prompts (7 languages x 8 sentences x 2 templates): asking
    for 12 x 150 still returns distinct prompts, the others filling translation's turns."""
    ps = instruct_prompts(1800, seed=0)
    cats = [p.source.split(":")[1] for p in ps]
    assert len({p.messages[0]["content"] for p in ps}) == 1800
    assert cats.count("translation") == 112 and cats.count("writing") > 150


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match=r"--instruct must be >= 1 prompts, got 0"):
        instruct_prompts(0)
    assert [p.source.split(":")[0] for p in drafter_data.read_prompts(instruct=3)] == ["instruct"] * 3


def test_skipped_prompts_continue_the_seeded_sequence():
    """``--instruct 5 --instruct-skip 7`` gives prompts 7..11 of the seed's sequence: a second
    data run answers prompts no earlier run answered."""
    whole = instruct_prompts(12, seed=3)
    assert drafter_data.read_prompts(instruct=5, seed=3, instruct_skip=7) == whole[7:]

    def text(ps):
        return {p.messages[0]["content"] for p in ps}

    assert not text(whole[7:]) & text(instruct_prompts(7, seed=3))
    with pytest.raises(ValueError, match=r"--instruct-skip must be >= 0, got -1"):
        drafter_data.read_prompts(instruct=5, instruct_skip=-1)
