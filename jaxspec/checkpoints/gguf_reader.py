"""Load GGUF checkpoints (architectures llama, qwen2, qwen3, gemma3) into jaxspec's params layout.

The params pytree follows Hugging Face conventions (``x @ W`` with ``W`` stored ``[in, out]``,
Q/K projections in the "rotate_half" RoPE layout)::

    params = {
      "embed": [V, D],
      "layers": [  # python list, one dict per decoder block
         {"attn_norm": [D], "wq": [D, H*hd], "wk": [D, KV*hd], "wv": [D, KV*hd], "wo": [H*hd, D],
          "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}, ...],
      "final_norm": [D],
      "lm_head": [D, V],   # only when the checkpoint does not tie embeddings
    }

RMSNorm weights are plain multipliers (``x * rsqrt(mean(x^2) + eps) * w``, Llama style);
Gemma's are ``1 + w`` in the model, stored as ``1 + w`` by llama.cpp and as ``w`` by Hugging Face
and here (``ModelConfig.norm_offset = 1``), so the reader subtracts 1 like transformers'
``Gemma2TensorProcessor``. Tensor names come from ``jaxspec.checkpoints.names``.

GGUF (llama.cpp) stores ``attn_q`` / ``attn_k`` with the rows of every head permuted for
llama.cpp's interleaved (GPT-J style) RoPE; :func:`read_gguf` undoes that permutation exactly
as transformers' GGUF loader does (``reverse_permute_weights``), so the loaded weights pair
dimension ``i`` with ``i + hd/2`` like Hugging Face's ``rotate_half``.

Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized with
``gguf.quants.dequantize`` one tensor at a time to float32 numpy, then cast to the requested
dtype, so peak host memory stays near one float32 copy of the model.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxspec.config import ModelConfig, RopeScaling, default_dtype

__all__ = ["read_gguf", "read_gguf_metadata"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
GEMMA3_SLIDING_PATTERN = 6  # every 6th block is global (llama.cpp and transformers' default)


def _open_reader(path: str | os.PathLike):
    """Open a GGUFReader, turning every failure into an error that names the path."""
    import gguf

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"GGUF path is not a regular file: {path!r}")
    size = os.path.getsize(path)
    if size < 24:
        raise ValueError(f"{path!r} is not a valid GGUF file: only {size} bytes (truncated or empty)")
    try:
        reader = _checked_reader(gguf)(path, "r")
    except _TensorOutOfFile as e:
        raise ValueError(f"{path!r} is truncated or corrupt: {e}") from None
    except PermissionError as e:
        raise PermissionError(f"cannot read GGUF file {path!r}: {e}") from e
    except Exception as e:  # gguf raises ValueError/KeyError/IndexError/UnicodeError on bad bytes
        raise ValueError(f"{path!r} is not a valid GGUF file (corrupt or truncated): {type(e).__name__}: {e}") from e
    # A truncated file can parse its header yet hold short tensor data.
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or int(t.data.nbytes) != int(t.n_bytes):
            raise ValueError(
                f"{path!r} is truncated or corrupt: tensor {t.name!r} needs bytes "
                f"[{t.data_offset}, {end}) but the file has {size} bytes"
            )
    return reader


class _TensorOutOfFile(Exception):
    """A tensor's data range ends past the end of the file (message names the tensor)."""


def _checked_reader(gguf):
    """``gguf.GGUFReader`` that checks each tensor's byte range against the file size before
    the reader slices and reshapes its data: a file cut in the middle of the tensor data then
    names the first tensor that does not fit, instead of numpy's "cannot reshape array"."""

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_dtype, offset = field.parts
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                begin = int(start_offs + offset[0])
                end = begin + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise _TensorOutOfFile(f"tensor {bytes(name).decode('utf-8', 'replace')!r} needs bytes "
                                           f"[{begin}, {end}) but the file has {size} bytes")
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def _field_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _metadata_from_reader(reader, path: str) -> dict[str, Any]:
    from jaxspec.chat_templates import fill_gaps

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except Exception as e:
            raise ValueError(f"{path!r}: cannot decode metadata field {key!r}: {type(e).__name__}: {e}") from e
    return fill_gaps(meta)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read only the key/value metadata of a GGUF file (no tensor is dequantized).

    Args:
      path: path to a ``.gguf`` file.

    Returns:
      dict mapping GGUF keys (e.g. ``"llama.block_count"``, ``"tokenizer.ggml.tokens"``) to
      Python values (int, float, bool, str, or lists of them).

    Raises:
      FileNotFoundError: ``path`` does not exist (message names the path).
      ValueError: the file is not a readable GGUF (bad magic, truncated, corrupt); the message
        names the path.
    """
    path = os.fspath(path)
    return _metadata_from_reader(_open_reader(path), path)


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (Llama 3.1 scaling)


def _vocabulary(meta: dict[str, Any], arch: str, path: str) -> tuple[int, list[int]]:
    """``(vocab_size, eos_ids)``: the vocabulary's size (its tokens, else ``{arch}.vocab_size``)
    and the EOS, EOT and EOM ids, each once."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens)
    elif f"{arch}.vocab_size" in meta:
        vocab_size = int(meta[f"{arch}.vocab_size"])
    else:
        raise ValueError(f"{path!r}: cannot determine vocab size (no tokenizer.ggml.tokens, no {arch}.vocab_size)")
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(meta[key]) not in eos_ids:
            eos_ids.append(int(meta[key]))
    return vocab_size, eos_ids


def _gemma3_switches(meta: dict[str, Any], n_layers: int, dim: int, head_dim: int, window: int, pattern) -> dict:
    """Gemma 3's ``ModelConfig`` switches: offset norms, sandwich norms, GELU, the embedding
    scale, the attention scale, sliding layers (llama.cpp's per-layer pattern, or every
    ``GEMMA3_SLIDING_PATTERN``-th layer full), the local RoPE base and the logit soft cap."""
    arch = "gemma3"
    if isinstance(pattern, list):  # one bool per layer, True = sliding (llama.cpp's swa_layers)
        types = tuple("sliding" if p else "full" for p in pattern)
    else:
        every = int(pattern or GEMMA3_SLIDING_PATTERN)
        types = tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(n_layers))
    return {
        "norm_offset": 1.0, "sandwich_norms": True, "activation": "gelu_tanh",
        "embed_scale": float(np.float32(np.sqrt(dim))),
        "attn_scale": _f32_to_float(meta.get(f"{arch}.attention.scale", float(head_dim) ** -0.5)),
        "sliding_window": window, "layer_types": types,
        "rope_local_theta": _f32_to_float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "final_softcap": _f32_to_float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    }


def _config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata; ``tensors`` (name -> ReaderTensor) decides tied
    embeddings and supplies ``rope_freqs.weight`` when present."""
    tensor_names = set(tensors)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path!r}: unsupported GGUF architecture {arch!r}; jaxspec.checkpoints.gguf_reader supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"{path!r}: GGUF metadata is missing required key {full!r}")
        return meta[full]

    dim = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", dim // n_heads))
    value_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{path!r}: key_length {head_dim} != value_length {value_dim} is not supported")
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"{path!r}: partial RoPE (rope.dimension_count={rope_dims}, head_dim={head_dim}) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if scaling not in ("none", "") and factor != 1.0 and not (arch == "gemma3" and scaling == "linear"):
        raise ValueError(f"{path!r}: RoPE scaling ({scaling!r}, factor {factor}) is not supported by ModelConfig")
    rope_factors = None
    if ROPE_FREQS in tensors:
        factors = _dequantize(tensors[ROPE_FREQS], path).reshape(-1)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"{path!r}: tensor {ROPE_FREQS!r} has shape {factors.shape}, expected ({head_dim // 2},)")
        rope_factors = RopeScaling("factors", 1.0, factors=tuple(factors.tolist()))

    vocab_size, eos_ids = _vocabulary(meta, arch, path)
    switches: dict[str, Any] = dict(family=arch, rope_scaling=rope_factors, attn_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "gemma3"))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    if arch == "llama" and window:
        switches["sliding_window"] = window
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if arch == "gemma3":
        switches.update(_gemma3_switches(meta, int(need("block_count")), dim, head_dim, window, pattern))
        if scaling == "linear" and factor != 1.0:
            switches["rope_scaling"] = RopeScaling("linear", factor)
    return ModelConfig(
        **switches,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")),
        rope_theta=_f32_to_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=_f32_to_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        max_position=int(meta.get(f"{arch}.context_length", 8192)),
        bos_id=int(meta.get("tokenizer.ggml.bos_token_id", -1)),
        eos_ids=tuple(eos_ids),
        name=str(meta.get("general.name", arch)),
    )


def _f32_to_float(x) -> float:
    """GGUF stores float32; return the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(x)))


def _reverse_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> HF rotate_half).

    ``w`` is ``[n_heads * hd, in]`` (torch ``[out, in]`` layout); same as transformers'
    ``reverse_permute_weights``.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_DEQUANT_ROWS = 4096


def _dequantize(tensor, path: str) -> np.ndarray:
    """GGUF tensor -> float32 numpy in torch layout (numpy shape = reversed GGUF dims)."""
    from gguf import GGMLQuantizationType, quants

    try:
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                  GGMLQuantizationType.F64):
            out = np.asarray(tensor.data, dtype=np.float32)
        elif tensor.data.ndim == 2 and tensor.data.shape[0] > _DEQUANT_ROWS:
            # Quantized rows in chunks: the transient float32 copies stay a few MB, not a few
            # times the tensor (Gemma 3's [262144, 640] embedding).
            data = tensor.data
            out = np.empty((data.shape[0], int(tensor.shape[0])), np.float32)
            for start in range(0, data.shape[0], _DEQUANT_ROWS):
                out[start:start + _DEQUANT_ROWS] = quants.dequantize(data[start:start + _DEQUANT_ROWS], tensor.tensor_type)
        else:  # quantized blocks, BF16, ...
            out = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError as e:
        raise ValueError(
            f"{path!r}: tensor {tensor.name!r} has quantization type {tensor.tensor_type.name}, which "
            f"gguf {_gguf_version()} cannot dequantize: {e}"
        ) from e
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    if out.shape != shape:
        out = out.reshape(shape)
    return out


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:
        return "?"


def read_gguf(path: str | os.PathLike, dtype=None, put=None) -> tuple[dict, ModelConfig, dict[str, Any]]:
    """Load a GGUF file into jaxspec's params layout, one tensor at a time.

    Args:
      path: path to a ``.gguf`` file whose ``general.architecture`` is ``llama`` (Llama 1/2/3
        with Llama 3.1 scaling as a ``rope_freqs`` tensor, Mistral, SmolLM/SmolLM2, TinyLlama, ...), ``qwen2``, ``qwen3`` or
        ``gemma3`` (text).
      dtype: dtype of every returned array (anything ``jnp.asarray`` accepts). Default:
        ``float32`` when ``jax.default_backend() == "cpu"`` else ``bfloat16``.
      put: ``fn(spec, float32 numpy array) -> leaf``; default ``jnp.asarray(arr, dtype)``.
        Converters pass ``jaxspec.checkpoints.orbax_io.cpu_put(dtype)``.

    Returns:
      ``(params, config, metadata)``:
        * params: pytree (dtype ``dtype``) in the ``jaxspec.models.decoder`` layout; ``"embed"``
          is ``[V, D]``, per-layer projections are ``[in, out]``, ``"lm_head"`` ``[D, V]`` only
          when the file has an ``output.weight`` tensor.
        * config: :class:`jaxspec.config.ModelConfig` built from the ``<arch>.*`` metadata;
          ``vocab_size`` is the tokenizer vocabulary length, ``tie_embeddings`` is True iff
          there is no ``output.weight``, ``eos_ids`` holds ``tokenizer.ggml.eos_token_id`` (and
          ``eot``/``eom`` ids when present).
        * metadata: every GGUF key/value (see :func:`read_gguf_metadata`); pass it to
          ``jaxspec.tokenizer.Tokenizer.from_metadata`` to avoid re-reading the file.

    Raises:
      FileNotFoundError: ``path`` does not exist (message names the path).
      ValueError: not a GGUF / truncated / corrupt file, unsupported architecture (message names
        the path and the architecture), missing required metadata, missing or mis-shaped tensors
        (message names the tensor), unsupported RoPE scaling or quantization type.
    """
    import jax.numpy as jnp

    from jaxspec.checkpoints import names

    path = os.fspath(path)
    reader = _open_reader(path)
    meta = _metadata_from_reader(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    # The reader keeps a numpy view per vocabulary string (~700 MB for Gemma's 262k tokens);
    # the values are in ``meta`` now, so drop them before the tensors are dequantized.
    reader.fields.clear()
    cfg = _config_from_metadata(meta, tensors, path)
    dtype = default_dtype() if dtype is None else dtype
    put = put or (lambda spec, arr: jnp.asarray(arr, dtype=dtype))
    arch = meta.get("general.architecture")

    specs = names.tensor_specs(cfg)
    unexpected = sorted(set(tensors) - {s.gguf for s in specs} - {ROPE_FREQS})
    if unexpected:
        raise ValueError(
            f"{path!r}: unexpected tensors for a {arch} model (e.g. biases or extra heads): "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    params = names.empty_params(cfg)
    for spec in specs:
        if spec.gguf not in tensors:
            raise ValueError(f"{path!r}: missing tensor {spec.gguf!r} (architecture {arch!r})")
        w = _dequantize(tensors[spec.gguf], path)
        if w.shape != spec.stored_shape:
            raise ValueError(f"{path!r}: tensor {spec.gguf!r} has shape {w.shape}, expected {spec.stored_shape} for {cfg.name}")
        if arch == "llama" and spec.key in ("wq", "wk"):
            w = _reverse_permute(w, cfg.n_heads if spec.key == "wq" else cfg.n_kv_heads)
        if cfg.norm_offset and spec.is_norm:
            w = w - np.float32(cfg.norm_offset)
        names.set_leaf(params, spec.path, put(spec, np.ascontiguousarray(w.T) if spec.transposed else w))
    return params, cfg, meta
