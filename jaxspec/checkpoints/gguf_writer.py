"""Write a jaxspec model as a GGUF file with the ``gguf`` package (llama.cpp's own writer).

The inverse of ``jaxspec.checkpoints.gguf_reader.read_gguf``: the same tensor names (``names.py``), torch
``[out, in]`` layout, llama.cpp's Q/K row permutation for the ``llama`` architecture, Gemma's
norms stored as ``1 + w``, and the metadata keys llama.cpp defines (``gguf.Keys``), including
``attention.sliding_window_pattern`` (one bool per layer, True = sliding),
``rope.freq_base_swa``, ``attention.scale`` and ``final_logit_softcapping``; Llama 3.1 RoPE
scaling becomes llama.cpp's ``rope_freqs.weight`` tensor of per-frequency divisors. Tensors are written
float32 or quantized with ``gguf.quants.quantize`` (e.g. Q8_0). Used by tests and by anyone who
wants to run a jaxspec checkpoint in llama.cpp.
"""

from __future__ import annotations

import os

import numpy as np

from jaxspec.checkpoints import names
from jaxspec.config import ModelConfig

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate_half -> interleaved pairs); the inverse of
    ``gguf_reader._reverse_permute``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, params: dict, config: ModelConfig, *, quantization: str = "F32",
               tokenizer_metadata: dict | None = None, overwrite: bool = False) -> str:
    """Write ``params`` (``config``) as a GGUF file at ``path``.

    Args:
      quantization: ``"F32"`` or a ``gguf.GGMLQuantizationType`` name (``"Q8_0"``...) applied
        to 2-D weights whose rows are a whole number of blocks; the rest (norms, biases, odd
        widths) stay F32, as llama.cpp does.
      tokenizer_metadata: ``tokenizer.*`` keys to copy (e.g. from ``read_gguf``'s metadata).
      overwrite: replace an existing file.

    Raises:
      FileExistsError: ``path`` exists and not ``overwrite``.
      ValueError: the family has no GGUF architecture here, or the config uses something
        llama.cpp's format cannot say (Llama 3 RoPE scaling needs a ``rope_freqs`` tensor).
    """
    import gguf

    from jaxspec.models import layout

    params = layout.as_arrays(params)  # matrices laid out for the CPU kernel are written as [K, N]
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"destination {path!r} already exists; pass overwrite=True to replace it")
    if config.family not in ARCHITECTURES:
        raise ValueError(f"no GGUF architecture for family {config.family!r} ({', '.join(ARCHITECTURES)})")
    scaling = config.rope_scaling
    if scaling is not None and (scaling.kind == "linear") != (config.family == "gemma3"):
        raise ValueError(f"{config.name}: {scaling.kind} RoPE scaling of a {config.family} model has no GGUF form here "
                         f"(llama3/factors: llama-like families; linear: gemma3)")
    arch = ARCHITECTURES[config.family]
    qtype = gguf.GGMLQuantizationType[quantization]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(config.name)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(config.max_position)
    w.add_embedding_length(config.dim)
    w.add_block_count(config.n_layers)
    w.add_feed_forward_length(config.ffn_dim)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    if config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    if config.family == "gemma3":
        w.add_sliding_window_pattern([config.is_sliding(i) for i in range(config.n_layers)])
        w.add_rope_freq_base_swa(config.rope_local_theta or config.rope_theta)
        if config.attn_scale:
            w.add_float32(gguf.Keys.Attention.SCALE.format(arch=arch), config.attn_scale)
        if config.final_softcap:
            w.add_final_logit_softcapping(config.final_softcap)
        if config.rope_scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(config.rope_scaling.factor)
    if config.bos_id >= 0:
        w.add_bos_token_id(config.bos_id)
    if config.eos_ids:
        w.add_eos_token_id(config.eos_ids[0])
    for key, value in (tokenizer_metadata or {}).items():
        if key.startswith("tokenizer.") and key not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            _add_value(w, key, value)
    if scaling is not None and scaling.kind != "linear":  # llama.cpp: divisors in a rope_freqs tensor
        from jaxspec.models.rope import inv_freq

        w.add_tensor("rope_freqs.weight", inv_freq(config.head_dim, config.rope_theta)
                     / inv_freq(config.head_dim, config.rope_theta, scaling))
    for spec in names.tensor_specs(config):
        arr = np.asarray(names.get_leaf(params, spec.path), dtype=np.float32)
        arr = np.ascontiguousarray(arr.T) if spec.transposed else arr
        if arch == "llama" and spec.key in ("wq", "wk"):
            arr = _permute(arr, config.n_heads if spec.key == "wq" else config.n_kv_heads)
        if config.norm_offset and spec.is_norm:
            arr = arr + np.float32(config.norm_offset)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and arr.shape[1] % block == 0:
            w.add_tensor(spec.gguf, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(spec.gguf, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_value(w, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))
