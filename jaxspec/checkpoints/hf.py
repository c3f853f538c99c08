"""Read Hugging Face checkpoints: a directory with ``config.json`` and ``*.safetensors`` (one
file, or shards listed in ``model.safetensors.index.json``).

Families: ``model_type`` llama (Llama 2/3, SmolLM2), mistral, qwen2, qwen3, gemma3_text
(Gemma 3 270M / 1B) and gemma3 (the multimodal Gemma 3 4B+ checkpoints: their language model
is read, ``language_model.`` prefixes stripped, the vision tower and projector skipped). Tensors are read one at a time with ``safetensors.safe_open`` (memory-mapped, numpy),
transposed to our ``[in, out]`` layout and cast, so peak host memory stays near one copy of
the model in the target dtype.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterator

import numpy as np

from jaxspec.checkpoints import names
from jaxspec.config import ModelConfig, RopeScaling

__all__ = ["config_from_hf", "is_hf_dir", "iter_hf_tensors", "read_hf", "read_hf_config"]

FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
INDEX_FILE = "model.safetensors.index.json"
# Multimodal wrappers (Gemma3ForConditionalGeneration): text-model prefixes and skipped parts.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_name(name: str) -> str | None:
    """The language-model tensor name (``model.layers.0...``), or None for vision tensors."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def is_hf_dir(path: str) -> bool:
    """A directory holding ``config.json`` and at least one ``*.safetensors`` file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


def _rope(rp: dict, source: str) -> tuple[float, RopeScaling | None]:
    theta = float(rp.get("rope_theta", 10000.0))
    kind = rp.get("rope_type", rp.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(rp["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(rp["factor"]), float(rp["low_freq_factor"]),
                                  float(rp["high_freq_factor"]), int(rp["original_max_position_embeddings"]))
    raise ValueError(f"{source}: unsupported RoPE scaling rope_type={kind!r} (supported: default, linear, llama3)")


def config_from_hf(c: dict, source: str = "config.json") -> ModelConfig:
    """``ModelConfig`` from a transformers ``config.json`` dict (transformers 4.x ``rope_theta`` /
    ``rope_scaling`` keys and 5.x ``rope_parameters`` both accepted).

    Raises:
      ValueError: unsupported ``model_type`` or option (bias on o_proj/MLP, other RoPE types,
        activations), naming ``source`` and the value.
    """
    mt = c.get("model_type")
    if mt == "gemma3" and isinstance(c.get("text_config"), dict):  # multimodal: its language model
        c = {"tie_word_embeddings": c.get("tie_word_embeddings", True), **c["text_config"], "model_type": "gemma3_text"}
        mt = "gemma3_text"
    if mt not in FAMILIES:
        raise ValueError(f"{source}: unsupported architecture model_type={mt!r} (architectures "
                         f"{c.get('architectures')}); jaxspec reads {', '.join(FAMILIES)}")
    family = FAMILIES[mt]
    if c.get("mlp_bias") or (family in ("llama", "mistral") and c.get("attention_bias")):
        raise ValueError(f"{source}: biases on o_proj/MLP (attention_bias/mlp_bias) are not supported")
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    hd = int(c.get("head_dim") or d // h)
    rp = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0), **(c.get("rope_scaling") or {})}
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"{source}: unsupported activation {act!r} (supported: {', '.join(acts)})")
    eos = c.get("eos_token_id")
    kw = dict(
        vocab_size=int(c["vocab_size"]), dim=d, n_layers=int(c["num_hidden_layers"]), n_heads=h,
        n_kv_heads=int(c.get("num_key_value_heads") or h), head_dim=hd, ffn_dim=int(c["intermediate_size"]),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), max_position=int(c.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(c.get("tie_word_embeddings", family == "gemma3")),
        bos_id=-1 if c.get("bos_token_id") is None else int(c["bos_token_id"]),
        eos_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        name=str(c.get("_name_or_path") or mt), family=family, activation=acts[act],
        attn_bias=family == "qwen2" or (family == "qwen3" and bool(c.get("attention_bias"))),
        qk_norm=family in ("qwen3", "gemma3"),
    )
    types = [{"full_attention": "full", "sliding_attention": "sliding"}[t] for t in c.get("layer_types") or []]
    window = int(c.get("sliding_window") or 0)
    if family == "gemma3":
        full, local = rp.get("full_attention", rp), rp.get("sliding_attention", {"rope_theta": c.get("rope_local_base_freq", 1e4)})
        kw["rope_theta"], kw["rope_scaling"] = _rope(full, source)
        kw["rope_local_theta"] = _rope(local, source)[0]
        kw.update(norm_offset=1.0, sandwich_norms=True, embed_scale=float(np.float32(math.sqrt(d))),
                  attn_scale=float(c.get("query_pre_attn_scalar", hd)) ** -0.5,
                  final_softcap=float(c.get("final_logit_softcapping") or 0.0),
                  sliding_window=window, layer_types=tuple(types))
    else:
        kw["rope_theta"], kw["rope_scaling"] = _rope(rp, source)
        if family == "mistral" and window:
            kw.update(sliding_window=window)  # every layer
        elif family in ("qwen2", "qwen3") and c.get("use_sliding_window") and window and "sliding" in types:
            kw.update(sliding_window=window, layer_types=tuple(types))
    return ModelConfig(**kw)


def read_hf_config(path: str) -> ModelConfig:
    """``config_from_hf`` of ``path/config.json``; errors name the file."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            c = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} is not a Hugging Face checkpoint: no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path!r} is not valid JSON: {e}") from e
    try:
        return config_from_hf(c, cfg_path)
    except KeyError as e:
        raise ValueError(f"{cfg_path!r}: missing required key {e.args[0]!r}") from None


def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file (absolute), from the index file or by listing every file."""
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in wm.items()}
    out = {}
    for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        full = os.path.join(path, fname)
        try:
            with safe_open(full, framework="numpy") as f:
                out.update({k: full for k in f.keys()})
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(
                f"{full!r} is not a readable safetensors file (truncated or corrupt){_first_cut_tensor(full)}: {e}"
            ) from e
    return out


def _first_cut_tensor(path: str) -> str:
    """For an error message once ``safetensors`` refused ``path``: which tensor the file ends
    inside, from the format's JSON header (an 8-byte little-endian length, then JSON with
    each tensor's ``data_offsets`` after the header); "" when the header itself is unreadable."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        ends = sorted((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
        for end, name in ends:
            if 8 + n + end > size:
                return f": tensor {name!r} needs bytes up to {8 + n + end}, the file has {size}"
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    return ""


def iter_hf_tensors(path: str, config: ModelConfig) -> Iterator[tuple[names.TensorSpec, np.ndarray]]:
    """Yield ``(spec, array)`` in our layout (transposed, original dtype), one tensor at a time.

    Raises:
      ValueError: a file is truncated/corrupt, a tensor is missing or has the wrong shape, or a
        file holds tensors this config has no place for; each message names file and tensor.
    """
    from safetensors import SafetensorError, safe_open

    wm = {}  # our HF name -> (file, name in the file)
    for stored, file in _weight_map(path).items():
        if (text := _text_name(stored)) is not None:
            wm[text] = (file, stored)
    specs = names.tensor_specs(config)
    expected = {s.hf for s in specs}
    extra = sorted(k for k in wm if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if config.tie_embeddings:
        extra = [k for k in extra if k != "lm_head.weight"]  # some exports write the tied copy
    if extra:
        raise ValueError(f"{wm[extra[0]][0]!r}: unexpected tensors for {config.family} "
                         f"({config.name}): {extra[:6]}{' ...' if len(extra) > 6 else ''}")
    missing = [s for s in specs if s.hf not in wm]
    if missing:
        raise ValueError(f"{path!r}: missing tensor {missing[0].hf!r} (needed for {'/'.join(map(str, missing[0].path))})")
    last_use = {wm[s.hf][0]: i for i, s in enumerate(specs)}  # close (unmap) each file after its last tensor
    handles: dict[str, object] = {}
    try:
        for i, spec in enumerate(specs):
            file, stored = wm[spec.hf]
            try:
                if file not in handles:
                    handles[file] = safe_open(file, framework="numpy")
                arr = handles[file].get_tensor(stored)
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{file!r}: cannot read tensor {spec.hf!r} (truncated or corrupt file?): {e}") from e
            if last_use[file] == i:
                handles.pop(file)
            if tuple(arr.shape) != spec.stored_shape:
                raise ValueError(f"{file!r}: tensor {spec.hf!r} has shape {tuple(arr.shape)}, expected "
                                 f"{spec.stored_shape} for {config.name}")
            yield spec, (np.ascontiguousarray(arr.T) if spec.transposed else arr)
    finally:
        handles.clear()


def read_hf(path: str, dtype=None, put: Callable | None = None) -> tuple[dict, ModelConfig]:
    """Load a Hugging Face safetensors checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``*.safetensors`` (optionally sharded with
        ``model.safetensors.index.json``).
      dtype: dtype of every array; default ``jaxspec.config.default_dtype()``.
      put: ``fn(spec, numpy array) -> leaf``; default ``jnp.asarray(arr, dtype)`` (device arrays).
        Converters pass a host-side cast to keep everything off the device.

    Returns:
      ``(params, config)`` in the ``jaxspec.models.decoder`` layout.

    Raises:
      FileNotFoundError: no such directory or no config.json.
      ValueError: unsupported architecture, corrupt/truncated file, missing or mis-shaped tensor.
    """
    import jax.numpy as jnp

    from jaxspec.config import default_dtype

    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint directory not found: {path!r}")
    config = read_hf_config(path)
    dtype = default_dtype() if dtype is None else dtype
    put = put or (lambda spec, arr: jnp.asarray(arr, dtype=dtype))
    params = names.empty_params(config)
    for spec, arr in iter_hf_tensors(path, config):
        names.set_leaf(params, spec.path, put(spec, arr))
    return params, config
