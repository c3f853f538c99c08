"""``inspect``: architecture, tensor shapes, dtypes, parameter count and bytes of a checkpoint,
read from headers only (no tensor is loaded or dequantized)."""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jaxspec.checkpoints import hf, names, orbax_io
from jaxspec.checkpoints.loading import checkpoint_kind, resolve


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: ``name`` in the file, ``shape`` as stored, ``dtype`` (a numpy dtype name
    or a GGUF quantization type), ``n_bytes`` on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    n_bytes: int


def inspect_checkpoint(name_or_path: str):
    """``(kind, config, [TensorInfo])`` for an orbax directory, GGUF file or HF directory."""
    path = resolve(name_or_path)
    kind = checkpoint_kind(path)
    if kind == "orbax":
        manifest = orbax_io.read_manifest(path)
        infos = [TensorInfo(n, tuple(shape), dt, int(np.prod(shape)) * np.dtype(_np(dt)).itemsize)
                 for n, (shape, dt) in manifest["tensors"].items()]
        return kind, manifest["config"], infos
    if kind == "hf":
        from safetensors import safe_open

        config = hf.read_hf_config(path)
        infos = []
        for name, file in sorted(hf._weight_map(path).items()):
            with safe_open(file, framework="numpy") as f:
                sl = f.get_slice(name)
                shape, dt = tuple(sl.get_shape()), str(sl.get_dtype())
            itemsize = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}.get(dt, 4)
            infos.append(TensorInfo(name, shape, dt, int(np.prod(shape)) * itemsize))
        return kind, config, infos
    from jaxspec.checkpoints import gguf_reader

    reader = gguf_reader._open_reader(path)
    meta = gguf_reader._metadata_from_reader(reader, path)
    config = gguf_reader._config_from_metadata(meta, {t.name: t for t in reader.tensors}, path)
    infos = [TensorInfo(t.name, tuple(int(d) for d in reversed(list(t.shape))), t.tensor_type.name, int(t.n_bytes))
             for t in reader.tensors]
    return kind, config, infos


def _np(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


def report(name_or_path: str, all_tensors: bool = False) -> str:
    """Human-readable ``inspect`` output."""
    kind, config, infos = inspect_checkpoint(name_or_path)
    n_params = sum(int(np.prod(i.shape)) for i in infos)
    total = sum(i.n_bytes for i in infos)
    dtypes: dict[str, int] = {}
    for i in infos:
        dtypes[i.dtype] = dtypes.get(i.dtype, 0) + 1
    expected = sum(int(np.prod(s.shape)) for s in names.tensor_specs(config))
    lines = [
        f"path:          {os.path.abspath(resolve(name_or_path))} ({kind})",
        f"architecture:  {config.family} ({config.name})",
        f"shape:         {config.n_layers} layers, dim {config.dim}, heads {config.n_heads}/{config.n_kv_heads} "
        f"x {config.head_dim}, ffn {config.ffn_dim}, vocab {config.vocab_size}, tied {config.tie_embeddings}",
        "attention:     " + (f"sliding window {config.sliding_window} on "
                              f"{sum(config.is_sliding(i) for i in range(config.n_layers))}/{config.n_layers} layers"
                              if config.sliding_window else "full on every layer")
        + f", rope theta {config.rope_theta:g}" + (f" (local {config.rope_local_theta:g})" if config.rope_local_theta else "")
        + (f", scaling {config.rope_scaling.kind} x{config.rope_scaling.factor:g}" if config.rope_scaling else ""),
        f"parameters:    {n_params:,} stored ({expected:,} in jaxspec's layout)",
        f"bytes:         {total:,} ({total / 2**20:.1f} MiB)",
        f"dtypes:        {', '.join(f'{k} x{v}' for k, v in sorted(dtypes.items()))}",
        f"tensors:       {len(infos)}",
    ]
    later_layer = re.compile(r"[./][1-9][0-9]*[./]")  # blk.3. / layers.3. / layers/3/
    shown = infos if all_tensors else [i for i in infos if not later_layer.search(i.name)]
    for i in shown:
        lines.append(f"  {i.name:60s} {str(list(i.shape)):>16s} {i.dtype}")
    if not all_tensors and len(shown) < len(infos):
        lines.append("  ... layers 1.. omitted (--all to list every tensor)")
    return "\n".join(lines)
