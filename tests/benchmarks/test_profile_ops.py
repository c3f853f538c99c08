"""``benchmarks/profile_ops.py``'s trace reader on a hand-written Perfetto trace: op events
summed by kind (numeric suffix dropped), runtime spans and Python frames left out."""

from __future__ import annotations

import gzip
import json



def test_op_times_sums_by_kind(tmp_path, bench_module):
    profile_ops = bench_module("profile_ops")
    events = [
        {"ph": "X", "name": "dot.4064", "dur": 1500},
        {"ph": "X", "name": "dot.12", "dur": 500},
        {"ph": "X", "name": "copy_bitcast_fusion.3", "dur": 250},
        {"ph": "X", "name": "copy", "dur": 100},
        {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 99999},  # the runtime's own span
        {"ph": "X", "name": "$api.py:388 generate", "dur": 99999},  # a Python frame
        {"ph": "X", "name": "while.480", "dur": 99999},  # a loop: its body's ops are counted
        {"ph": "i", "name": "dot.1"},  # not a complete event
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert profile_ops.op_times(str(path)) == {"dot": (2.0, 2), "copy_bitcast_fusion": (0.25, 1), "copy": (0.1, 1)}
