"""benchmarks/bench_attention.py runs on a tiny shape in seconds (so it cannot rot) and writes
its record: command, machine, versions and a median per build and width."""

import json

import pytest

from benchmarks import bench_attention
from jaxspec.kernels import cpu_matmul


@pytest.mark.skipif(not cpu_matmul.enabled(), reason="the CPU kernels are not built")
def test_bench_attention_writes_its_record(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--slots", "32",
            "--committed", "10", "--widths", "1,3", "--reps", "2", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "machine", "versions", "results", "settings"}
    assert "benchmarks.bench_attention" in rec["command"]
    for t in ("T1", "T3"):
        r = rec["results"]["installed"][t]
        assert r["ms"] > 0 and r["bitwise_equal_installed"] and r["max_abs_diff_installed"] == 0.0


def test_bench_attention_refuses_a_window_past_the_cache(tmp_path):
    with pytest.raises(SystemExit, match="exceeds --slots 16"):
        bench_attention.main(["--slots", "16", "--committed", "10", "--widths", "1,9", "--out", str(tmp_path / "r.json")])
