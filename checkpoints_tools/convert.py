"""``convert``: a GGUF file or Hugging Face directory -> a jaxspec orbax checkpoint.

Streaming: the reader yields one tensor at a time (safetensors memory-maps its file; GGUF
tensors are dequantized one by one); each is cast to ``--dtype`` on the host and placed on the CPU device (never an
accelerator), then orbax writes the tree without compression, at most 1 GB in flight. Peak host memory is therefore one
copy of the model in the target dtype plus one float32 tensor plus the runtime (docs/checkpoints.md,
"Converting, inspecting, verifying").
"""

from __future__ import annotations

import os
import resource
import time

import numpy as np

from jaxspec.checkpoints import hf, orbax_io
from jaxspec.checkpoints.loading import resolve
from jaxspec.checkpoints.gguf_reader import read_gguf

DTYPES = ("float32", "bfloat16")
TOKENIZER_KEYS = ("tokenizer.", "general.name", "general.architecture")


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def convert(src_format: str, src: str, dst: str, dtype: str = "float32", overwrite: bool = False) -> dict:
    """Convert ``src`` (``"gguf"`` file / known name, or ``"hf"`` directory) to orbax at ``dst``.

    ``dst`` is checked before anything is read: an existing ``dst`` is an error unless
    ``overwrite``, and the old one is only replaced once the new one is complete.

    Returns:
      dict: ``dst``, ``config`` name, ``n_params``, ``bytes`` (in ``dtype``), ``seconds``,
      ``peak_rss_mb``.

    Raises:
      FileExistsError: ``dst`` exists and not ``overwrite``.
      ValueError: unknown ``src_format``/``dtype``, or the reader's errors (named file/tensor).
    """
    import jax.numpy as jnp

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"destination {os.path.abspath(dst)!r} already exists; pass --overwrite to replace it")
    t0 = time.perf_counter()
    put = orbax_io.cpu_put(jnp.dtype(dtype))
    if src_format == "gguf":
        path = resolve(src)
        params, config, meta = read_gguf(path, put=put)
        tok = {k: v for k, v in meta.items() if k.startswith(TOKENIZER_KEYS)} if "tokenizer.ggml.model" in meta else None
        written = orbax_io.save(dst, params, config, tokenizer_metadata=tok, overwrite=overwrite, source=os.path.abspath(path))
    elif src_format == "hf":
        params, config = hf.read_hf(src, put=put)
        written = orbax_io.save(dst, params, config, tokenizer_dir=src, overwrite=overwrite, source=os.path.abspath(src))
    else:
        raise ValueError(f"--from must be 'gguf' or 'hf', got {src_format!r}")
    leaves = [x for x in _leaves(params)]
    return {"dst": written, "config": config.name, "n_params": int(sum(x.size for x in leaves)),
            "bytes": int(sum(x.nbytes for x in leaves)), "seconds": time.perf_counter() - t0,
            "peak_rss_mb": peak_rss_mb()}


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _leaves(v)
    else:
        yield np.asarray(tree)
