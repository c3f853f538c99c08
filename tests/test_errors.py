"""Invariant 7 (docs/design.md): bad input gets a clear error naming the argument and the limit, before any
compile (``api._jitted`` is patched to fail if reached)."""

import jax
import pytest

import jaxspec
from jaxspec import api
from jaxspec import models

CFG = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                          max_position=128, eos_ids=(1,))
DRAFT_CFG = jaxspec.ModelConfig(vocab_size=80, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32)


@pytest.fixture(scope="module")
def params():
    return models.init_params(CFG, jax.random.key(0))


@pytest.fixture(autouse=True)
def no_compile(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("reached compilation: the error must come before")

    monkeypatch.setattr(api, "_jitted", fail)


@pytest.mark.parametrize(
    "prompt, match",
    [("", "prompt 0 is empty"), ([], "empty"), ([[]], "prompt 0 is empty"), ([[3, 4], []], "prompt 1 is empty"),
     ([3, 64], "token id 64 outside the vocabulary \\[0, 64\\)"), ([-1], "token id -1")],
)
def test_bad_prompt(params, prompt, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(params, prompt, config=CFG, max_new_tokens=8)


def test_text_prompt_without_tokenizer(params):
    with pytest.raises(ValueError, match="no tokenizer"):
        jaxspec.generate(params, "hello", config=CFG)


def test_prompt_plus_new_tokens_over_context(params):
    with pytest.raises(ValueError, match=r"prompt \(100 tokens\) \+ max_new_tokens \(29\) = 129 exceeds max_len \(128"):
        jaxspec.generate(params, [[5] * 100], config=CFG, max_new_tokens=29)
    with pytest.raises(ValueError, match=r"exceeds max_len \(50\)"):
        jaxspec.generate(params, [[5] * 30], config=CFG, max_new_tokens=21, max_len=50)


def test_max_len_beyond_the_models_context(params, monkeypatch):
    """A max_len past the model's 128 positions is refused unless explicitly allowed (as
    vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN); allowed, the request reaches compilation."""
    with pytest.raises(ValueError, match=r"max_len \(200\) exceeds the context of .* \(128 positions\).*allow_long_context"):
        jaxspec.generate(params, [[5] * 100], config=CFG, max_new_tokens=50, max_len=200)
    with pytest.raises(AssertionError, match="reached compilation"):
        jaxspec.generate(params, [[5] * 100], config=CFG, max_new_tokens=50, max_len=200, allow_long_context=True)


@pytest.mark.parametrize("value", [0, -3])
def test_max_new_tokens_below_one(params, value):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer in \[1, 2\*\*31 - 1\], got "):
        jaxspec.generate(params, [3], config=CFG, max_new_tokens=value)


@pytest.mark.parametrize("value", [-0.5, float("nan"), [1.0, -1.0]])
def test_bad_temperature(params, value):
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        jaxspec.generate(params, [[3], [4]], config=CFG, temperature=value, max_new_tokens=8)


def test_missing_config(params):
    with pytest.raises(ValueError, match="config is required"):
        jaxspec.generate(params, [3])


@pytest.mark.parametrize(
    "make",
    [lambda: jaxspec.NGramDrafter(gamma=0), lambda: jaxspec.ModelDrafter(DRAFT_CFG, gamma=0),
     lambda: jaxspec.EarlyExitDrafter(CFG, n_layers=1, gamma=-1)],
)
def test_gamma_below_one(make):
    with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
        make()


@pytest.mark.parametrize("confidence", [1.0, -0.1, 2, True, "0.3"])
def test_confidence_out_of_range(confidence):
    with pytest.raises(ValueError, match=r"confidence must be a number in \[0, 1\)"):
        jaxspec.ModelDrafter(DRAFT_CFG, confidence=confidence)


def test_confidence_with_a_tree():
    with pytest.raises(ValueError, match=r"confidence applies to chains \(tree_nodes=0\).*tree_nodes=4"):
        jaxspec.EarlyExitDrafter(CFG, n_layers=1, gamma=2, tree_nodes=4, branching=2, confidence=0.3)


def test_early_exit_layers_out_of_range():
    with pytest.raises(ValueError, match=r"n_layers for early exit must be in \[1, 1\]"):
        jaxspec.EarlyExitDrafter(CFG, n_layers=2)


def test_ngram_sizes():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        jaxspec.NGramDrafter(gamma=2, max_n=1, min_n=2)


def test_draft_vocabulary_mismatch(params):
    draft = models.init_params(DRAFT_CFG, jax.random.key(1))
    with pytest.raises(ValueError, match=r"vocabulary \(80 tokens.*differs from the target's \(64 tokens"):
        jaxspec.generate(params, [3], config=CFG, drafter=jaxspec.ModelDrafter(DRAFT_CFG), drafter_params=draft,
                         max_new_tokens=8)


def test_draft_model_without_params(params):
    same_vocab = jaxspec.ModelConfig(**{**DRAFT_CFG.__dict__, "vocab_size": 64})
    with pytest.raises(ValueError, match="needs drafter_params"):
        jaxspec.generate(params, [3], config=CFG, drafter=jaxspec.ModelDrafter(same_vocab), max_new_tokens=8)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'llama-9000'.*smollm2-135m"):
        jaxspec.load("llama-9000")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        jaxspec.load(str(path))


def test_unreadable_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ValueError, match="garbage.gguf"):
        jaxspec.load(str(path))


def test_stop_id_outside_vocabulary(params):
    with pytest.raises(ValueError, match=r"stop_token_ids has token id 64 outside the vocabulary \[0, 64\)"):
        jaxspec.generate(params, [3], config=CFG, max_new_tokens=8, stop_token_ids=(1, 64))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"prompt": 5}, "got the scalar 5"), ({"prompt": [1.0, 2.0]}, "integer token ids"),
     ({"prompt": [[3], [4]], "temperature": [0.5, 0.5, 0.5]}, r"one value or one per prompt \(2\)"),
     ({"prompt": [3], "seed": 1.5}, "seed must be an int"),
     ({"prompt": [3], "drafter": jaxspec.NGramDrafter}, "an instance"),
     ({"prompt": [3], "max_new_tokens": True}, "max_new_tokens must be an integer")],
)
def test_bad_argument_types(params, kwargs, match):
    kwargs.setdefault("max_new_tokens", 8)
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(params, config=CFG, **kwargs)


def test_drafter_construction_limits():
    with pytest.raises(ValueError, match=r"max_n <= 16"):
        jaxspec.NGramDrafter(gamma=2, max_n=17)
    with pytest.raises(ValueError, match="n_layers for early exit"):
        jaxspec.EarlyExitDrafter(CFG, n_layers=1.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 2**32 + 3}, r"max_new_tokens must be an integer in \[1, 2\*\*31 - 1\], got 4294967299"),
    ({"max_new_tokens": 2**40}, r"max_new_tokens must be an integer in \[1, 2\*\*31 - 1\]"),
    ({"max_new_tokens": 2**31}, r"max_new_tokens must be an integer in \[1, 2\*\*31 - 1\], got 2147483648"),
    ({"max_new_tokens": [8, 2**32 + 3]}, r"max_new_tokens must be an integer in \[1, 2\*\*31 - 1\], got 4294967299"),
    ({"max_new_tokens": 2**31 - 1}, r"prompt \(1 tokens\) \+ max_new_tokens \(2147483647\) = 2147483648 exceeds"),
    ({"min_new_tokens": 2**31}, r"min_new_tokens must be an integer in \[0, 2\*\*31 - 1\]"),
    ({"top_k": 2**32 + 1}, r"top_k must be an integer in \[0, 2\*\*31 - 1\] \(0 = off\), got 4294967297"),
    ({"seed": 2**32}, r"seed must be an integer in \[0, 2\*\*32 - 1\], got 4294967296"),
    ({"seed": [0, 2**64]}, r"seed must be an integer in \[0, 2\*\*32 - 1\]"),
    ({"temperature": 1e39}, r"temperature must be finite and >= 0 in float32, as it runs: 1e\+39 is inf"),
    ({"top_p": 1e-50}, r"top_p must be finite and in \(0, 1\] in float32"),
    ({"max_len": 2**31}, r"max_len must be None or an integer in \[1, 2\*\*31 - 1\], got 2147483648"),
    ({"max_len": "100"}, r"max_len must be None or an integer"),
    ({"max_len": 2**31 - 1, "allow_long_context": True, "max_new_tokens": 2**31 - 100},
     r"cache would need 2147483648 slots .* over 2\*\*31 - 1 \(int32 positions\)"),
])
def test_numbers_are_checked_before_they_wrap(params, kwargs, match):
    """Integers run as int32 (the seed as uint32) and floats as float32: a value that would
    wrap or round out of range is refused with its name and range, not run as another."""
    kwargs = {"max_new_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(params, [[3], [4]] if isinstance(kwargs.get("seed"), list) else [3], config=CFG, **kwargs)


@pytest.mark.parametrize("prompt, match", [
    (b"hello", r"prompt must be a str, a list of token ids .*got a bytes.*decode"),
    (bytearray(b"hello"), "prompt must be a str.*got a bytearray"),
    ([b"hi"], "prompt 0 must be a str.*got bytes"),
    ({"text": "hi"}, "prompt must be a str.*got a dict"),
    (None, "prompt must be a str.*got a NoneType"),
])
def test_prompt_of_another_type(params, prompt, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(params, prompt, config=CFG, max_new_tokens=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"drafter": "ngram"}, r"drafter must be None or a drafter instance, e.g. jaxspec.NGramDrafter\(gamma=4\) "
                           r"\(one of .*jaxspec.EagleDrafter.*jaxspec.RepeatDrafter\), got a str: 'ngram'"),
    ({"sampling": "greedy"}, r"sampling must be a jaxspec.SamplingConfig \(or None\), got a str"),
    ({"chat": "no"}, "chat must be True or False, got 'no'"),
    ({"allow_long_context": 1}, "allow_long_context must be True or False"),
])
def test_arguments_of_another_type(params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(params, [3], config=CFG, max_new_tokens=8, **kwargs)


def test_model_given_by_name():
    with pytest.raises(ValueError, match=r"model must be a jaxspec.Model .*jaxspec.load\('smollm2-135m'\)"):
        jaxspec.generate("smollm2-135m", "x", max_new_tokens=8)


@pytest.mark.parametrize("kwargs, match", [
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),
    ({"include_stop_str_in_output": 5}, "include_stop_str_in_output must be True or False, got 5"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop_token_ids": None}, "stop_token_ids must be a token id or a list of them"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids must be a token id or a list of them"),
    ({"max_new_tokens": [8, True]}, "max_new_tokens must be an integer"),
    ({"temperature": 1j}, "temperature must be a number >= 0"),
    ({"n": 2**31}, r"n \(samples per prompt\) must be an integer in \[1, 2\*\*31 - 1\]"),
    ({"min_new_tokens": [1, 2], "max_new_tokens": [8, 8, 8]}, "min_new_tokens has 2 values and max_new_tokens 3"),
])
def test_sampling_config_types(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.SamplingConfig(**kwargs)


@pytest.fixture
def no_reading(monkeypatch):
    """``load``'s argument checks must come before the (slow) resolving and reading."""
    from jaxspec.checkpoints import loading

    def fail(*args, **kwargs):
        raise AssertionError("reached resolving the checkpoint: the error must come before")

    monkeypatch.setattr(loading, "resolve", fail)


@pytest.mark.parametrize("dtype", ["int8", "float16", jax.numpy.int8, "no-such-dtype"])
def test_load_dtype(no_reading, dtype):
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
        jaxspec.load("smollm2-135m", dtype=dtype)


@pytest.mark.parametrize("name", [123, None, b"smollm2-135m"])
def test_load_name_of_another_type(no_reading, name):
    with pytest.raises(ValueError, match=r"name_or_path must be a model name \(one of \[.*'smollm2-135m'\]\) or a path"):
        jaxspec.load(name)


def test_load_docstring_lists_every_packaged_model():
    from jaxspec.checkpoints import packaged

    assert all(f'"{name}"' in jaxspec.load.__doc__ for name in packaged.MODELS)


def test_arguments_that_would_be_ignored(params):
    """config= with a Model (it carries its own), a tokenizer that is not a jaxspec Tokenizer and
    drafter_params without a drafter are refused, not silently ignored (a fresh user's findings)."""
    import dataclasses

    model = jaxspec.Model(params, CFG)
    with pytest.raises(ValueError, match="config is for a bare params pytree: a Model carries its own config"):
        jaxspec.generate(model, [3], config=dataclasses.replace(CFG, n_layers=CFG.n_layers + 1), max_new_tokens=8)
    with pytest.raises(ValueError, match=r"config must be a jaxspec.ModelConfig or a target model .* got a str: "
                                         r"'garbage' \(it lacks name, vocab_size"):
        jaxspec.generate(params, [3], config="garbage", max_new_tokens=8)
    with pytest.raises(ValueError, match="tokenizer must be a jaxspec Tokenizer .* got a str: 'abc'"):
        jaxspec.generate(model, "x", tokenizer="abc", max_new_tokens=8)
    with pytest.raises(ValueError, match="drafter_params given without a drafter"):
        jaxspec.generate(model, [3], drafter_params=params, max_new_tokens=8)


def test_training_without_optax_names_the_extra(monkeypatch, tmp_path):
    """optax is the train extra, not a dependency: train-eagle without it says what to install,
    before reading any model."""
    import importlib.util

    from checkpoints_tools import __main__ as tools

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optax" else real(name, *a))
    with pytest.raises(SystemExit, match=r"train-eagle needs optax.*pip install -e '\.\[train\]'"):
        tools.main(["train-eagle", "--model", "no-such-model", "--out", str(tmp_path / "run")])
