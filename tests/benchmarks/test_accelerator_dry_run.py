"""``benchmarks/accelerator.py --dry-run`` (tiny shape, CPU) writes the JSON the real run
writes, with every field present and sane values (no timing assertions: only that times are
positive, or None where a long-short difference drowned in noise)."""

from __future__ import annotations

import json

import pytest

import jaxspec.engine



def _tiny_streamed_bytes(c) -> int:
    """bf16 bytes of the dry run's tiny shape a pass reads: every layer, the final norm and
    the untied head; not the embedding table (a lookup reads only the window's rows)."""
    attn = c.dim * c.n_heads * c.head_dim * 2 + c.dim * c.n_kv_heads * c.head_dim * 2
    layer = attn + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return 2 * (c.n_layers * layer + c.dim + c.dim * c.vocab_size)


def test_dry_run_json(tmp_path, capsys, bench_module, forward_widths):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    accelerator = bench_module("accelerator")
    path = tmp_path / "acc.json"
    assert accelerator.main(["--dry-run", "--out", str(path)]) == 0
    printed = capsys.readouterr().out
    rec = json.loads(path.read_text())

    assert rec["dry_run"] is True and rec["command"].startswith("python -m benchmarks.accelerator --dry-run")
    assert rec["machine"]["device_kind"] and rec["machine"]["backend"] == "cpu"
    assert rec["versions"]["jax"] and rec["versions"]["torch"] and rec["versions"]["transformers"]
    assert rec["copy_bandwidth"]["bytes_per_s"] > 0
    assert set(rec["shapes"]) == {"tiny"}
    tiny = rec["shapes"]["tiny"]
    config = accelerator.shapes(True)["tiny"]
    assert tiny["weight_bytes_streamed"] == _tiny_streamed_bytes(config)
    assert tiny["floor_ms"] == pytest.approx(tiny["weight_bytes_streamed"] / rec["copy_bandwidth"]["bytes_per_s"] * 1e3)
    assert set(tiny["pass"]["ms"]) == {"B1_T1", "B1_T5", "B8_T1", "B8_T5", "B1_T9"}  # B1_T9: --tree-widths
    assert tiny["pass"]["vs_B1_T1"]["B1_T1"] == 1.0
    assert tiny["pass"]["vs_B1_T1"]["B1_T9"] == pytest.approx(tiny["pass"]["ms"]["B1_T9"] / tiny["pass"]["ms"]["B1_T1"])
    assert all(ms > 0 for ms in tiny["pass"]["ms"].values())
    assert all(len(v) == 8 for v in tiny["pass"]["all_ms"].values())  # 4 x --reps (2 in a dry run)

    e2e = tiny["e2e"]
    assert set(e2e) == {"plain", "plain_min_pass_tokens2", "synthetic_tau1", "synthetic_tau2", "synthetic_tau3",
                        "synthetic_tau4"}
    assert e2e["plain"]["synthetic"] is False and e2e["plain"]["tau"] == 1.0
    assert (e2e["plain"]["min_pass_tokens"], e2e["plain_min_pass_tokens2"]["min_pass_tokens"]) == (1, 2)
    assert e2e["plain_min_pass_tokens2"]["tau"] == 1.0 and jaxspec.engine.min_pass_tokens() == 1  # restored
    assert 2 in forward_widths  # the padded plain step (the passes timed are 1, 5 and 9 wide)
    assert e2e["synthetic_tau1"]["tau"] == 1.0  # rates 0: exactly one token per verify step
    assert e2e["synthetic_tau1"]["synthetic_acceptance_rates"] == [0.0] * 4
    for tau in (1, 2, 3, 4):
        r = e2e[f"synthetic_tau{tau}"]
        assert r["synthetic"] is True and 1.0 <= r["tau"] <= 5.0 and len(set(r["synthetic_acceptance_rates"])) == 1
    for r in e2e.values():
        assert r["call_tokens_per_s"] > 0 and (r["decode_tokens_per_s"] is None or r["decode_tokens_per_s"] > 0)
        assert [len(v) for v in r["run_s"].values()] == [2, 2]

    hf = tiny["transformers"]
    assert hf["compile"] == "auto" and hf["max_cache_len"] == 512 and "B1" in hf and "B8" not in hf  # --hf-batches 1
    assert hf["B1"]["ms_per_step"] is None or hf["B1"]["ms_per_step"] > 0
    assert [(g["shape"], g["goal"], g["limit"]) for g in rec["goals"]] == [
        ("tiny", "pass_vs_floor", 1.15), ("tiny", "verify_vs_decode", 1.05), ("tiny", "plain_vs_hf", 1.5)]
    assert "goals (dry run on CPU: not meaningful):" in printed and "SYNTHETIC tau 4" in printed


def test_hlo_summary_counts_kernels(bench_module):
    """``--hlo-summary``'s parser on a hand-written optimized-HLO excerpt (the text forms XLA:GPU
    prints: a cuBLAS custom call, fusions of two kinds, a Triton GEMM's backend config)."""
    accelerator = bench_module("accelerator")
    text = "\n".join([
        '%gemm = (bf16[1,4096]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"',
        "%f1 = bf16[8]{0} fusion(%x), kind=kLoop, calls=%fused_1",
        "%f2 = bf16[8]{0} fusion(%y), kind=kInput, calls=%fused_2",
        '%f3 = bf16[2,4096]{1,0} fusion(%p, %q), kind=kCustom, calls=%gemm_fusion, backend_config={"fusion_backend_config":'
        '{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"128","split_k":"4",'
        '"num_stages":"3","num_warps":"4","num_ctas":"1"}}}',
        "%f4 = bf16[8]{0} fusion(%z), kind=kLoop, calls=%fused_3",
    ])
    assert accelerator.hlo_summary(text) == {
        "custom_calls": {"__cublas$gemm": 1},
        "fusion_kinds": {"kLoop": 2, "kInput": 1, "kCustom": 1},
        "triton_gemm_configs": {"block_m=16,block_n=64,block_k=128,split_k=4": 1},
    }
