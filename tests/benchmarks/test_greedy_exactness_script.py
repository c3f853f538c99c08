"""``benchmarks/greedy_exactness.py`` (the check run on every accelerator) on CPU in
float32, where the engine's invariant holds: every row of every drafter equals plain decoding,
and the JSON records what it compared."""

from __future__ import annotations

import json

import jaxspec.engine



def test_cpu_float32_rows_equal_plain(tmp_path, bench_module):
    greedy_exactness = bench_module("greedy_exactness")
    path = tmp_path / "exact.json"
    argv = ["--shapes", "tiny", "--dtypes", "float32", "--seeds", "1", "--max-new-tokens", "16",
            "--drafters", "ngram_chain,self_draft", "--out", str(path)]
    assert greedy_exactness.main(argv) == 0
    rec = json.loads(path.read_text())
    assert rec["machine"]["backend"] == "cpu"
    assert [(c["drafter"], c["batch"]) for c in rec["cases"]] == [
        ("ngram_chain", 1), ("self_draft", 1), ("ngram_chain", 3), ("self_draft", 3)]
    assert rec["rows"] == 8 and rec["rows_identical"] == 8
    assert all(c["first_difference"] == [None] * c["batch"] for c in rec["cases"])
    assert all(c["rows_identical_to_window_plain"] == c["batch"] for c in rec["cases"])
    assert [(w["batch"], w["rows_identical"]) for w in rec["window_plain_vs_plain"]] == [(1, 1), (3, 3)]
    # the target's own weights as draft: every draft is the target's greedy token, all accepted
    # (16 new tokens: the prefill's first, then 3 steps of 4 drafts + 1 bonus)
    assert all(c["tau"] == 5.0 for c in rec["cases"] if c["drafter"] == "self_draft")
    assert rec["min_pass_tokens"] == 1


def test_padded_passes_are_recorded_and_undone(tmp_path, bench_module, forward_widths):
    """``--min-pass-tokens 2`` (plain decoding's 1-token pass run as a 2-token one: no other
    forward of the run is 2 tokens wide) still gives plain decoding's rows on CPU, is recorded,
    and holds for that run only."""
    greedy_exactness = bench_module("greedy_exactness")
    path = tmp_path / "exact.json"
    argv = ["--shapes", "tiny", "--dtypes", "float32", "--seeds", "1", "--max-new-tokens", "16",
            "--drafters", "self_draft", "--min-pass-tokens", "2", "--out", str(path)]
    assert greedy_exactness.main(argv) == 0
    rec = json.loads(path.read_text())
    assert rec["min_pass_tokens"] == 2 and rec["rows"] == 4 and rec["rows_identical"] == 4 and 2 in forward_widths
    assert jaxspec.engine.min_pass_tokens() == 1
