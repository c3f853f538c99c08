"""Trained draft heads on disk: written by ``checkpoints_tools train-eagle``, read by
``jaxspec.load_eagle_head``, and refused for any target but the one they were trained for.

Directory layout (``save_head``)::

    HEAD/head.json   {"format": "jaxspec-head", "version": 1, "kind": "eagle3" or "medusa1",
                      "config": {"target": {...}, ...}, "target_fingerprint": "sha256 hex",
                      "tensors": {"head/fc": [[3D, D], "float32", "sha256 of the bytes"], ...},
                      "training": {...settings and final numbers...}}
    HEAD/params/     orbax PyTree checkpoint: EAGLE-3 {"head": params, "d2t": int32 [Vd]};
                     Medusa-1 {"heads": [{"w": [D, D], "b": [D]}, ...]} (+ "d2t" int32 [Vd]
                     when the heads draft from a reduced vocabulary; config "draft_vocab")

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
from jaxspec.models.target import require_decoder

MANIFEST = "head.json"
FORMAT = "jaxspec-head"
VERSION = 1
FINGERPRINT_SAMPLES = 4096  # elements sampled per tensor


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def fingerprint(params: Any) -> str:
    """A fingerprint of a model's weights, independent of the dtype they were loaded in:
    sha256 over every tensor's name, shape and ``FINGERPRINT_SAMPLES`` evenly strided
    elements rounded to bfloat16 (a float32 and a bfloat16 load of one checkpoint agree, and so
    do the same weights as plain arrays or laid out in panels, ``jaxspec.models.layout``)."""
    from jaxspec.models.layout import Panels

    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Panels))[0]
    for path, x in sorted(leaves, key=lambda kv: _leaf_name(kv[0])):
        size = int(np.prod(x.shape))
        stride = max(1, size // FINGERPRINT_SAMPLES)
        idx = jnp.arange(0, size, stride)[:FINGERPRINT_SAMPLES]
        picked = x.take_flat(idx) if isinstance(x, Panels) else jnp.ravel(x)[idx]  # a matrix in panels: no copy
        sample = np.asarray(jax.device_get(picked.astype(jnp.bfloat16)))
        h.update(f"{_leaf_name(path)}{tuple(x.shape)}".encode())
        h.update(sample.view(np.uint16).tobytes())
    return h.hexdigest()


def check_head_target(head_target: ModelConfig, target: ModelConfig, where: str) -> None:
    """Raise ``ValueError`` (naming ``where``) unless ``target`` is the config the head was
    trained for, ``head_target`` (every field but the name and the runtime ``tp_axis``)."""
    want, got = head_target.to_dict(), target.to_dict()
    diff = {k: (want[k], got.get(k)) for k in want if k != "name" and want[k] != got.get(k)}
    if diff:
        raise ValueError(f"{where} is a head for {head_target.name}, not for the target {target.name}: "
                         f"config fields differ (head's, target's): {diff}")


def _checksums(tree) -> dict:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(jax.device_get(x))
        out[_leaf_name(path)] = [list(arr.shape), str(arr.dtype), hashlib.sha256(arr.tobytes()).hexdigest()]
    return out


def _save(dst: str, tree: dict, kind: str, config: dict, target_fingerprint: str, training, overwrite: bool) -> str:
    import orbax.checkpoint as ocp

    tree = jax.device_get(tree)
    manifest = {"format": FORMAT, "version": VERSION, "kind": kind, "config": config,
                "target_fingerprint": target_fingerprint, "tensors": _checksums(tree),
                "training": training or {}}

    def fill(tmp):
        with ocp.PyTreeCheckpointer() as ckpt:
            ckpt.save(os.path.join(tmp, "params"), tree)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)

    return write_dir(dst, overwrite, fill)


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
    return _save(dst, {"head": head, "d2t": np.asarray(d2t, np.int32)}, "eagle3", config.to_dict(),
                 fingerprint(target_params), training, overwrite)


def save_medusa_heads(dst: str, heads: dict, target: ModelConfig, target_params: Any, *, d2t=None,
                      training: dict | None = None, overwrite: bool = False) -> str:
    """Write Medusa-1 heads (``{"heads": [{"w", "b"}, ...]}``) for ``target`` at ``dst``, with
    the draft vocabulary ``d2t`` (int32 ``[Vd]`` target ids) they draft from, if any; as
    ``save_head``."""
    tree = {"heads": list(heads["heads"])}
    config = {"target": target.to_dict(), "n_heads": len(tree["heads"]), "draft_vocab": 0}
    if d2t is not None:
        tree["d2t"] = np.asarray(d2t, np.int32)
        config["draft_vocab"] = int(tree["d2t"].size)
    return _save(dst, tree, "medusa1", config, fingerprint(target_params), training, overwrite)


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shipped_heads")
KINDS = {"eagle3": "eagle", "medusa1": "medusa"}  # manifest kind -> train-<name> / --drafter <name>


def shipped_head(model: str, kind: str = "eagle3") -> str:
    """The directory of the head of ``kind`` (``"eagle3"`` or ``"medusa1"``) that ships inside
    jaxspec for the packaged model ``model`` (``jaxspec/shipped_heads/MODEL/KIND``; the README
    gives the command, seed and data that trained each).

    Raises:
      ValueError: ``kind`` is not a head kind.
      FileNotFoundError: no such head ships for ``model`` (the message lists those that do).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    path = os.path.join(SHIPPED_DIR, model, kind)
    if os.path.basename(model) != model or not os.path.isfile(os.path.join(path, MANIFEST)):
        have = sorted(f"{m}/{k}" for m in (os.listdir(SHIPPED_DIR) if os.path.isdir(SHIPPED_DIR) else [])
                      for k in KINDS if os.path.isfile(os.path.join(SHIPPED_DIR, m, k, MANIFEST)))
        raise FileNotFoundError(f"no {kind} head ships for model {model!r} (shipped: {', '.join(have) or 'none'}): "
                                f"train one with python -m checkpoints_tools train-{KINDS[kind]}")
    return path


def convert_head(src: str, dst: str, dtype: str = "bfloat16", *, overwrite: bool = False) -> str:
    """Rewrite the head at ``src`` with its floating tensors in ``dtype`` (what ships: a
    bfloat16 head is half the bytes; ``_as_target_dtype`` casts it back to the target's dtype
    when it loads). The manifest (config, target fingerprint, training record) is kept; the
    tensor checksums are recomputed; ``src`` is read with every check of ``load_eagle_head``.

    Returns:
      The absolute path written.

    Raises:
      FileNotFoundError, ValueError: as ``read_head_manifest`` and the tensor checks.
      FileExistsError: ``dst`` exists and not ``overwrite``.
    """
    src = os.path.abspath(src)
    with open(os.path.join(src, MANIFEST)) as f:
        kind = json.load(f).get("kind")
    if kind not in KINDS:
        raise ValueError(f"{src!r}: kind {kind!r} is not a head kind ({sorted(KINDS)})")
    manifest = read_head_manifest(src, kind)
    tree = _restore(src, *_stored_shapes(manifest), manifest)
    cast = jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
    with open(os.path.join(src, MANIFEST)) as f:
        raw = json.load(f)
    return _save(dst, cast, kind, raw["config"], raw["target_fingerprint"],
                 dict(raw.get("training", {}), stored_dtype=dtype), overwrite)


def read_head_manifest(path: str, kind: str = "eagle3") -> dict:
    """The parsed ``head.json`` of a head of ``kind`` (``"eagle3"``: ``"config"`` becomes an
    ``EagleConfig``; ``"medusa1"``: ``"target"`` a ``ModelConfig``).

    Raises:
      FileNotFoundError: no such head directory or manifest (named).
      ValueError: unreadable or foreign manifest, or a head of another kind (named).
    """
    file = os.path.join(path, MANIFEST)
    name = {"eagle3": "EAGLE", "medusa1": "Medusa"}[kind]
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{name} head {path!r} not found: no {MANIFEST} there (write one with "
                                f"python -m checkpoints_tools train-{name.lower()})")
    try:
        with open(file) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION or manifest.get("kind") != kind:
            raise ValueError(f"format {manifest.get('format')!r} version {manifest.get('version')!r} kind "
                             f"{manifest.get('kind')!r}, expected {FORMAT!r} version {VERSION} kind {kind!r}")
        if kind == "eagle3":
            manifest["config"] = EagleConfig.from_dict(manifest["config"])
            manifest["target"] = manifest["config"].target
        else:
            manifest["target"] = ModelConfig.from_dict(manifest["config"]["target"])
            manifest["n_heads"] = int(manifest["config"]["n_heads"])
            manifest["draft_vocab"] = int(manifest["config"].get("draft_vocab", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file!r}: not a readable {name} head manifest: {e}") from e
    return manifest


def _checked(path: str, kind: str, target, config: ModelConfig | None):
    """``(manifest, target params, target config)`` once the head at ``path`` is known to be
    for this target (config, then weight fingerprint)."""
    params = getattr(target, "params", target)
    config = getattr(target, "config", config)
    if config is None:
        raise ValueError("config is required when target is a params pytree")
    require_decoder(config, f"a trained {kind} head", "the target's hidden states and embedding table")
    manifest = read_head_manifest(path, kind)
    check_head_target(manifest["target"], config, f"{path!r}")
    if fingerprint(params) != manifest["target_fingerprint"]:
        raise ValueError(f"{path!r} is a head for another {manifest['target'].name} (the target's weight fingerprint "
                         f"differs from the one stored in {MANIFEST}): train a head for this target")
    return manifest, config


def load_eagle_head(path: str, target, config: ModelConfig | None = None, *, gamma: int = 4, tree_nodes: int = 0,
                    branching: int = 4, confidence: float = 0.0):
    """Read an EAGLE-3 head for ``target`` and build its drafter.

    Args:
      path: a head directory written by ``save_head`` (``checkpoints_tools train-eagle``).
      target: the target ``jaxspec.Model``, or its params pytree (then pass ``config``).
      gamma, tree_nodes, branching, confidence: the ``EagleDrafter``'s (chain by default).

    Returns:
      ``(EagleDrafter, drafter_params)`` for ``jaxspec.generate(drafter=, drafter_params=)``.

    Raises:
      FileNotFoundError: no head at ``path``.
      ValueError: the head was trained for another target (config or weight fingerprint), a
        tensor is missing, truncated or altered (checksum), or its d2t map is not a set of
        distinct target ids. Every message names the file; all before anything compiles.
    """
    from jaxspec.drafters.eagle import EagleDrafter

    path = os.path.abspath(path)
    manifest, config = _checked(path, "eagle3", target, config)
    cfg = manifest["config"]
    tree = _restore(path, *_stored_shapes(manifest), manifest)
    drafter = EagleDrafter(cfg, gamma=gamma, tree_nodes=tree_nodes, branching=branching, confidence=confidence)
    return drafter, {"head": _as_target_dtype(tree["head"], target), "d2t": _checked_d2t(path, tree["d2t"], config)}


def _checked_d2t(path: str, d2t, config: ModelConfig) -> jax.Array:
    """A head's draft-to-target id map, once known to hold distinct target ids."""
    d2t = np.asarray(d2t)
    if len(set(d2t.tolist())) != d2t.size or d2t.min() < 0 or d2t.max() >= config.vocab_size:
        raise ValueError(f"{path!r}: d2t must hold {d2t.size} distinct target ids in [0, {config.vocab_size})")
    return jnp.asarray(d2t, jnp.int32)


def load_medusa_heads(path: str, target, config: ModelConfig | None = None, *, topk: tuple[int, ...] = (1, 1, 1, 1)):
    """Read Medusa-1 heads for ``target`` (``checkpoints_tools train-medusa``) and build a
    ``MedusaDrafter`` of ``topk`` (at most as many depths as heads).

    Returns:
      ``(MedusaDrafter, drafter_params)``.

    Raises:
      FileNotFoundError, ValueError: as ``load_eagle_head``'s, and ``topk`` deeper than the
        heads (named).
    """
    from jaxspec.drafters.medusa import MedusaDrafter

    path = os.path.abspath(path)
    manifest, config = _checked(path, "medusa1", target, config)
    n = manifest["n_heads"]
    if len(topk) > n:
        raise ValueError(f"topk {tuple(topk)} has {len(topk)} depths but {path!r} holds {n} Medusa heads")
    tree = _restore(path, *_stored_shapes(manifest), manifest)
    params = {"heads": _as_target_dtype(list(tree["heads"]), target)}
    if manifest["draft_vocab"]:
        params["d2t"] = _checked_d2t(path, tree["d2t"], config)
    return MedusaDrafter(config, topk=tuple(topk)), params


def _as_target_dtype(tree, target):
    """A head's floating tensors in the target's dtype (its embedding's): a head shipped in
    bfloat16 runs beside a float32 target in float32, and the reverse."""
    params = getattr(target, "params", target)
    dtype = (params["embed"] if "embed" in params else jax.tree_util.tree_leaves(params)[0]).dtype
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _stored_shapes(manifest: dict) -> tuple[dict, str]:
    """The params pytree (shape tuples as leaves) a head of this manifest stores, and what to
    call it in errors."""
    if manifest["kind"] == "eagle3":
        cfg = manifest["config"]
        return {"head": eagle3.param_shapes(cfg), "d2t": (cfg.draft_vocab,)}, cfg.layer.name
    n, d, vd = manifest["n_heads"], manifest["target"].dim, manifest["draft_vocab"]
    shapes = {"heads": [{"b": (d,), "w": (d, d)} for _ in range(n)], **({"d2t": (vd,)} if vd else {})}
    return shapes, f"{n} Medusa heads" + (f" over {vd} draft tokens" if vd else "")


def _restore(path: str, shapes: dict, what: str, manifest: dict) -> dict:
    import orbax.checkpoint as ocp

    params_dir = os.path.join(path, "params")
    expected = {_leaf_name(p): list(s) for p, s in
                jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]}
    stored = manifest.get("tensors", {})
    for name, shape in expected.items():
        if name not in stored or stored[name][0] != shape:
            raise ValueError(f"{params_dir!r}: tensor {name} is missing or has the wrong shape "
                             f"(manifest {stored.get(name, [None])[0]}, expected {shape} for {what})")
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            tree = ckpt.restore(params_dir)
    except Exception as e:  # orbax / tensorstore raise many types for a damaged directory
        raise ValueError(f"{params_dir!r}: cannot read the head ({type(e).__name__}: {str(e)[:200]})") from e
    sums = _checksums(tree)
    for name, (shape, dtype, digest) in stored.items():
        if name not in sums or sums[name][2] != digest:
            raise ValueError(f"{params_dir!r}: tensor {name} is truncated or altered (sha256 differs from "
                             f"{MANIFEST})")
    if isinstance(tree.get("heads"), dict):  # orbax may store a list as a dict keyed "0", "1", ...
        tree["heads"] = [tree["heads"][k] for k in sorted(tree["heads"], key=int)]
    return jax.tree_util.tree_map(jnp.asarray, tree)
