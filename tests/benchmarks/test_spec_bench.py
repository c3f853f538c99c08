"""``benchmarks/spec_bench.py`` runs end to end on a tiny model pair and writes what it promises.

The pair is written here: a 2-block Llama target and a 1-block draft (random weights, vocabulary
384) saved by transformers itself, with a byte-level BPE tokenizer trained on the Spec-Bench
questions and a ChatML template, so jaxspec (HF directory + ``tokenizer.json``) and
transformers (``from_pretrained``) read the same weights. Nothing here times anything: the
test pins the JSON fields, the Markdown and the plots, and the one invariant a benchmark can
check on random weights: greedy speculative output equals plain output for every question.
"""

from __future__ import annotations

import json
import os

import pytest

import jaxspec.api
import jaxspec.engine
from benchmarks import spec_bench


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
VOCAB = 384
# Short questions, so every chat-templated prompt fits one prompt bucket: one compiled
# program per method and batch size (compiles dominate this test's time).
QUESTIONS = [("writing", "Write a short poem about the sea."), ("writing", "Describe your ideal city in one line."),
             ("translation", "Translate to French: the cat sleeps on the mat."),
             ("translation", "Translate to German: good morning, good night.")]


def write_pair(root) -> tuple[str, str]:
    """Write the tiny target and draft directories under ``root``; return their paths."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(spec_bench.QUESTIONS) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    paths = []
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        path = os.path.join(root, name)
        cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                             bos_token_id=0, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        model.save_pretrained(path, safe_serialization=True)
        tok.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[2], "chat_template": CHATML}, f)
        paths.append(path)
    return paths[0], paths[1]


def test_spec_bench_end_to_end(tmp_path):
    """Greedy at batch sizes 1 and 2 with the draft model and all three transformers methods,
    then sampled at batch 1 in the same process (temperature is data: no new compile). The
    n-gram and early-exit drafters go through the same runner; only the draft model is
    compiled here, to keep this test to 4 compiles (~10 s each on 2 cores)."""
    target, draft = write_pair(str(tmp_path))
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "second turn"]}) + "\n"
                                 for i, (c, t) in enumerate(QUESTIONS)))
    out = str(tmp_path / "res" / "sb")
    # no --categories: every category of the file
    common = ["--model", target, "--draft-model", draft, "--questions", str(questions), "--per-category", "2",
              "--max-new-tokens", "8", "--no-compile-cache", "--prompt-bucket", "128"]
    methods = ["plain", "draft_g2", "hf_plain", "hf_prompt_lookup_g3", "hf_assisted_g2"]
    bucket = jaxspec.request.PROMPT_BUCKET
    assert spec_bench.main(common + ["--batch-sizes", "1,2", "--methods", ",".join(methods), "--out", out]) == 0
    with open(out + ".json") as f:
        res = json.load(f)
    for key in ("command", "machine", "versions", "settings", "definitions", "summary", "rows"):
        assert key in res, key
    assert res["settings"]["prompt_bucket"] == 128 and jaxspec.request.PROMPT_BUCKET == bucket  # for that run only
    assert res["machine"]["cores"] >= 1 and res["machine"]["cpu_model"] is not None
    for pkg in ("jax", "torch", "transformers", "jaxspec_git"):
        assert res["versions"][pkg], pkg
    assert "--batch-sizes 1,2" in res["command"] and "-m benchmarks.spec_bench " in res["command"]
    assert res["summary"]["greedy"] is True
    by_b = res["summary"]["by_batch_size"]
    assert set(by_b) == {"1", "2"}
    assert list(by_b["1"]) == methods
    assert list(by_b["2"]) == ["plain", "draft_g2"]  # transformers' methods run at batch 1 only
    for b in ("1", "2"):
        for name, x in by_b[b].items():
            assert x["questions"] == 4 and set(x["per_category"]) == {"writing", "translation"}, (b, name)
            assert x["mean_accepted_tokens"] >= 1.0 - 1e-9, (b, name)  # every forward adds >= 1 token
        assert by_b[b]["draft_g2"]["identical_to_plain"] == 4  # greedy speculation is lossless
        plain = by_b[b]["plain"]
        assert plain["mean_accepted_tokens"] <= 1.0 and plain["tau"] == 1.0 and plain["median_speedup_vs_plain"] == 1.0
        assert len(by_b[b]["draft_g2"]["acceptance_per_position"]) == 2
    assert 0.0 <= by_b["1"]["hf_plain"]["hf_median_token_agreement"] <= 1.0
    assert by_b["1"]["hf_assisted_g2"]["mean_accepted_tokens"] >= 1.0
    assert [len(r["question_ids"]) for r in res["rows"]] == [1, 1, 1, 1, 2, 2]
    with open(out + ".md") as f:
        md = f.read()
    assert "## Batch size 2" in md and "| translation |" in md and "must not happen" not in md
    for suffix in ("_tau.png", "_acceptance.png", "_speedup_batch.png"):
        assert os.path.getsize(out + suffix) > 1000, suffix

    sampled = str(tmp_path / "res" / "sampled")
    assert spec_bench.main(common + ["--temperature", "0.8", "--methods", "plain,draft_g2,hf_plain,hf_assisted_g2",
                                     "--no-plots", "--reps", "2", "--out", sampled]) == 0
    with open(sampled + ".json") as f:
        res = json.load(f)
    assert res["summary"]["greedy"] is False and res["settings"]["temperature"] == 0.8
    assert res["settings"]["reps"] == 2
    for row in res["rows"]:  # two timed calls each, same seeds: same tokens; the faster one counts
        for name, x in row["methods"].items():
            assert len(x["seconds_reps"]) == 2 and x["reps_identical"] is True, name
            assert x["seconds"] == min(x["seconds_reps"]), name
    assert res["rows"][0]["seeds"] == [0] and res["rows"][-1]["seeds"] == [3]
    assert res["summary"]["by_batch_size"]["1"]["draft_g2"]["mean_accepted_tokens"] >= 1.0


def test_median_run():
    """``--reps``: the run of median time is kept with its own tokens; repeats that differ are flagged."""
    runs = [spec_bench.Run(tokens=[[1, 2]], seconds=s, extra={"i": i}) for i, s in enumerate((3.0, 1.0, 2.0))]
    m = spec_bench.median_run(runs)
    assert m.seconds == 2.0 and m.extra["i"] == 2 and m.extra["seconds_reps"] == [3.0, 1.0, 2.0]
    assert m.extra["reps_identical"] is True
    runs[0] = spec_bench.Run(tokens=[[1, 3]], seconds=3.0)
    assert spec_bench.median_run(runs).extra["reps_identical"] is False
    assert spec_bench.median_run(runs[:1]) is runs[0]


def test_questions_file():
    """The real question file: the first question of each of the 13 categories, first turn."""
    qs = spec_bench.load_questions(spec_bench.QUESTIONS, 1, spec_bench.CATEGORIES)
    assert [q["category"] for q in qs] == list(spec_bench.CATEGORIES)
    assert qs[0]["id"] == "writing-81" and qs[0]["text"].startswith("Compose an engaging travel blog post")


def test_method_names():
    m = spec_bench.parse_method("early_exit_l8_g3_n8_k2")
    assert (m.kind, m.layers, m.gamma, m.tree_nodes, m.branching) == ("early_exit", 8, 3, 8, 2)
    assert spec_bench.parse_method("hf_prompt_lookup_g10").gamma == 10
    m = spec_bench.parse_method("eagle_g4_n8_k2")
    assert (m.kind, m.gamma, m.tree_nodes, m.branching) == ("eagle", 4, 8, 2)
    assert (spec_bench.parse_method("medusa_g3_k2").kind, spec_bench.parse_method("medusa_g3_k2").branching) == (
        "medusa", 2)
    assert spec_bench.parse_method("eagle_g4_c30").confidence == 30
    assert spec_bench.parse_method("plain_xla").kind == "plain_xla"  # plain with XLA's dot: the kernel's A/B
    m = spec_bench.parse_method("ngram_g4@xla_attention")  # one CPU kernel part off: its A/B in one run
    assert (m.name, m.kind, m.gamma, m.xla_part) == ("ngram_g4@xla_attention", "ngram", 4, "attention")
    assert spec_bench.parse_method("ngram_g4").xla_part is None
    m = spec_bench.parse_method("plain@kn")  # the products over plain [K, N] matrices: the panel layout's A/B
    assert (m.kind, m.plain_matrices, m.xla_part) == ("plain", True, None)
    assert spec_bench.parse_method("plain@xla_matmul").plain_matrices and not spec_bench.parse_method("plain").plain_matrices
    for bad in ("ngram_x4", "plain_g4", "plain_xla_g4", "eagle_b2", "medusa_n8", "medusa2", "ngram_g4_c30", "medusa_g4_c30",
                "ngram_g4@attention", "ngram_g4@xla_rope", "plain_xla@xla_matmul", "hf_plain@xla_matmul", "hf_plain@kn",
                "plain_xla@kn"):
        with pytest.raises(ValueError, match="method"):
            spec_bench.parse_method(bad)


def test_drafters_of_method_names():
    """Each jaxspec method name builds the drafter it says (no compile: construction only)."""
    from conftest import DRAFT, TARGET

    import jaxspec

    def build(name):
        return spec_bench.make_drafter(spec_bench.parse_method(name), TARGET, DRAFT, ngram_max=3, ngram_min=2)

    assert build("plain") is None
    assert build("ngram_g4_b2") == jaxspec.NGramDrafter(gamma=4, max_n=3, min_n=2, branches=2)
    assert build("ngram_g16_s4_m12") == jaxspec.NGramDrafter(gamma=16, max_n=3, min_n=2, short_gamma=4, long_match=12)
    assert build("draft_g3_n6_k2") == jaxspec.ModelDrafter(DRAFT, gamma=3, tree_nodes=6, branching=2)
    assert build("early_exit_l1_g2") == jaxspec.EarlyExitDrafter(TARGET, n_layers=1, gamma=2)
    assert build("draft_g4_c25") == jaxspec.ModelDrafter(DRAFT, gamma=4, confidence=0.25)
    # the registry's default, the CLI's (jaxspec.drafters.kinds): a draft model's chain stops below 0.3
    assert build("draft_g4") == jaxspec.ModelDrafter(DRAFT, gamma=4) and build("draft_g4").confidence == 0.3
    assert build("draft_g4_c0").confidence == 0.0
    assert build("early_exit_g2").n_layers == 1  # default: a quarter of the target's blocks, at least 1
    assert build("lookahead_w3_n3_g2") == jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2)
    assert build("lookahead") == jaxspec.LookaheadDrafter()  # the drafter's defaults
    assert build("ngram_draft_g3_c0") == jaxspec.HybridDrafter(jaxspec.NGramDrafter(gamma=3, max_n=3, min_n=2),
                                                               jaxspec.ModelDrafter(DRAFT, gamma=3, confidence=0.0))
    assert spec_bench.parse_method("ngram_draft_g4").needs_draft_model
    with pytest.raises(ValueError, match="lookahead takes the letters _w, _n, _g"):
        spec_bench.parse_method("lookahead_b2")


def test_drafter_registry_options():
    """``jaxspec.drafters.kinds``: one factory, each kind's options and defaults in one place;
    an option a kind does not take, or a missing required one, is an error naming it."""
    from conftest import DRAFT, TARGET

    import jaxspec
    from jaxspec.drafters import kinds

    assert kinds.build("ngram", None) == (jaxspec.NGramDrafter(), None)
    assert kinds.build("early-exit", TARGET)[0].n_layers == 1  # a quarter of 2 blocks, at least 1
    assert kinds.build("model", None, draft=DRAFT)[0].confidence == 0.3
    assert all(kinds.CLASSES[k].kind == k for k in kinds.KINDS)
    with pytest.raises(ValueError, match="the ngram drafter takes the options gamma, max_n"):
        kinds.build("ngram", None, tree_nodes=8)
    with pytest.raises(ValueError, match="the model drafter needs draft="):
        kinds.build("model", None)
    with pytest.raises(ValueError, match="unknown drafter kind 'nope'"):
        kinds.build("nope")


def test_padded_plain_compares_and_records(tmp_path, bench_module, forward_widths):
    """``benchmarks/experiments/padded_plain.py`` on the tiny GGUF target: both settings run (plain steps
    of 1 and of 2 tokens), the padded tokens equal the unpadded ones (greedy, float32 CPU), and
    the JSON records each question."""
    padded_plain = bench_module("experiments.padded_plain")
    target, _ = write_pair(str(tmp_path))
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                                 for i, (c, t) in enumerate(QUESTIONS)))
    out = tmp_path / "padded.json"
    argv = ["--model", target, "--questions", str(questions), "--max-new-tokens", "6", "--reps", "1", "--out", str(out)]
    assert padded_plain.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["category"] for r in res["rows"]] == ["writing", "translation"]  # the first of each category
    assert res["summary"]["2"]["identical_to_unpadded"] == 2 and set(res["summary"]) == {"1", "2"}
    assert all(r["tokens_per_s"]["1"] > 0 and r["tokens_per_s"]["2"] > 0 for r in res["rows"])
    assert "-m benchmarks.experiments.padded_plain " in res["command"] and res["machine"]["backend"] == "cpu"
    assert jaxspec.engine.min_pass_tokens() == 1  # the setting held for the script's calls only
    assert {1, 2} <= set(forward_widths)
