"""Frozen, hashable configuration dataclasses.

``ModelConfig`` is static: passed to ``jax.jit`` as a static argument, it decides shapes.
``SamplingConfig`` is what a user asks for; its numeric settings become per-row device
arrays (``jaxspec.sampling.SamplingParams``), so changing them never recompiles.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp


def default_dtype():
    """Parameter dtype default: float32 on CPU (XLA:CPU runs bfloat16 3.6x slower, docs/design.md),
    bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


LAYER_TYPES = ("full", "sliding")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long contexts (applies to full-attention layers).

    Attributes:
      kind: ``"linear"`` (position interpolation, Chen et al. 2023: every inverse frequency
        divided by ``factor``) or ``"llama3"`` (Meta's Llama 3.1 rule: wavelengths longer than
        ``original_max_position / low_freq_factor`` divided by ``factor``, shorter than
        ``original_max_position / high_freq_factor`` kept, smooth in between; transformers'
        ``_compute_llama3_parameters``), or ``"factors"`` (each inverse frequency divided by
        its own entry of ``factors``: how llama.cpp stores Llama 3.1 scaling, as a
        ``rope_freqs`` tensor).
      factor: context extension factor (> 0).
      low_freq_factor, high_freq_factor: llama3 band edges.
      original_max_position: llama3 pre-extension context length (tokens).
      factors: ``head_dim / 2`` divisors (``"factors"`` only).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    factors: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "factors", tuple(float(f) for f in self.factors))
        if self.kind not in ("linear", "llama3", "factors"):
            raise ValueError(f"RopeScaling.kind must be 'linear', 'llama3' or 'factors', got {self.kind!r}")
        if (self.kind == "factors") != bool(self.factors):
            raise ValueError("RopeScaling.factors must be given exactly when kind is 'factors'")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer: the Llama family (Llama 2/3, Mistral,
    Qwen2, Qwen3, SmolLM2) and Gemma 3, told apart by the switches below.

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
      family: architecture label (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma3``); it
        picks checkpoint tensor names, never the math (the switches below do that).
      attn_bias: q/k/v projections have biases (Qwen2).
      qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
      rope_scaling: ``RopeScaling`` of full-attention layers, or None.
      sliding_window: W > 0: a query on a sliding layer sees only the W most recent keys
        (itself included); 0: no sliding layers.
      layer_types: per layer ``"full"`` or ``"sliding"``; ``()`` means every layer is sliding
        when ``sliding_window`` > 0 (Mistral v0.1) and full otherwise.
      rope_local_theta: RoPE base of sliding layers, unscaled (Gemma 3: 1e4); 0 = ``rope_theta``
        with ``rope_scaling``, like the full layers.
      norm_offset: RMSNorm multiplies by ``norm_offset + weight`` (Gemma stores ``weight - 1``: 1.0).
      sandwich_norms: extra RMSNorms after attention and after the MLP, before each residual
        add (Gemma 2/3: ``post_attn_norm``, ``post_mlp_norm`` params).
      embed_scale: embeddings are multiplied by this (Gemma: ``sqrt(dim)``), in the params dtype.
      activation: MLP gate activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
      attn_scale: attention score scale; 0 means ``head_dim ** -0.5`` (Gemma 3 uses
        ``query_pre_attn_scalar ** -0.5``).
      final_softcap: > 0: logits become ``cap * tanh(logits / cap)``; 0: off. (Gemma 3 configs
        also carry ``attn_logit_softcapping``, a Gemma 2 feature that transformers' and llama.cpp's
        Gemma 3 ignore; so do we.)
      tp_axis: runtime only, never saved: the ``jax.shard_map`` mesh axis this config's params
        are split over (Megatron tensor parallelism, ``jaxspec.sharding``); then ``n_heads``,
        ``n_kv_heads`` and ``ffn_dim`` count one shard's part and the model sums partial
        results over the axis. ``""``: unsharded.
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
    family: str = "llama"
    attn_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    activation: str = "silu"
    attn_scale: float = 0.0
    final_softcap: float = 0.0
    tp_axis: str = ""

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window must be >= 0, got {self.sliding_window}")
        if self.layer_types:
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"ModelConfig.layer_types must hold n_layers ({self.n_layers}) values from {LAYER_TYPES}, "
                    f"got {len(self.layer_types)} ({bad[:1] or 'length'})"
                )
            if "sliding" in self.layer_types and self.sliding_window < 1:
                raise ValueError("ModelConfig.layer_types has sliding layers but sliding_window is 0")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if isinstance(self.rope_scaling, dict):  # e.g. from JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    def is_sliding(self, layer: int) -> bool:
        """Whether block ``layer`` attends over a sliding window of ``sliding_window`` keys."""
        if self.layer_types:
            return self.layer_types[layer] == "sliding"
        return self.sliding_window > 0

    def to_dict(self) -> dict:
        """JSON-ready dict; ``ModelConfig.from_dict`` inverts it."""
        d = dataclasses.asdict(self)
        del d["tp_axis"]  # how a run is split, not what the checkpoint holds
        d["eos_ids"], d["layer_types"] = list(self.eos_ids), list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of ``to_dict``. Raises ValueError naming unknown fields (a newer jaxspec's file)."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        return cls(**d)

    def truncated(self, n_layers: int) -> "ModelConfig":
        """The same model with only its first ``n_layers`` blocks (early-exit drafting)."""
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.n_layers}], got {n_layers}")
        return dataclasses.replace(self, n_layers=n_layers, name=f"{self.name}[:{n_layers}]",
                                   layer_types=self.layer_types[:n_layers])


def check_bool(name: str, value) -> bool:
    """``value`` as a bool; it must be one (``True``/``False`` or a numpy bool), not merely truthy.

    Raises:
      ValueError: anything else, naming ``name``.
    """
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r:.80}")
    return bool(value)


_PerRow = "float | Sequence[float]"
INT32_MAX = 2**31 - 1  # integer settings (and token counts) run as int32
SEED_MAX = 2**32 - 1  # a row's PRNG key is jax.random.key of a uint32


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample: every setting of ``jaxspec.generate``, with vLLM's names and meanings.

    Numeric settings take one value for every prompt or a sequence with one per prompt;
    they travel to the device as per-row arrays, so changing them never recompiles
    (``n_top`` logprobs, the number of stop strings and their lengths, which set array
    shapes, are bucketed).

    Attributes:
      max_new_tokens: most new tokens per sample, an int in [1, 2**31 - 1] (token counts run
        as int32; ``generate`` also requires prompt + max_new_tokens <= its ``max_len``),
        stop token included.
      min_new_tokens: fewest new tokens (>= 0, <= max_new_tokens); until then EOS and stop
        ids get probability 0 and stop strings do not count (vLLM ``min_tokens``).
      temperature: >= 0; 0 is greedy (argmax after penalties).
      top_k: an int in [0, 2**31 - 1] (int32), 0 = off; k >= the vocabulary keeps every token.
        top_p: in (0, 1], 1 = off. min_p: in [0, 1], 0 = off.
      repetition_penalty: > 0, 1 = off (CTRL; prompt and generated tokens).
      frequency_penalty, presence_penalty: in [-2, 2], 0 = off (OpenAI; generated tokens).
        Float settings run as float32: their float32 value must be in range (and finite).
      seed: an int in [0, 2**32 - 1] (a row's PRNG key is ``jax.random.key`` of a uint32;
        sample r of the call uses ``(seed + r) mod 2**32``) or one such int per prompt (its n
        samples use ``seed_i + j``).
      n: samples per prompt, an int in [1, 2**31 - 1]; results are prompt-major (prompt i,
        sample j at i*n + j).
      stop: a stop string or a list of them; the text ends before the earliest-ending one (or
        after it with ``include_stop_str_in_output``, a bool); tokens end with the token that
        completed it.
      stop_token_ids: an id or a list of ids that end a sample, besides EOS (kept as the last
        token); ``generate`` checks them against the vocabulary.
      ignore_eos: a bool: do not stop at the model's EOS ids.
      logprobs: None, or n in [0, 20]: report each generated token's log-probability and the n
        most probable alternatives.
      logprobs_mode: ``"raw"`` (log-softmax of the model's logits, before any setting:
        vLLM's default) or ``"processed"`` (of the distribution sampled from).
      regex: structured output: the text matches this regular expression (outlines-core's
        syntax; vLLM's ``guided_regex``), or None; a str or one per prompt (None: free).
      response_format: structured output as the OpenAI API asks for it:
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
        ``{"type": "json_object"}`` or ``{"type": "text"}`` (free), or None; a dict or one
        per prompt. Not with ``regex``. ``jaxspec.grammar`` compiles both (with the model's
        tokenizer, before anything runs); the text stops where the automaton allows nothing
        more, or at EOS once it may end.

    Raises:
      ValueError: a setting of the wrong type (integer settings take ints, bool settings
        ``True``/``False`` only) or out of its range, naming it and the range.
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
    regex: str | Sequence[str | None] | None = None
    response_format: dict | Sequence[dict | None] | None = None

    # name -> (integer?, check, range in words). Integers are checked as Python ints, before
    # any conversion: they run as int32 (the seed as uint32), so a larger value would wrap.
    _RANGES = {
        "max_new_tokens": (True, lambda x: 1 <= x <= INT32_MAX, "in [1, 2**31 - 1]"),
        "min_new_tokens": (True, lambda x: 0 <= x <= INT32_MAX, "in [0, 2**31 - 1]"),
        "temperature": (False, lambda x: x >= 0, ">= 0"),
        "top_k": (True, lambda x: 0 <= x <= INT32_MAX, "in [0, 2**31 - 1] (0 = off)"),
        "top_p": (False, lambda x: 0 < x <= 1, "in (0, 1]"),
        "min_p": (False, lambda x: 0 <= x <= 1, "in [0, 1]"),
        "repetition_penalty": (False, lambda x: x > 0, "> 0 (1 = off)"),
        "frequency_penalty": (False, lambda x: -2 <= x <= 2, "in [-2, 2]"),
        "presence_penalty": (False, lambda x: -2 <= x <= 2, "in [-2, 2]"),
        "seed": (True, lambda x: 0 <= x <= SEED_MAX, "in [0, 2**32 - 1]"),
    }

    def __post_init__(self):
        import numpy as np

        for name, (integer, ok, words) in self._RANGES.items():
            value = getattr(self, name)
            sequence = isinstance(value, (list, tuple, range, np.ndarray))
            items = (value.tolist() if isinstance(value, np.ndarray) else list(value)) if sequence else [value]
            kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
            if not items or not all(isinstance(x, kinds) and not isinstance(x, (bool, np.bool_)) for x in items):
                what = f"an integer {words}" if integer else f"a number {words}"
                raise ValueError(f"{name} must be {what} (or a list with one per prompt), got {value!r}")
            for x in items:
                if integer and not ok(int(x)):
                    raise ValueError(f"{name} must be an integer {words}, got {x!r}")
                if not integer:  # float settings run as float32: the rounded value must be in range too
                    exact = float(x) if not isinstance(x, int) or abs(x) < 2**1000 else math.inf
                    with np.errstate(over="ignore"):
                        as_run = float(np.float32(exact))
                    if not (math.isfinite(exact) and ok(exact)):
                        raise ValueError(f"{name} must be finite and {words}, got {x!r}")
                    if not (math.isfinite(as_run) and ok(as_run)):
                        raise ValueError(f"{name} must be finite and {words} in float32, as it runs: {x!r} is {as_run}")
            if sequence:
                object.__setattr__(self, name, tuple(int(x) if integer else float(x) for x in items))
        low, high = np.asarray(self.min_new_tokens), np.asarray(self.max_new_tokens)
        if low.ndim == high.ndim == 1 and low.size != high.size:
            raise ValueError(f"min_new_tokens has {low.size} values and max_new_tokens {high.size}: give one value "
                             f"or one per prompt for each")
        if np.any(low > high):
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens!r}) must be <= max_new_tokens ({self.max_new_tokens!r})"
            )
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= INT32_MAX:
            raise ValueError(f"n (samples per prompt) must be an integer in [1, 2**31 - 1], got {self.n!r}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        ids = ids.tolist() if isinstance(ids, np.ndarray) and ids.ndim == 1 else ids
        ids = (ids,) if isinstance(ids, (int, np.integer)) else tuple(ids) if isinstance(ids, (list, tuple)) else None
        if ids is None or not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
                                  for i in ids):
            raise ValueError(f"stop_token_ids must be a token id or a list of them (ints), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        if not isinstance(self.logprobs_mode, str) or self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        for name, kind, words in (("regex", str, "a non-empty string"), ("response_format", dict, "a dict")):
            value = getattr(self, name)
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if not all(x is None or (isinstance(x, kind) and (kind is dict or x)) for x in items):
                raise ValueError(f"{name} must be None, {words} or a list with one (or None) per prompt, "
                                 f"got {value!r:.120}")
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.regex is not None and self.response_format is not None:
            raise ValueError("regex and response_format together: give one of them")

    def grammar_of(self, i: int, n_prompts: int) -> tuple[str | None, dict | None]:
        """``(regex, response_format)`` of prompt ``i``.

        Raises:
          ValueError: a per-prompt list whose length is not ``n_prompts``.
        """
        out = []
        for name in ("regex", "response_format"):
            value = getattr(self, name)
            if isinstance(value, tuple):
                if len(value) != n_prompts:
                    raise ValueError(f"{name} has {len(value)} values; give one value or one per prompt ({n_prompts})")
                value = value[i]
            out.append(value)
        return out[0], out[1]

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
