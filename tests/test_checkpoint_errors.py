"""Corrupt and mismatched checkpoints: each a clear error naming the file and the tensor, raised
while loading (before anything compiles), and nothing written over an existing destination
unless asked. Also draft/target pairing checks."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoints import orbax_io
from jaxspec.checkpoints.gguf_writer import write_gguf
from jaxspec.checkpoints.hf import read_hf
from jaxspec.checkpoints.gguf_reader import read_gguf
from jaxspec import models

pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

CFG = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                          name="tiny-a")


@pytest.fixture
def hf_copy(tiny_hf, tmp_path):
    """A writable copy of the tiny Llama checkpoint and its tensors as numpy."""
    dst = tmp_path / "hf"
    shutil.copytree(tiny_hf("llama")[0], dst)
    return dst, dict(safetensors_numpy.load_file(str(dst / "model.safetensors")))


def test_truncated_safetensors(hf_copy):
    path, _ = hf_copy
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: os.path.getsize(file) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt.*: tensor '[\w.]+' needs bytes up to"):
        read_hf(str(path))


def test_missing_tensor(hf_copy):
    path, tensors = hf_copy
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        read_hf(str(path))


def test_wrong_shape(hf_copy):
    path, tensors = hf_copy
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.layers\.0\.self_attn\.k_proj\.weight' has "
                                         r"shape \(8, 32\), expected \(16, 32\)"):
        read_hf(str(path))


def test_unexpected_tensor(hf_copy):
    path, tensors = hf_copy
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros((32,), np.float32)
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensors.*o_proj\.bias"):
        read_hf(str(path))


def test_unsupported_hf_architecture(hf_copy):
    path, _ = hf_copy
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported architecture model_type='gpt2'"):
        jaxspec.load(str(path))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"phi\.gguf.*unsupported GGUF architecture 'phi3'"):
        read_gguf(str(tmp_path / "phi.gguf"))


def test_unsupported_quantization(tmp_path):
    """A tensor stored as Q8_1 (which gguf cannot dequantize): the error names file, tensor, type."""
    import gguf

    params = models.init_params(CFG, jax.random.key(0))
    path = str(tmp_path / "m.gguf")
    write_gguf(path, params, CFG)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            v = field.contents()
            w.add_uint32(key, v) if isinstance(v, int) else w.add_float32(key, v)
    q81 = gguf.GGMLQuantizationType.Q8_1
    for t in reader.tensors:
        arr = np.asarray(t.data).reshape(tuple(reversed([int(d) for d in t.shape])))
        if t.name == "blk.1.ffn_up.weight":  # [48, 32]: one 40-byte Q8_1 block per row
            w.add_tensor(t.name, np.zeros((48, 40), np.uint8), raw_dtype=q81)
        else:
            w.add_tensor(t.name, arr)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"q\.gguf.*tensor 'blk\.1\.ffn_up\.weight' has quantization type Q8_1"):
        read_gguf(str(tmp_path / "q.gguf"))


def test_truncated_gguf(tmp_path):
    params = models.init_params(CFG, jax.random.key(0))
    path = tmp_path / "m.gguf"
    write_gguf(str(path), params, CFG)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"m\.gguf.*(truncated|corrupt)"):
        jaxspec.load(str(path))


def test_gguf_cut_in_half_names_the_tensor(tmp_path):
    """A GGUF cut in the middle of its tensor data (the header intact) names the file and the
    first tensor that does not fit, with its byte range (not numpy's "cannot reshape")."""
    params = models.init_params(CFG, jax.random.key(0))
    path = tmp_path / "m.gguf"
    write_gguf(str(path), params, CFG)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"m\.gguf.* is truncated or corrupt: tensor '[\w.]+' needs bytes \[\d+, \d+\) "
                                         r"but the file has \d+ bytes"):
        jaxspec.load(str(path))


def test_orbax_dir_from_another_model(tmp_path):
    """params of model B under model A's manifest: the error names the directory and the tensor."""
    other = jaxspec.ModelConfig(**{**CFG.__dict__, "ffn_dim": 40, "name": "tiny-b"})
    orbax_io.save(str(tmp_path / "a"), models.init_params(CFG, jax.random.key(0)), CFG)
    orbax_io.save(str(tmp_path / "b"), models.init_params(other, jax.random.key(1)), other)
    shutil.rmtree(tmp_path / "a" / "params")
    shutil.copytree(tmp_path / "b" / "params", tmp_path / "a" / "params")
    with pytest.raises(ValueError, match=r"a/params.*tensor layers/0/w_gate has shape \(32, 40\).*tiny-a.*\(32, 48\)"):
        jaxspec.load(str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"holds tiny-b, not the expected tiny-a.*ffn_dim"):
        orbax_io.restore(str(tmp_path / "b"), expect=CFG)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(ValueError, match="neither a jaxspec orbax checkpoint"):
        jaxspec.load(str(tmp_path))


def test_existing_destination_is_kept(tmp_path):
    params = models.init_params(CFG, jax.random.key(0))
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists.*overwrite"):
        orbax_io.save(str(dst), params, CFG)
    with pytest.raises(FileExistsError, match="already exists"):
        write_gguf(str(dst / "keep.txt"), params, CFG)
    assert os.listdir(dst) == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    orbax_io.save(str(dst), params, CFG, overwrite=True)
    assert orbax_io.read_manifest(str(dst))["config"] == CFG and not os.path.exists(str(dst) + ".partial")


# ------------------------------------------------------------------ pairing


def test_pairing_vocabulary_sizes():
    draft = jaxspec.ModelConfig(**{**CFG.__dict__, "vocab_size": 80, "name": "tiny-draft"})
    with pytest.raises(ValueError, match=r"vocabulary \(80 tokens, tiny-draft\) differs from the target's \(64 tokens, tiny-a\)"):
        jaxspec.check_pair(CFG, draft)


def test_pairing_special_tokens_before_compile():
    target = jaxspec.ModelConfig(**{**CFG.__dict__, "bos_id": 1, "eos_ids": (2,)})
    draft = jaxspec.ModelConfig(**{**CFG.__dict__, "bos_id": 3, "eos_ids": (2,), "name": "tiny-draft"})
    params = models.init_params(target, jax.random.key(0))
    with pytest.raises(ValueError, match=r"BOS id \(3, tiny-draft\) differs from the target's \(1, tiny-a\)"):
        jaxspec.generate(params, [3], config=target, drafter=jaxspec.ModelDrafter(draft, gamma=2),
                         drafter_params=models.init_params(draft, jax.random.key(1)), max_new_tokens=4)
    draft = jaxspec.ModelConfig(**{**CFG.__dict__, "bos_id": 1, "eos_ids": (5,), "name": "tiny-draft"})
    with pytest.raises(ValueError, match=r"EOS ids \(\[5\], tiny-draft\) share none with the target's \(\[2\]"):
        jaxspec.check_pair(target, draft)


def test_pairing_tokenizer_strings():
    from jaxspec.tokenizer import Tokenizer

    def model(tokens):
        tok = Tokenizer(tokens=tokens, merges=[], name="t")
        return jaxspec.Model(params={}, config=jaxspec.ModelConfig(**{**CFG.__dict__, "vocab_size": len(tokens)}),
                             tokenizer=tok)

    a = [chr(ord("a") + i) for i in range(20)]
    jaxspec.check_pair(model(a), model(a))
    with pytest.raises(ValueError, match=r"token 7 is 'X'.*target's is 'h'"):
        jaxspec.check_pair(model(a), model(a[:7] + ["X"] + a[8:]))
