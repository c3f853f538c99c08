"""``benchmarks/greedy_exactness.py`` (the check run on every lent accelerator) on CPU in
float32, where the engine's invariant holds: every row of every drafter equals plain decoding,
and the JSON records what it compared."""

from __future__ import annotations

import json



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
