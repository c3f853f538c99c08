"""benchmarks/bench_small_matmul.py runs on a tiny shape in seconds (so it cannot rot) and
writes its record: command, machine, versions and a median per library and width."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_small_matmul  # noqa: E402


def test_small_matmul_writes_its_record(tmp_path):
    out = tmp_path / "r.json"
    assert bench_small_matmul.main(["--k", "8", "--n", "16", "--reps", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "machine", "versions", "results"}
    for lib in ("jax", "jax_nk", "numpy"):
        assert list(rec["results"][lib]) == ["T1", "T2", "T5", "T9"]
        assert rec["results"][lib]["T1"]["vs_T1"] == 1.0 and rec["results"][lib]["T9"]["ms"] > 0
