"""benchmarks/bench_small_matmul.py runs on a tiny shape in seconds (so it cannot rot) and
writes its record: command, machine, versions and a median per library and width."""

import json

from benchmarks import bench_small_matmul
from jaxspec.kernels import cpu_matmul


def test_small_matmul_writes_its_record(tmp_path):
    out = tmp_path / "r.json"
    assert bench_small_matmul.main(["--k", "8", "--n", "16", "--reps", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "machine", "versions", "results"}
    libs = ("jax", "jax_nk", "numpy") + (("kernel", "kernel_nk", "kernel_bf16") if cpu_matmul.enabled() else ())
    for lib in libs:
        assert list(rec["results"][lib]) == ["T1", "T2", "T5", "T9"]
        assert rec["results"][lib]["T1"]["vs_T1"] == 1.0 and rec["results"][lib]["T9"]["ms"] > 0
        assert rec["results"][lib]["T9"]["GB_s"] > 0
    assert rec["copy_GB_s"] > 0 and len(rec["load_avg_before"]) == 3
