"""Checkpoint formats: orbax round trips, GGUF written by the ``gguf`` package, ``jaxspec.load``
dispatch, restoring onto a mesh and dtype, and the ``checkpoints_tools`` CLI.

Reference logits are transformers' own (``tests/support/hf_tiny.py``). Tolerances: float32 paths use
ATOL = 1e-4 (measured gap <= 3.1e-6, see test_families.py); Q8_0 GGUF uses 0.25: Q8_0 keeps
8 bits per weight (error up to 1/254 of each 32-weight block's max), which moved these
logits (magnitude <= 9) by at most 0.092; a layout error (unpermuted Q/K, missing norm offset)
moves them by > 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.checkpoints import orbax_io
from jaxspec.checkpoints.gguf_writer import write_gguf
from jaxspec.checkpoints.hf import read_hf
from jaxspec.checkpoints.gguf_reader import read_gguf
from jaxspec import models

pytest.importorskip("transformers")
from support.hf_tiny import FAMILIES, TOKENS  # noqa: E402

ATOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logits(params, cfg):
    t = len(TOKENS)
    cache = KVCache.zeros(cfg, 1, 32, jnp.float32)
    out = models.forward(params, cfg, jnp.asarray([TOKENS], jnp.int32), jnp.arange(t)[None], cache).logits
    return np.asarray(out[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_orbax_round_trip(tiny_hf, tmp_path, family):
    path, ref = tiny_hf(family)
    params, cfg = read_hf(path, dtype=jnp.float32)
    orbax_io.save(str(tmp_path / "ckpt"), params, cfg)
    restored, cfg2, _ = orbax_io.restore(str(tmp_path / "ckpt"))
    assert cfg2 == cfg
    np.testing.assert_allclose(logits(restored, cfg2), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_written_by_gguf_package(tiny_hf, tmp_path, family):
    path, ref = tiny_hf(family)
    params, cfg = read_hf(path, dtype=jnp.float32)
    write_gguf(str(tmp_path / "m.gguf"), params, cfg)
    params2, cfg2, _ = read_gguf(str(tmp_path / "m.gguf"), dtype=jnp.float32)
    assert cfg2.layer_types == cfg.layer_types and cfg2.sliding_window == cfg.sliding_window
    if family == "llama3_scaled":  # stored as llama.cpp does: a rope_freqs tensor of divisors
        assert cfg2.rope_scaling.kind == "factors" and max(cfg2.rope_scaling.factors) == 8.0
    np.testing.assert_allclose(logits(params2, cfg2), ref, atol=ATOL, rtol=0)


def test_gguf_q8_0(tiny_hf, tmp_path):
    path, ref = tiny_hf("gemma3")
    params, cfg = read_hf(path, dtype=jnp.float32)
    write_gguf(str(tmp_path / "q8.gguf"), params, cfg, quantization="Q8_0")
    params2, cfg2, _ = read_gguf(str(tmp_path / "q8.gguf"), dtype=jnp.float32)
    err = np.abs(logits(params2, cfg2) - ref).max()
    assert 1e-4 < err < 0.25  # really quantized, and still the same model


def test_gguf_writer_refuses_scaling_without_gguf_form(tiny_hf, tmp_path):
    import dataclasses

    from jaxspec.config import RopeScaling

    params, cfg = read_hf(tiny_hf("llama")[0], dtype=jnp.float32)
    cfg = dataclasses.replace(cfg, rope_scaling=RopeScaling("linear", 2.0))
    with pytest.raises(ValueError, match="linear RoPE scaling of a llama model has no GGUF form"):
        write_gguf(str(tmp_path / "m.gguf"), params, cfg)


def test_load_dispatch_and_dtype(tiny_hf, tmp_path):
    """``jaxspec.load`` takes an HF dir, a GGUF file and an orbax dir; orbax restores in the dtype asked."""
    path, ref = tiny_hf("qwen3")
    hf_model = jaxspec.load(path, dtype=jnp.float32)
    write_gguf(str(tmp_path / "m.gguf"), hf_model.params, hf_model.config)
    orbax_io.save(str(tmp_path / "o"), hf_model.params, hf_model.config)
    for src in (path, str(tmp_path / "m.gguf"), str(tmp_path / "o")):
        m = jaxspec.load(src, dtype=jnp.float32)
        np.testing.assert_allclose(logits(m.params, m.config), ref, atol=ATOL, rtol=0, err_msg=src)
    bf16 = jaxspec.load(str(tmp_path / "o"), dtype=jnp.bfloat16)
    assert {str(x.dtype) for x in __import__("jax").tree_util.tree_leaves(bf16.params)} == {"bfloat16"}


SHARDED = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jaxspec.checkpoints import orbax_io
mesh = jax.make_mesh((4,), ("model",))
params, cfg, _ = orbax_io.restore(sys.argv[1], mesh=mesh, dtype=jnp.bfloat16)
wq = params["layers"][0]["wq"]
print(wq.dtype, tuple(wq.sharding.spec), [s.data.shape for s in wq.addressable_shards][0], tuple(params["layers"][0]["attn_norm"].sharding.spec))
"""


def test_restore_onto_mesh(tiny_hf, tmp_path):
    """Each of 4 devices receives only its column block of wq ([32, 32] -> [32, 8] per device),
    in bfloat16; norms are replicated. Run in a subprocess: the 4 CPU devices must be set
    before jax starts."""
    params, cfg = read_hf(tiny_hf("llama")[0], dtype=jnp.float32)
    orbax_io.save(str(tmp_path / "o"), params, cfg)
    out = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "o")], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "bfloat16 (None, 'model') (32, 8) ()"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "checkpoints_tools", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=600, cwd=ROOT)


def test_cli_convert_inspect_verify(tiny_hf, tmp_path):
    path, ref = tiny_hf("gemma3")
    dst = str(tmp_path / "o")
    r = cli("convert", "--from", "hf", path, "--to", "orbax", dst, "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "peak host memory" in r.stdout
    manifest = json.load(open(os.path.join(dst, "jaxspec.json")))
    assert manifest["source"] == os.path.abspath(path) and manifest["config"]["family"] == "gemma3"
    r = cli("inspect", dst)
    assert r.returncode == 0, r.stderr[-2000:]
    n_params = sum(int(np.prod(v[0])) for v in manifest["tensors"].values())
    assert "architecture:  gemma3" in r.stdout and f"parameters:    {n_params:,} stored" in r.stdout
    assert "sliding window 5 on 2/3 layers" in r.stdout
    r = cli("verify", dst, "--reference", "transformers", "--atol", "1e-4")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    max_abs = float(r.stdout.split("max abs error:")[1].split()[0])
    assert max_abs < 1e-4
    # An existing destination is refused and left alone unless --overwrite.
    before = sorted(os.listdir(dst))
    r = cli("convert", "--from", "hf", path, "--to", "orbax", dst)
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert sorted(os.listdir(dst)) == before
    r = cli("convert", "--from", "hf", path, "--to", "orbax", dst, "--dtype", "bfloat16", "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(v[1] for v in json.load(open(os.path.join(dst, "jaxspec.json")))["tensors"].values()) == {"bfloat16"}


def test_hf_tokenizer_travels_through_orbax(tiny_hf, tmp_path):
    """An HF directory's tokenizer.json / tokenizer_config.json (chat template, BOS/EOS) is loaded
    with the model and copied into the orbax checkpoint by ``convert``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    src = tmp_path / "hf"
    shutil.copytree(tiny_hf("qwen2")[0], src)
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tk = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = Whitespace()
    tk.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    for path in (str(src), orbax_io.save(str(tmp_path / "o"), *read_hf(str(src)), tokenizer_dir=str(src))):
        m = jaxspec.load(path)
        assert (m.tokenizer.bos_id, m.tokenizer.eos_ids, m.tokenizer.vocab_size) == (1, (2,), 64), path
        assert m.tokenizer.encode("w3 w60") == [6, 63]
        assert m.tokenizer.apply_chat_template([{"role": "user", "content": "w5"}]) == "<s>w5"
    # BOS as transformers' encode adds it: tokenizer_config's add_bos_token, else the post-processor
    from tokenizers.processors import TemplateProcessing

    from jaxspec.tokenizer import Tokenizer

    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert Tokenizer.from_hf_dir(src).encode("w3 w60") == [1, 6, 63]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(src / "tokenizer.json"))
    assert Tokenizer.from_hf_dir(src).encode("w3 w60") == [1, 6, 63]
    assert Tokenizer.from_hf_dir(src).encode("w3 w60", add_bos=False) == [6, 63]
