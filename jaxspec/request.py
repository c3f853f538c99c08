"""One ``generate`` call's request, normalised on the host: prompts to token ids, per-row
settings, seeds and stop ids (``make``), the static shapes it runs as (``buckets``), and the
``engine.Inputs`` arrays the compiled program reads (``inputs``).

Everything that varies per call is a value here, never a static: prompts are padded to a
multiple of ``PROMPT_BUCKET`` tokens, caches to ``CACHE_BUCKET`` slots and batches to a power
of two (``batch_bucket``), so a new prompt, setting or seed within a bucket reuses the
compiled program (docs/design.md, "Per-request values are arrays").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import engine, grammar, stopping
from jaxspec.config import INT32_MAX, ModelConfig, SamplingConfig
from jaxspec.sampling import SamplingParams

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this many tokens
CACHE_BUCKET = 256  # cache slots are rounded up to a multiple of this
PROMPT_KINDS = "a str, a list of token ids (ints), or a list of those (or of strs)"
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "min_new_tokens")  # the per-row SamplingParams values


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def batch_bucket(rows: int, multiple: int = 1) -> int:
    """Rows a batch of ``rows`` runs as: the next power of two (1, 2, 4, 8, 16, ...), rounded
    up to a multiple of ``multiple`` (a mesh's ``data`` axis). Padded rows are one-token
    copies of row 0, dropped from the results (``Request.padded``)."""
    return _round_up(1 << (rows - 1).bit_length(), multiple)


def _rows_of(prompt) -> Sequence:
    """``prompt`` as a sequence of rows (each text or token ids), its kind checked."""
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
    return prompt


def _row_ids(i: int, p, tokenizer, chat: bool) -> list[int]:
    """Token ids of prompt row ``i`` (text is encoded, in the chat template when ``chat``)."""
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
    if not p:
        raise ValueError(f"prompt {i} is empty (0 tokens)")
    return [int(t) for t in p]


def prompt_ids(prompt, tokenizer, chat: bool) -> list[list[int]]:
    """Token ids of each prompt of ``prompt`` (``generate``'s argument: its kinds there).

    Raises:
      ValueError: an empty prompt, a prompt that is not text or token ids (bytes included),
        text without a tokenizer, token ids with ``chat``.
    """
    return [_row_ids(i, p, tokenizer, chat) for i, p in enumerate(_rows_of(prompt))]


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
      grammar: the rows' structured-output automata (``jaxspec.grammar.HostTables``, one
        initial state per row), or None when no row has one.
    """

    rows: list[list[int]]
    prompt_lens: np.ndarray
    max_new_tokens: np.ndarray
    seeds: np.ndarray
    settings: dict[str, np.ndarray]
    stop_ids: tuple[int, ...]
    sampling: SamplingConfig
    grammar: grammar.HostTables | None = None

    def padded(self, batch: int) -> Request:
        """This request with ``batch - B`` one-token copies of row 0 appended: the one padding
        of rows (batch buckets, a mesh's ``data`` axis); ``generate`` drops them again."""
        extra = batch - len(self.rows)
        if extra == 0:
            return self
        def grow(x):  # the values of row 0 for the padding rows
            return np.concatenate([x, np.repeat(x[:1], extra)])

        g = self.grammar
        return dataclasses.replace(
            self, grammar=None if g is None else dataclasses.replace(g, initial=grow(g.initial)),
            rows=self.rows + [self.rows[0]] * extra, prompt_lens=grow(self.prompt_lens),
            max_new_tokens=np.concatenate([self.max_new_tokens, np.ones(extra, np.int32)]), seeds=grow(self.seeds),
            settings={k: grow(v) for k, v in self.settings.items()})


def _check_ids(what: str, ids, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")


def _check_lengths(lens: np.ndarray, max_new: np.ndarray, config: ModelConfig, max_len: int | None) -> None:
    limit = config.max_position if max_len is None else max_len
    longest = int((lens + max_new).max())
    if longest > limit:
        i = int(np.argmax(lens + max_new))
        raise ValueError(
            f"prompt ({int(lens[i])} tokens) + max_new_tokens ({int(max_new[i])}) = {longest} exceeds max_len "
            f"({limit}{', the context of ' + config.name if max_len is None else ''})"
        )


def make(prompt, sc: SamplingConfig, config: ModelConfig, tokenizer, chat: bool, max_len: int | None) -> Request:
    """Prompts, per-row settings, seeds and stop ids of one call, checked.

    Raises:
      ValueError: empty prompt, a prompt that is not text or token ids, token id outside the
        vocabulary (prompt or stop id), a per-prompt setting of the wrong length, prompt +
        ``max_new_tokens`` over ``max_len``, stop strings without a tokenizer; a ``regex`` or
        ``response_format`` without a tokenizer, that cannot be compiled, or over
        ``jaxspec.grammar.MAX_STATES`` automaton states (``jaxspec.grammar``).
    """
    prompts = prompt_ids(prompt, tokenizer, chat)
    for i, r in enumerate(prompts):
        _check_ids(f"prompt {i}", r, config.vocab_size)
    n_prompts = len(prompts)
    def per_row(name):  # a setting's value for every row (each prompt's, repeated for its n samples)
        return np.repeat(sc.per_prompt(name, n_prompts), sc.n)

    rows = [r for r in prompts for _ in range(sc.n)]
    lens = np.array([len(r) for r in rows], np.int64)
    max_new = per_row("max_new_tokens").astype(np.int64)  # int32 only once checked (SamplingConfig bounds it)
    _check_lengths(lens, max_new, config, max_len)
    if np.ndim(sc.seed) == 0:
        seeds = np.int64(sc.seed) + np.arange(len(rows))
    else:
        seeds = per_row("seed").astype(np.int64) + np.tile(np.arange(sc.n), n_prompts)
    _check_ids("stop_token_ids", sc.stop_token_ids, config.vocab_size)
    if sc.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer (the model has none): pass tokenizer= or use stop_token_ids")
    stop_ids = stopping.stop_ids(config.eos_ids, sc)
    automata = [grammar.compile_grammar(*sc.grammar_of(i, n_prompts), tokenizer) for i in range(n_prompts)]
    tables = None
    if any(a is not None for a in automata):
        tables = grammar.tables([a for a in automata for _ in range(sc.n)], stop_ids, config.vocab_size)
    return Request(rows=rows, prompt_lens=lens.astype(np.int32), max_new_tokens=max_new.astype(np.int32), seeds=seeds,
                   settings={name: per_row(name) for name in SETTINGS}, stop_ids=stop_ids, sampling=sc,
                   grammar=tables)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The static shapes one call compiles for: ``batch`` rows, prompts padded to
    ``prompt_len`` tokens, ``cache_len`` cache slots (also the token buffer's length)."""

    batch: int
    prompt_len: int
    cache_len: int


def buckets(req: Request, window: int, data: int = 1) -> Buckets:
    """Prompt length to a multiple of ``PROMPT_BUCKET``, cache slots (prompt bucket +
    ``max_new_tokens`` + the verify window ``window``, ``engine.window``) to a multiple of
    ``CACHE_BUCKET``, rows to ``batch_bucket`` (a multiple of the mesh's ``data`` axis).

    Raises:
      ValueError: a cache over 2**31 - 1 slots (positions are int32).
    """
    p = _round_up(int(req.prompt_lens.max()), PROMPT_BUCKET)
    cache_len = _round_up(p + int(req.max_new_tokens.max()) + window, CACHE_BUCKET)
    if cache_len > INT32_MAX:  # reachable only with a max_len near 2**31
        raise ValueError(f"the cache would need {cache_len} slots (prompt bucket {p} + max_new_tokens "
                         f"{int(req.max_new_tokens.max())} + verify window {window}, rounded up to {CACHE_BUCKET}), "
                         f"over 2**31 - 1 (int32 positions): lower max_new_tokens or max_len")
    return Buckets(batch=batch_bucket(len(req.rows), data), prompt_len=p, cache_len=cache_len)


def inputs(req: Request, shapes: Buckets, vocab_size: int, tokenizer, synthetic_rates=None,
           gate_tau: float | None = None) -> engine.Inputs:
    """``engine.Inputs`` of a request already padded to ``shapes.batch`` rows (with the
    synthetic acceptance's per-row rates ``synthetic_rates`` float32 ``[B, gamma]``, and the
    acceptance gate's threshold for every row, when given)."""
    b, sc = len(req.rows), req.sampling
    prompt = np.zeros((b, shapes.prompt_len), np.int32)
    for i, r in enumerate(req.rows):
        prompt[i, : len(r)] = r
    return engine.Inputs(
        prompt=jnp.asarray(prompt),
        prompt_lens=jnp.asarray(req.prompt_lens),
        max_new_tokens=jnp.asarray(req.max_new_tokens),
        sampling=SamplingParams.make(b, stop_ids=stopping.padded_ids(req.stop_ids), **req.settings),
        keys=jax.vmap(jax.random.key)(jnp.asarray(req.seeds % (2**32), dtype=jnp.uint32)),
        stops=stopping.tables(sc.stop, tokenizer, vocab_size),
        synthetic_rates=synthetic_rates,
        gate_tau=None if gate_tau is None else jnp.full((b,), gate_tau, jnp.float32),
        grammar=None if req.grammar is None else req.grammar.device(),
    )
