"""Trained draft heads on disk: written by ``checkpoints_tools train-eagle``, read by
``jaxspec.load_eagle_head``, and refused for any target but the one they were trained for.

Directory layout (``save_head``)::

    HEAD/head.json   {"format": "jaxspec-head", "version": 1, "kind": "eagle3",
                      "config": {...EagleConfig...}, "target_fingerprint": "sha256 hex",
                      "tensors": {"head/fc": [[3D, D], "float32", "sha256 of the bytes"], ...},
                      "training": {...settings and final numbers...}}
    HEAD/params/     orbax PyTree checkpoint of {"head": params, "d2t": int32 [Vd]}

A head is tied to its target by the target's config (every field but the name) and a
fingerprint of its weights (``fingerprint``), both checked before the head's params are read.
Each tensor's sha256 is checked after reading, so a truncated or altered file is an error
naming the file and the tensor, raised before anything compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoints.orbax_io import write_dir
from jaxspec.config import ModelConfig
from jaxspec.models import eagle3
from jaxspec.models.eagle3 import EagleConfig

MANIFEST = "head.json"
FORMAT = "jaxspec-head"
VERSION = 1
FINGERPRINT_SAMPLES = 4096  # elements sampled per tensor


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def fingerprint(params: Any) -> str:
    """A fingerprint of a model's weights, independent of the dtype they were loaded in:
    sha256 over every tensor's name, shape and ``FINGERPRINT_SAMPLES`` evenly strided
    elements rounded to bfloat16 (a float32 and a bfloat16 load of one checkpoint agree)."""
    h = hashlib.sha256()
    for path, x in sorted(jax.tree_util.tree_flatten_with_path(params)[0], key=lambda kv: _leaf_name(kv[0])):
        flat = jnp.ravel(x)
        stride = max(1, flat.shape[0] // FINGERPRINT_SAMPLES)
        sample = np.asarray(jax.device_get(flat[::stride][:FINGERPRINT_SAMPLES].astype(jnp.bfloat16)))
        h.update(f"{_leaf_name(path)}{tuple(x.shape)}".encode())
        h.update(sample.view(np.uint16).tobytes())
    return h.hexdigest()


def check_head_target(config: EagleConfig, target: ModelConfig, where: str) -> None:
    """Raise ``ValueError`` (naming ``where``) unless ``target`` is the config the head was
    trained for (every field but the name and the runtime ``tp_axis``)."""
    want, got = config.target.to_dict(), target.to_dict()
    diff = {k: (want[k], got.get(k)) for k in want if k != "name" and want[k] != got.get(k)}
    if diff:
        raise ValueError(f"{where} is an EAGLE head for {config.target.name}, not for the target {target.name}: "
                         f"config fields differ (head's, target's): {diff}")


def _checksums(tree) -> dict:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(jax.device_get(x))
        out[_leaf_name(path)] = [list(arr.shape), str(arr.dtype), hashlib.sha256(arr.tobytes()).hexdigest()]
    return out


def save_head(dst: str, head: dict, d2t, config: EagleConfig, target_params: Any, *, training: dict | None = None,
              overwrite: bool = False) -> str:
    """Write an EAGLE-3 head at ``dst`` (written into ``dst + ".partial"``, then renamed).

    Args:
      head: params in the ``jaxspec.models.eagle3`` layout; d2t: int32 ``[Vd]`` target ids.
      config: its ``EagleConfig``; target_params: the target's params (for ``fingerprint``).
      training: settings and results to keep in the manifest.

    Returns:
      The absolute path written.

    Raises:
      FileExistsError: ``dst`` exists and not ``overwrite``.
    """
    import orbax.checkpoint as ocp

    tree = {"head": jax.device_get(head), "d2t": np.asarray(d2t, np.int32)}
    manifest = {"format": FORMAT, "version": VERSION, "kind": "eagle3", "config": config.to_dict(),
                "target_fingerprint": fingerprint(target_params), "tensors": _checksums(tree),
                "training": training or {}}

    def fill(tmp):
        with ocp.PyTreeCheckpointer() as ckpt:
            ckpt.save(os.path.join(tmp, "params"), tree)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)

    return write_dir(dst, overwrite, fill)


def read_head_manifest(path: str) -> dict:
    """The parsed ``head.json`` with ``"config"`` as an ``EagleConfig``.

    Raises:
      FileNotFoundError: no such head directory or manifest (named).
      ValueError: unreadable or foreign manifest (named).
    """
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"EAGLE head {path!r} not found: no {MANIFEST} there (write one with "
                                f"python -m checkpoints_tools train-eagle)")
    try:
        with open(file) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION or manifest.get("kind") != "eagle3":
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r} kind "
                             f"{manifest.get('kind')!r}, expected {FORMAT!r} version {VERSION} kind 'eagle3'")
        manifest["config"] = EagleConfig.from_dict(manifest["config"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file!r}: not a readable EAGLE head manifest: {e}") from e
    return manifest


def load_eagle_head(path: str, target, config: ModelConfig | None = None, *, gamma: int = 4, tree_nodes: int = 0,
                    branching: int = 4):
    """Read an EAGLE-3 head for ``target`` and build its drafter.

    Args:
      path: a head directory written by ``save_head`` (``checkpoints_tools train-eagle``).
      target: the target ``jaxspec.Model``, or its params pytree (then pass ``config``).
      gamma, tree_nodes, branching: the ``EagleDrafter``'s (chain by default).

    Returns:
      ``(EagleDrafter, drafter_params)`` for ``jaxspec.generate(drafter=, drafter_params=)``.

    Raises:
      FileNotFoundError: no head at ``path``.
      ValueError: the head was trained for another target (config or weight fingerprint), a
        tensor is missing, truncated or altered (checksum), or its d2t map is not a set of
        distinct target ids. Every message names the file; all before anything compiles.
    """
    from jaxspec.drafters.eagle import EagleDrafter

    params = getattr(target, "params", target)
    config = getattr(target, "config", config)
    if config is None:
        raise ValueError("config is required when target is a params pytree")
    path = os.path.abspath(path)
    manifest = read_head_manifest(path)
    cfg = manifest["config"]
    check_head_target(cfg, config, f"{path!r}")
    if fingerprint(params) != manifest["target_fingerprint"]:
        raise ValueError(f"{path!r} is an EAGLE head for another {cfg.target.name} (the target's weight fingerprint "
                         f"differs from the one stored in {MANIFEST}): train a head for this target")
    tree = _restore(path, cfg, manifest)
    d2t = np.asarray(tree["d2t"])
    if len(set(d2t.tolist())) != d2t.size or d2t.min() < 0 or d2t.max() >= config.vocab_size:
        raise ValueError(f"{path!r}: d2t must hold {cfg.draft_vocab} distinct target ids in [0, {config.vocab_size})")
    drafter = EagleDrafter(cfg, gamma=gamma, tree_nodes=tree_nodes, branching=branching)
    return drafter, {"head": tree["head"], "d2t": jnp.asarray(d2t, jnp.int32)}


def _restore(path: str, cfg: EagleConfig, manifest: dict) -> dict:
    import orbax.checkpoint as ocp

    params_dir = os.path.join(path, "params")
    shapes = {"head": eagle3.param_shapes(cfg), "d2t": (cfg.draft_vocab,)}
    expected = {_leaf_name(p): list(s) for p, s in
                jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]}
    stored = manifest.get("tensors", {})
    for name, shape in expected.items():
        if name not in stored or stored[name][0] != shape:
            raise ValueError(f"{params_dir!r}: tensor {name} is missing or has the wrong shape "
                             f"(manifest {stored.get(name, [None])[0]}, expected {shape} for {cfg.layer.name})")
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            tree = ckpt.restore(params_dir)
    except Exception as e:  # orbax / tensorstore raise many types for a damaged directory
        raise ValueError(f"{params_dir!r}: cannot read the EAGLE head ({type(e).__name__}: {str(e)[:200]})") from e
    sums = _checksums(tree)
    for name, (shape, dtype, digest) in stored.items():
        if name not in sums or sums[name][2] != digest:
            raise ValueError(f"{params_dir!r}: tensor {name} is truncated or altered (sha256 differs from "
                             f"{MANIFEST})")
    return jax.tree_util.tree_map(jnp.asarray, tree)
