"""Scale out: run the whole generation (prefill and the ``lax.while_loop``) as one program
under ``jax.shard_map`` over a ``("data", "model")`` mesh.

- ``model`` axis: Megatron-style tensor parallelism of the target (Shoeybi et al. 2019,
  "Megatron-LM", Sec. 3): query and KV heads (the columns of wq/wk/wv and their biases, the
  rows of wo) and the MLP width (columns of w_gate/w_up, rows of w_down) are split over
  ``model``, with one ``psum`` after the attention output and one after the MLP down
  projection; embedding and output head are split over the vocabulary (embedding lookup in
  the local slice, then ``psum``; local logits, then an all-gather). The model code does the
  collectives when its config names the axis (``ModelConfig.tp_axis``; ``jaxspec.models.decoder``).
- ``data`` axis: batch rows. Every loop input with a batch axis is split over ``data``; KV
  caches are created inside the program, so they are ``[data, -, model, -]`` over
  ``[B, S, K, h]``. Each data shard runs its own ``while_loop`` until its own rows are done;
  collectives only ever span ``model``.

Every PartitionSpec of a parameter derives from one table: each parameter's logical axes,
declared once beside the param layout (``jaxspec.models.axes``), through ``RULES`` (logical
name -> mesh axis). ``generate(mesh=)`` places and ``shard_map``s with ``param_specs``;
``load(mesh=)`` and ``orbax_io.default_specs`` restore with ``tensor_spec_fn``, the same rules
with logical axes the mesh axis does not divide left whole. A parameter missing from the
table is an error naming it.

Choices, written down:

- Logits are gathered over the vocabulary, not sampled distributedly: a verify step gathers
  ``B * (gamma + 1) * V`` float32 logits (B=1, gamma=4, V=128256: 2.6 MB), nothing next to
  the gigabytes of weights each chip streams per step, and it keeps penalties, top-k/top-p,
  sampling and the acceptance test the exact code of the unsharded run, so the tokens are
  the same for the same seed whatever the mesh (RNG keys are per row and travel with rows).
- KV heads fewer than the ``model`` axis (Llama-3-8B: 8 KV heads, 16-way slice): each KV
  head's wk/wv columns are repeated ``model / KV`` times (``shard_params``), so every shard
  holds the one KV head its query heads read; replicas compute identical keys and values.
- The drafter is replicated (computed whole on every ``model`` shard of its data shard, no
  collectives) unless ``shard_drafter=True``; the early-exit drafter always runs on the
  target's own shards, since its weights are the target's.
- Batches are padded to a multiple of ``data`` on top of their batch bucket
  (``request.batch_bucket``), with the same one-token rows dropped from the results; head counts, MLP width and vocabulary must be
  divisible (an error naming the axis and the sizes, before any compile).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ModelConfig
from jaxspec.models import axes

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# The one rules table: logical axis (``jaxspec.models.axes``, declared once per parameter)
# -> mesh axis. Heads, MLP width and vocabulary split over ``model`` (Megatron-style: wq/wk/wv,
# their biases, w_gate/w_up and lm_head by output columns, wo/w_down by input rows, the
# embedding by its vocabulary rows); the residual width is never split.
RULES = {"vocab": MODEL, "embed": None, "q_heads": MODEL, "kv_heads": MODEL, "ffw": MODEL}


def make_mesh(data: int = 1, model: int = 1, *, devices=None) -> Mesh:
    """A ``(data, model)`` device mesh via ``jax.make_mesh`` (topology-aware device order).

    Args:
      data: batch rows are split over this many device groups.
      model: the target's heads, MLP width and vocabulary are split over this many devices.
      devices: default ``jax.devices()`` (all processes' devices under ``jax.distributed``).

    Raises:
      ValueError: a size < 1, or ``data * model`` not the number of devices.
    """
    for name, size in (("data", data), ("model", model)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name!r} size must be an integer >= 1, got {size!r}")
    devices = jax.devices() if devices is None else list(devices)
    if data * model != len(devices):
        raise ValueError(f"mesh {data}x{model} (data x model) needs {data * model} devices, there are {len(devices)}")
    return jax.make_mesh((data, model), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)`` (data, model). Raises ValueError on anything else."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"mesh must be DATAxMODEL with positive integers, e.g. 2x4, got {text!r}")
    return int(parts[0]), int(parts[1])


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with ``Auto`` axis types (``jax.make_mesh`` defaults to ``Explicit`` ones,
    sharding-in-types, which the ``shard_map``-ed program does not use): same devices, same
    axes, so arrays keep their layout."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return mesh if tuple(mesh.axis_types) == auto else Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def mesh_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(data, model)`` sizes. Raises ValueError when the axes are not exactly ``data, model``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (jaxspec.make_mesh), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES} (jaxspec.make_mesh), got {tuple(mesh.axis_names)}")
    return mesh.shape[DATA], mesh.shape[MODEL]


def check_model_axis(config: ModelConfig, n: int, what: str = "target") -> None:
    """Raise ValueError unless a ``model`` axis of size ``n`` can split ``config``: it must
    divide n_heads, ffn_dim and vocab_size, and n_kv_heads must be a multiple or a divisor
    of it (fewer KV heads than shards are repeated, see ``shard_params``)."""
    for field in ("n_heads", "ffn_dim", "vocab_size"):
        if getattr(config, field) % n:
            raise ValueError(f"mesh axis 'model' (size {n}) must divide the {what}'s {field} "
                             f"({getattr(config, field)}) of {config.name}")
    k = config.n_kv_heads
    if k % n and n % k:
        raise ValueError(f"mesh axis 'model' (size {n}) and the {what}'s n_kv_heads ({k}) of {config.name} "
                         f"must divide one another (each shard holds whole KV heads)")


def kv_repeats(config: ModelConfig, n: int) -> int:
    """How many times each KV head is stored so ``n`` shards each hold whole ones (>= 1)."""
    return max(n // config.n_kv_heads, 1)


def local_config(config: ModelConfig, n: int) -> ModelConfig:
    """One shard's view of ``config`` split ``n`` ways over ``model``: local head counts and
    MLP width, the full ``vocab_size`` (logits are gathered) and ``tp_axis = "model"``."""
    check_model_axis(config, n)
    return dataclasses.replace(
        config, n_heads=config.n_heads // n, n_kv_heads=config.n_kv_heads * kv_repeats(config, n) // n,
        ffn_dim=config.ffn_dim // n, tp_axis=MODEL,
    )


def logical_spec(logical: tuple, rules: dict = RULES) -> P:
    """PartitionSpec of a leaf whose dimensions have the ``logical`` axes, under ``rules``
    (logical name -> mesh axis or None). ``P()`` when no dimension is split: one spelling of
    "replicated", so shardings derived here compare equal wherever they were derived."""
    mesh_axes = tuple(None if name is None else rules[name] for name in logical)
    return P(*mesh_axes) if any(a is not None for a in mesh_axes) else P()


def fitted_rules(config: ModelConfig, n: int, axis: str = MODEL) -> dict:
    """``RULES`` over a mesh axis ``axis`` of size ``n`` for ``config``: a logical axis whose
    count (``axes.sizes``: heads, not columns) ``n`` does not divide stays replicated. On a
    jaxspec mesh ``check_model_axis`` has already refused all but KV heads fewer than ``n``,
    which stay whole here and are repeated by ``shard_params``."""
    counts = axes.sizes(config)
    return {name: axis if to is not None and counts[name] % n == 0 else None for name, to in RULES.items()}


def _path(tree_path) -> tuple:
    """A ``jax.tree_util`` key path as a ``TensorSpec.path``: ``("layers", 3, "wq")``."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in tree_path)


def param_specs(params: Any, sharded: bool = True) -> Any:
    """PartitionSpecs of a params pytree (``jaxspec.models.decoder`` layout): each leaf's
    logical axes (``jaxspec.models.axes``) through ``RULES``; everything replicated when not
    ``sharded``. Accepts None (a drafter without params).

    Raises:
      ValueError: a leaf has no declared logical axes (named), when ``sharded``.
    """
    def spec(path, x):
        return logical_spec(axes.leaf_axes(_path(path), x.ndim)) if sharded else P()

    return jax.tree_util.tree_map_with_path(spec, params)


def tensor_spec_fn(config: ModelConfig, n: int, axis: str = MODEL):
    """``fn(TensorSpec) -> PartitionSpec`` over a mesh axis ``axis`` of size ``n``: each
    tensor's logical axes through ``fitted_rules``. What ``orbax_io.default_specs`` and
    ``checkpoint_specs`` restore and place with."""
    rules = fitted_rules(config, n, axis)
    return lambda spec: logical_spec(axes.leaf_axes(spec.path, len(spec.shape)), rules)


def checkpoint_specs(config: ModelConfig, mesh: Mesh):
    """``fn(TensorSpec) -> PartitionSpec`` for restoring a checkpoint straight onto ``mesh``
    (``jaxspec.load(..., mesh=)``): ``param_specs``' layout, except that wk/wv/bk/bv stay
    replicated when KV heads must be repeated (``shard_params`` then cuts each shard's
    repeated head out of them).

    Raises:
      ValueError: the ``model`` axis does not divide the heads, MLP width or vocabulary.
    """
    n = mesh_sizes(mesh)[1]
    check_model_axis(config, n)
    return tensor_spec_fn(config, n)


def _repeat_kv(params: dict, config: ModelConfig, r: int) -> dict:
    hd = config.head_dim

    def rep(x):  # [..., K * hd] -> [..., K * r * hd], each head r times in a row
        heads = x.reshape(x.shape[:-1] + (x.shape[-1] // hd, hd))
        return jnp.repeat(heads, r, axis=-2).reshape(x.shape[:-1] + (-1,))

    kv = axes.leaves_along("kv_heads")
    layers = [{k: rep(v) if k in kv else v for k, v in layer.items()} for layer in params["layers"]]
    return {**params, "layers": layers}


def put(x, sharding: NamedSharding):
    """``x`` (numpy or jax array, PRNG keys included) as a global array with ``sharding``.

    Single process: ``jax.device_put`` (a no-op when ``x`` already has the sharding).
    Multi-process (``jax.distributed``): arrays local to this process are cut into the
    global array by ``jax.make_array_from_callback``; every process must pass the same value.
    """
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: dict, config: ModelConfig, mesh: Mesh, sharded: bool = True) -> dict:
    """Place a model's params on ``mesh`` for ``generate(..., mesh=mesh)``: split over
    ``model`` as ``param_specs`` says (after repeating KV heads when there are fewer than
    ``model`` shards), or replicated when not ``sharded``. Idempotent: params already placed
    (by an earlier call or ``jaxspec.load(..., mesh=)``) are returned as they are.

    Args:
      params: pytree in the ``jaxspec.models.decoder`` layout for ``config`` (matrices as
        arrays or ``layout.Panels``; placed as arrays).

    Raises:
      ValueError: the ``model`` axis does not divide the heads, MLP width or vocabulary.
    """
    from jaxspec.models import layout

    params = layout.as_arrays(params)  # a CPU load's matrices in panels: shards split plain [K, N] arrays
    n, mesh = mesh_sizes(mesh)[1], auto_axes(mesh)
    if not sharded:
        return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(mesh, P())), params)
    check_model_axis(config, n)
    r = kv_repeats(config, n)
    if r > 1 and params["layers"][0]["wk"].shape[-1] == config.n_kv_heads * config.head_dim:
        params = _repeat_kv(params, config, r)
    return jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(mesh, s)), params, param_specs(params))


def input_specs(inputs) -> Any:
    """PartitionSpecs of ``engine.Inputs``: per-row arrays (synthetic acceptance rates, gate thresholds and
    grammar start states included) over ``data``, stop-string and grammar tables (shared by all rows) replicated."""
    return dataclasses.replace(
        inputs, prompt=P(DATA), prompt_lens=P(DATA), max_new_tokens=P(DATA),
        sampling=jax.tree_util.tree_map(lambda _: P(DATA), inputs.sampling),
        keys=P(DATA), stops=jax.tree_util.tree_map(lambda _: P(), inputs.stops),
        synthetic_rates=None if inputs.synthetic_rates is None else P(DATA),
        gate_tau=None if inputs.gate_tau is None else P(DATA),
        grammar=None if inputs.grammar is None else dataclasses.replace(
            jax.tree_util.tree_map(lambda _: P(), inputs.grammar), initial=P(DATA)),
    )


def _per_row(drafter_params) -> bool:
    """Whether the drafter's params are per-row inputs (``[B, ...]`` leaves, the rows of a
    ``jaxspec.RolloutHistory``: ``HistoryRows``), placed over ``data`` like the prompts."""
    from jaxspec.drafters.history import HistoryRows

    return isinstance(drafter_params, HistoryRows)


def _drafter_specs(drafter, drafter_params, sharded: bool):
    """PartitionSpecs of a drafter's params: ``_per_row`` ones over ``data``, weights as
    ``param_specs``; a ``HybridDrafter``'s pair part by part."""
    if getattr(drafter, "kind", None) == "hybrid":
        return tuple(_drafter_specs(d, p, sharded) for d, p in zip((drafter.first, drafter.fallback), drafter_params))
    if _per_row(drafter_params):
        return jax.tree_util.tree_map(lambda _: P(DATA), drafter_params)
    return param_specs(drafter_params, sharded)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one ``generate`` call runs on a mesh (hashable: part of the compile-cache key).

    Attributes:
      mesh: the ``(data, model)`` mesh.
      config: the target's per-shard ``ModelConfig`` (``local_config``).
      drafter: the drafter as each shard runs it (a model drafter on sharded weights gets
        its per-shard config), or None.
      drafter_sharded: the drafter's params are split over ``model`` (else replicated).
    """

    mesh: Mesh
    config: ModelConfig
    drafter: Any
    drafter_sharded: bool

    @property
    def data(self) -> int:
        """Size of the ``data`` axis: batches are padded to a multiple of it."""
        return self.mesh.shape[DATA]

    def place(self, params, drafter_params, inputs, global_config: ModelConfig, drafter):
        """``(params, drafter_params, inputs)`` placed on the mesh; ``drafter_params`` is
        what ``drafter.select_params`` gives for the placed target params."""
        params = shard_params(params, global_config, self.mesh)
        if drafter is not None:
            drafter_params = self._place_drafter_params(drafter, drafter.select_params(params, drafter_params))
        specs = input_specs(inputs)
        inputs = jax.tree_util.tree_map(lambda x, s: put(x, NamedSharding(self.mesh, s)), inputs, specs)
        return params, drafter_params, inputs

    def _place_drafter_params(self, drafter, drafter_params):
        """A drafter's params on the mesh: a history's rows over ``data`` with their rows, a
        draft model's weights split over ``model`` (``drafter_sharded``) or replicated, a view
        of the target's as placed; a ``HybridDrafter``'s pair part by part."""
        if getattr(drafter, "kind", None) == "hybrid":
            return tuple(self._place_drafter_params(d, p) for d, p in zip((drafter.first, drafter.fallback),
                                                                           drafter_params))
        if _per_row(drafter_params):
            return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(self.mesh, P(DATA))), drafter_params)
        if drafter_params is not None and not drafter.capabilities.shares_target_weights:
            return shard_params(drafter_params, drafter.config, self.mesh, self.drafter_sharded)
        return drafter_params

    def wrap(self, fn):
        """``fn(target, drafter_params, inputs) -> pytree of [B, ...] arrays`` (written for one
        shard) as the whole-mesh function under ``jax.shard_map``, its output rows gathered over
        ``data`` and replicated on every device."""
        def sharded(target, drafter_params, inputs):
            in_specs = (param_specs(target), _drafter_specs(self.drafter, drafter_params, self.drafter_sharded),
                        input_specs(inputs))
            # check_vma=False: the loop predicate and sampled tokens are identical across
            # ``model`` shards by construction (gathered logits, replicated keys), which the
            # varying-manual-axes check cannot see.
            out = jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=P(DATA), check_vma=False)(
                target, drafter_params, inputs)
            return jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, P()))

        return sharded


def plan(mesh: Mesh, config: ModelConfig, drafter=None, shard_drafter: bool = False) -> Plan:
    """Check that ``mesh`` can run ``config`` (and the drafter) and return the ``Plan``.

    Raises:
      ValueError: the mesh's axes are not ``("data", "model")``; the ``model`` axis does not
        divide the target's (or a sharded drafter's) heads, MLP width or vocabulary; names
        the axis and the sizes. Raised before anything is compiled.
    """
    n, mesh = mesh_sizes(mesh)[1], auto_axes(mesh)
    local = local_config(config, n)
    if drafter is None:
        if shard_drafter:
            raise ValueError("shard_drafter=True needs a model drafter, got NoneType")
        return Plan(mesh, local, None, False)
    # A drafter on the target's weights runs on its shards; another is split only when asked.
    # How a drafter runs on one shard is its own to say (``Drafter.localized``).
    split = drafter.capabilities.shares_target_weights or shard_drafter
    return Plan(mesh, local, drafter.localized(n) if split else drafter, split)


def device_bytes(tree) -> dict:
    """Bytes of ``tree``'s arrays held by each device: ``{device: bytes}`` (what tests assert
    about per-chip memory)."""
    out: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
