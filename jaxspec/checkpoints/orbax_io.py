"""orbax checkpoints of a jaxspec model: params, their ``ModelConfig`` and the tokenizer.

Directory layout (``save``)::

    DST/jaxspec.json     {"format": "jaxspec-orbax", "version": 1, "config": {...},
                          "tensors": {"layers/0/wq": [[D, H*hd], "float32"], ...},
                          "source": "/path/it/was/converted/from" or null}
    DST/params/          orbax StandardCheckpointer tree (tensorstore / zarr per array)
    DST/gguf_tokenizer.json  optional: the GGUF ``tokenizer.*`` metadata, or
    DST/tokenizer/       optional: a Hugging Face tokenizer's files, copied

``restore`` builds an abstract tree of ``jax.ShapeDtypeStruct`` with the requested dtype and
sharding and lets orbax read each array straight into its shards, so a model larger than one
device never exists whole on one device (orbax ``StandardCheckpointer.restore`` with a target
tree; https://orbax.readthedocs.io/en/latest/guides/checkpoint/checkpointing_pytrees.html).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import numpy as np

from jaxspec.checkpoints import names
from jaxspec.config import ModelConfig

__all__ = ["default_specs", "is_orbax_dir", "read_manifest", "restore", "save"]

MANIFEST = "jaxspec.json"
FORMAT = "jaxspec-orbax"
VERSION = 1


def is_orbax_dir(path: str) -> bool:
    """A directory written by ``save`` (it has ``jaxspec.json``)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def _leaf_name(path: tuple) -> str:
    return "/".join(map(str, path))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def save(dst: str, params: dict, config: ModelConfig, *, tokenizer_metadata: dict | None = None,
         tokenizer_dir: str | None = None, overwrite: bool = False, source: str | None = None) -> str:
    """Write ``params`` (numpy or jax arrays) and ``config`` as an orbax checkpoint at ``dst``.

    The checkpoint is written into ``dst + ".partial"`` and renamed when complete, so a failed
    save never leaves a half-written ``dst``, and an existing ``dst`` (with ``overwrite``) is
    only removed once its replacement is complete.

    Args:
      dst: destination directory (must not exist unless ``overwrite``).
      params: pytree in the ``jaxspec.models.decoder`` layout for ``config`` (matrices as arrays
        or ``layout.Panels``; saved as arrays either way).
      config: its ``ModelConfig``.
      tokenizer_metadata: GGUF ``tokenizer.*`` (and ``general.name``) keys to keep.
      tokenizer_dir: a Hugging Face directory whose tokenizer files are copied.
      overwrite: replace an existing ``dst``.
      source: where the weights came from (kept in the manifest; ``verify`` compares against it).

    Returns:
      The absolute path written.

    Raises:
      FileExistsError: ``dst`` exists and not ``overwrite``.
      ValueError: ``params`` does not match ``config`` (names the tensor).
    """
    from jaxspec.models import layout

    params = layout.as_arrays(params)  # matrices laid out for the CPU kernel are saved as [K, N]
    tensors = {}
    for spec in names.tensor_specs(config):
        arr = names.get_leaf(params, spec.path)
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"params {_leaf_name(spec.path)} has shape {tuple(arr.shape)}, expected {spec.shape} for {config.name}")
        tensors[_leaf_name(spec.path)] = [list(spec.shape), str(arr.dtype)]
    return write_dir(dst, overwrite, lambda tmp: _write(tmp, params, config, tensors, tokenizer_metadata,
                                                        tokenizer_dir, source))


def write_dir(dst: str, overwrite: bool, fill: Callable[[str], None]) -> str:
    """Create directory ``dst`` by ``fill(tmp)`` into ``dst + ".partial"``, renamed when
    complete: a failed write never leaves a half-written ``dst``, and an existing ``dst``
    (with ``overwrite``) is only removed once its replacement is complete.

    Raises:
      FileExistsError: ``dst`` exists and not ``overwrite``.
    """
    dst = os.path.abspath(dst)
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(f"destination {dst!r} already exists; pass --overwrite (overwrite=True) to replace it")
    tmp = dst + ".partial"
    _remove(tmp)
    os.makedirs(tmp)
    try:
        fill(tmp)
    except BaseException:
        _remove(tmp)
        raise
    _remove(dst)
    os.replace(tmp, dst)
    return dst


def _write(tmp, params, config, tensors, tokenizer_metadata, tokenizer_dir, source):
    import orbax.checkpoint as ocp

    # No compression (float weights barely compress) and at most 1 GB in flight: orbax then adds
    # no host copy of CPU arrays (measured: docs/checkpoints.md, "Converting, inspecting, verifying").
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, save_concurrent_gb=1)
    with ocp.Checkpointer(handler) as ckpt:
        ckpt.save(os.path.join(tmp, "params"), args=ocp.args.PyTreeSave(params))
    manifest = {"format": FORMAT, "version": VERSION, "config": config.to_dict(), "tensors": tensors,
                "source": source}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    if tokenizer_metadata:
        with open(os.path.join(tmp, "gguf_tokenizer.json"), "w") as f:
            json.dump(tokenizer_metadata, f)
    if tokenizer_dir:
        files = [f for f in os.listdir(tokenizer_dir) if f.startswith(("tokenizer", "special_tokens", "chat_template"))]
        if files:
            os.makedirs(os.path.join(tmp, "tokenizer"))
            for f in files:
                shutil.copy(os.path.join(tokenizer_dir, f), os.path.join(tmp, "tokenizer", f))


def read_manifest(path: str) -> dict:
    """The parsed ``jaxspec.json`` with ``"config"`` turned into a ``ModelConfig``.

    Raises:
      FileNotFoundError: no such directory / no manifest.
      ValueError: not a jaxspec orbax checkpoint, or a version this jaxspec cannot read.
    """
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} is not a jaxspec orbax checkpoint: no {MANIFEST}")
    try:
        with open(file) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r}, expected "
                             f"{FORMAT!r} version {VERSION}")
        manifest["config"] = ModelConfig.from_dict(manifest["config"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file!r}: not a readable jaxspec manifest: {e}") from e
    return manifest


def default_specs(config: ModelConfig, mesh, axis: str = "model") -> Callable:
    """Megatron-style tensor parallelism over mesh axis ``axis`` (Shoeybi et al. 2019), from
    the one table of logical axes (``jaxspec.models.axes``) and rules (``jaxspec.sharding.RULES``):
    heads (with their q/k/v biases), MLP width and vocabulary split over ``axis``; norms, the
    residual width and any logical axis whose count ``axis`` does not divide are replicated.

    Returns:
      ``fn(spec: names.TensorSpec) -> jax.sharding.PartitionSpec``; it raises ValueError
      naming a tensor that has no declared logical axes.
    """
    from jaxspec import sharding

    return sharding.tensor_spec_fn(config, mesh.shape[axis], axis)


def resolve_specs(config: ModelConfig, mesh, specs=None):
    """``specs`` if given, else ``default_specs`` over a ``"model"`` mesh axis, else replicated."""
    from jax.sharding import PartitionSpec

    if specs is not None:
        return specs
    return default_specs(config, mesh) if "model" in mesh.axis_names else (lambda spec: PartitionSpec())


def restore(path: str, *, dtype=None, mesh=None, specs: Callable | dict | None = None,
            expect: ModelConfig | None = None) -> tuple[dict, ModelConfig, dict]:
    """Restore a checkpoint written by ``save``, straight onto a sharding and dtype.

    Args:
      path: the checkpoint directory.
      dtype: dtype of every restored array (orbax casts while reading); default the saved dtype.
      mesh: a ``jax.sharding.Mesh``; None restores onto the default device.
      specs: with ``mesh``: ``fn(TensorSpec) -> PartitionSpec``, or a params-shaped pytree of
        PartitionSpecs; default ``default_specs(config, mesh)`` when ``mesh`` has a ``"model"``
        axis, else replicated.
      expect: the config the caller needs (e.g. a drafter's target); a mismatch is an error.

    Returns:
      ``(params, config, extras)``: ``extras`` may hold ``"tokenizer_metadata"`` (GGUF keys)
      or ``"tokenizer_dir"`` (path of a copied Hugging Face tokenizer).

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
      ValueError: the stored arrays do not match the stored config (e.g. params copied from
        another model), or ``expect`` differs; the message names the file and the tensor.
    """
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding

    path = os.path.abspath(path)
    manifest = read_manifest(path)
    config = manifest["config"]
    if expect is not None and expect != config:
        diff = {k: (v, getattr(config, k)) for k, v in expect.to_dict().items() if getattr(config, k) != expect.__dict__[k]}
        raise ValueError(f"{path!r} holds {config.name}, not the expected {expect.name}: fields (expected, found) {diff}")
    params_dir = os.path.join(path, "params")
    ckpt = ocp.StandardCheckpointer()
    try:
        stored = ckpt.metadata(params_dir).item_metadata.tree
    except Exception as e:
        raise ValueError(f"{params_dir!r}: cannot read orbax metadata ({type(e).__name__}: {e})") from e
    if mesh is not None:
        specs = resolve_specs(config, mesh, specs)
    target = names.empty_params(config)
    for spec in names.tensor_specs(config):
        try:
            meta = names.get_leaf(stored, spec.path)
        except KeyError:
            raise ValueError(f"{params_dir!r}: missing tensor {_leaf_name(spec.path)} for {config.name}") from None
        if tuple(meta.shape) != spec.shape:
            raise ValueError(f"{params_dir!r}: tensor {_leaf_name(spec.path)} has shape {tuple(meta.shape)}, but "
                             f"{os.path.join(path, MANIFEST)!r} describes {config.name} with {spec.shape} "
                             f"(a checkpoint of another model?)")
        if mesh is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            pspec = specs(spec) if callable(specs) else names.get_leaf(specs, spec.path)
            sharding = NamedSharding(mesh, pspec)
        names.set_leaf(target, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype or meta.dtype, sharding=sharding))
    n_stored = len(jax.tree_util.tree_leaves(stored))
    if n_stored != len(jax.tree_util.tree_leaves(target)):
        raise ValueError(f"{params_dir!r}: holds {n_stored} tensors, {config.name} has "
                         f"{len(jax.tree_util.tree_leaves(target))} (a checkpoint of another model?)")
    params = ckpt.restore(params_dir, target)
    ckpt.close()
    extras: dict[str, Any] = {}
    tok = os.path.join(path, "gguf_tokenizer.json")
    if os.path.isfile(tok):
        with open(tok) as f:
            extras["tokenizer_metadata"] = json.load(f)
    if os.path.isdir(os.path.join(path, "tokenizer")):
        extras["tokenizer_dir"] = os.path.join(path, "tokenizer")
    return params, config, extras


def cpu_put(dtype) -> Callable:
    """``put`` for readers that keeps tensors in host memory: ``fn(spec, arr) -> jax.Array`` in
    ``dtype`` on the CPU device, whatever the default backend (no accelerator memory is used,
    and orbax saves CPU arrays without another host copy)."""
    import jax

    np_dtype, cpu = np.dtype(dtype), jax.devices("cpu")[0]
    return lambda spec, arr: jax.device_put(np.asarray(arr).astype(np_dtype, copy=False), cpu)
