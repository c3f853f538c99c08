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
        {"ph": "X", "name": "cond.12", "dur": 99999},  # a conditional (lax.switch): its branch's ops are counted
        {"ph": "i", "name": "dot.1"},  # not a complete event
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert profile_ops.op_times(str(path)) == {"dot": (2.0, 2), "copy_bitcast_fusion": (0.25, 1), "copy": (0.1, 1)}


def test_instruction_kinds_names_custom_calls_and_fusions(bench_module):
    """``--pass-widths`` groups a pass's instructions by kind: a custom call by its target, a
    fusion by its kind and its fused computation's root op, anything else by its opcode."""
    profile_ops = bench_module("profile_ops")
    hlo = """HloModule m

%fused_computation.3 (p: f32[4]) -> bf16[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %convert.1 = bf16[4]{0} convert(%p)
}

ENTRY %main (x: f32[4]) -> bf16[4] {
  %x = f32[4]{0} parameter(0)
  %ffi_call.7 = f32[4]{0} custom-call(%x), custom_call_target="jaxspec_cpu_matmul_panels", api_version=API_VERSION_TYPED_FFI
  ROOT %convert_fusion.2 = bf16[4]{0} fusion(%ffi_call.7), kind=kLoop, calls=%fused_computation.3
}
"""
    kinds = profile_ops.instruction_kinds(hlo)
    assert kinds["ffi_call.7"] == "jaxspec_cpu_matmul_panels"
    assert kinds["convert_fusion.2"] == "fusion loop:convert"
    assert kinds["x"] == "parameter"
