"""Frozen, hashable configuration dataclasses.

``ModelConfig`` is static: passed to ``jax.jit`` as a static argument, it decides shapes.
``SamplingConfig`` is what a user asks for; its numeric settings become per-row device
arrays (``jaxspec.sampling.SamplingParams``), so changing them never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp


def default_dtype():
    """Parameter dtype default: float32 on CPU (XLA:CPU runs bfloat16 3.6x slower, DESIGN.md),
    bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2).

    Attributes:
      vocab_size: V, number of token ids.
      dim: D, residual stream width.
      n_layers: number of decoder blocks.
      n_heads: H, query heads.
      n_kv_heads: KV heads (grouped-query attention, Ainslie et al. 2023); divides ``n_heads``.
      head_dim: per-head width; ``n_heads * head_dim`` is the attention width.
      ffn_dim: F, hidden width of the SwiGLU MLP (Shazeer 2020).
      rope_theta: RoPE base (Su et al. 2021), e.g. 1e4 (Llama 2) or 1e5 (SmolLM2).
      norm_eps: RMSNorm epsilon (Zhang & Sennrich 2019).
      tie_embeddings: output head is the transposed embedding table (no ``lm_head`` param).
      max_position: longest context the checkpoint was trained for (tokens).
      bos_id: beginning-of-sequence id, or -1 when the model has none.
      eos_ids: ids that end generation.
      name: human-readable name, used in messages.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position: int = 8192
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

    def truncated(self, n_layers: int) -> "ModelConfig":
        """The same model with only its first ``n_layers`` blocks (early-exit drafting)."""
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.n_layers}], got {n_layers}")
        return dataclasses.replace(self, n_layers=n_layers, name=f"{self.name}[:{n_layers}]")


_PerRow = "float | Sequence[float]"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample: every setting of ``jaxspec.generate``, with vLLM's names and meanings.

    Numeric settings take one value for every prompt or a sequence with one per prompt;
    they travel to the device as per-row arrays, so changing them never recompiles
    (``n_top`` logprobs, the number of stop strings and their lengths, which set array
    shapes, are bucketed).

    Attributes:
      max_new_tokens: most new tokens per sample (>= 1), stop token included.
      min_new_tokens: fewest new tokens (>= 0, <= max_new_tokens); until then EOS and stop
        ids get probability 0 and stop strings do not count (vLLM ``min_tokens``).
      temperature: >= 0; 0 is greedy (argmax after penalties).
      top_k: >= 0, 0 = off. top_p: in (0, 1], 1 = off. min_p: in [0, 1], 0 = off.
      repetition_penalty: > 0, 1 = off (CTRL; prompt and generated tokens).
      frequency_penalty, presence_penalty: in [-2, 2], 0 = off (OpenAI; generated tokens).
      seed: an int (sample r of the call uses ``seed + r``) or one int per prompt (its n
        samples use ``seed_i + j``).
      n: samples per prompt (>= 1); results are prompt-major (prompt i, sample j at i*n + j).
      stop: stop strings; the text ends before the earliest-ending one (or after it with
        ``include_stop_str_in_output``); tokens end with the token that completed it.
      stop_token_ids: ids that end a sample, besides EOS (kept as the last token).
      ignore_eos: do not stop at the model's EOS ids.
      logprobs: None, or n >= 0: report each generated token's log-probability and the n
        most probable alternatives.
      logprobs_mode: ``"raw"`` (log-softmax of the model's logits, before any setting:
        vLLM's default) or ``"processed"`` (of the distribution sampled from).

    Raises:
      ValueError: a setting out of its range, naming it and the range.
    """

    max_new_tokens: int | Sequence[int] = 128
    min_new_tokens: int | Sequence[int] = 0
    temperature: _PerRow = 0.0
    top_k: int | Sequence[int] = 0
    top_p: _PerRow = 1.0
    min_p: _PerRow = 0.0
    repetition_penalty: _PerRow = 1.0
    frequency_penalty: _PerRow = 0.0
    presence_penalty: _PerRow = 0.0
    seed: int | Sequence[int] = 0
    n: int = 1
    stop: str | Sequence[str] = ()
    stop_token_ids: int | Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    # name -> (integer?, check, range in words)
    _RANGES = {
        "max_new_tokens": (True, lambda x: x >= 1, ">= 1"),
        "min_new_tokens": (True, lambda x: x >= 0, ">= 0"),
        "temperature": (False, lambda x: x >= 0, ">= 0"),
        "top_k": (True, lambda x: x >= 0, ">= 0 (0 = off)"),
        "top_p": (False, lambda x: (x > 0) & (x <= 1), "in (0, 1]"),
        "min_p": (False, lambda x: (x >= 0) & (x <= 1), "in [0, 1]"),
        "repetition_penalty": (False, lambda x: x > 0, "> 0 (1 = off)"),
        "frequency_penalty": (False, lambda x: (x >= -2) & (x <= 2), "in [-2, 2]"),
        "presence_penalty": (False, lambda x: (x >= -2) & (x <= 2), "in [-2, 2]"),
        "seed": (True, lambda x: x >= 0, ">= 0"),
    }

    def __post_init__(self):
        import numpy as np

        for name, (integer, ok, words) in self._RANGES.items():
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                value = tuple(np.asarray(value).tolist())
                object.__setattr__(self, name, value)
            arr = np.asarray(value)
            kind_ok = arr.dtype != bool and (np.issubdtype(arr.dtype, np.integer) if integer else np.issubdtype(arr.dtype, np.number))
            if not kind_ok or arr.ndim > 1 or arr.size == 0:
                what = f"an integer {words}" if integer else f"a number {words}"
                raise ValueError(f"{name} must be {what} (or a list with one per prompt), got {value!r}")
            if not np.all(np.isfinite(arr)) or not np.all(ok(arr)):
                raise ValueError(f"{name} must be {'an integer ' if integer else 'finite and '}{words}, got {value!r}")
        if np.any(np.asarray(self.min_new_tokens) > np.asarray(self.max_new_tokens)):
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens!r}) must be <= max_new_tokens ({self.max_new_tokens!r})"
            )
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, (int, np.integer)) else tuple(self.stop_token_ids)
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"stop_token_ids must be token ids (ints), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")

    def per_prompt(self, name: str, n_prompts: int):
        """``name``'s values as a numpy array ``[n_prompts]``.

        Raises:
          ValueError: a per-prompt sequence whose length is not ``n_prompts``.
        """
        import numpy as np

        arr = np.asarray(getattr(self, name))
        if arr.ndim == 1 and arr.shape[0] != n_prompts:
            raise ValueError(f"{name} has {arr.shape[0]} values; give one value or one per prompt ({n_prompts})")
        return np.broadcast_to(arr, (n_prompts,)).copy()


MAX_LOGPROBS = 20  # as the OpenAI API
