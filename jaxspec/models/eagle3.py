"""The EAGLE-3 draft head as pure functions: what ``jaxspec.drafters.EagleDrafter`` runs and
``checkpoints_tools train-eagle`` trains (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", Sec. 3).

The head reads three of the target's layers (low, middle, high), fuses them with one linear
layer ``fc`` (3D -> D), and runs ONE decoder layer whose attention input is the
concatenation ``[norm(embedding of the next token), norm(feature)]`` (2D wide; the residual
is the feature), then a final norm and its own output head over a REDUCED draft vocabulary
of Vd tokens; ``d2t[j]`` is the target id of draft id j. The token embedding is the
target's, frozen (never in the head's params). The layer's output hidden state is the
feature of the next draft step (the head feeds itself while drafting).

Layer choice: the reference implementation (SafeAILab/EAGLE ``traineagle3``, vLLM
``llama_eagle3.py``) captures the INPUTS of target layers 2, L/2 and L-3; in jaxspec's
convention (``ForwardOutput.captured``: layer i's output, Hugging Face's
``hidden_states[i + 1]``) those are the outputs of layers 1, L/2 - 1 and L - 4
(``default_capture``), clamped into ``[0, L)`` for tiny targets.

Params layout (``y = x @ W``)::

    {"fc": [3D, D],
     "layer": {"input_norm": [D], "hidden_norm": [D],
               "wq": [2D, H*h], "wk": [2D, K*h], "wv": [2D, K*h], "wo": [H*h, D],
               "mlp_norm": [D], "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]},
     "norm": [D], "lm_head": [D, Vd]}

Shape letters: the package legend; Vd the draft vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import decoder
from jaxspec.models.linear import linear
from jaxspec.models.target import require_decoder


def default_capture(n_layers: int) -> tuple[int, int, int]:
    """Low, middle, high target layers an EAGLE-3 head reads: the outputs of layers 1,
    L/2 - 1 and L - 4 (the inputs of layers 2, L/2, L-3 of the reference code), each
    clamped into ``[0, L)``, sorted. SmolLM2 (L = 30): (1, 14, 26)."""
    return tuple(sorted(min(max(i, 0), n_layers - 1) for i in (1, n_layers // 2 - 1, n_layers - 4)))


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static shape of an EAGLE-3 head (hashable: part of the drafter, a static jit argument).

    Attributes:
      target: the target's ``ModelConfig`` (what the head was trained for; ``tp_axis`` "").
      draft_vocab: Vd, tokens the head can draft, ``2 <= Vd <= target.vocab_size``.
      capture: the three target layers it reads (``default_capture``).
      ffn_dim: F of its decoder layer; 0 = the target's.

    Raises:
      ValueError: ``draft_vocab`` out of range, ``capture`` not three layers of the target.
    """

    target: ModelConfig
    draft_vocab: int
    capture: tuple[int, ...] = ()
    ffn_dim: int = 0

    def __post_init__(self):
        require_decoder(self.target, "an EAGLE-3 head", "the target's layer outputs and embedding table")
        v = self.target.vocab_size
        if not isinstance(self.draft_vocab, int) or not 2 <= self.draft_vocab <= v:
            raise ValueError(f"draft_vocab must be an integer in [2, {v}] (the target's vocabulary), "
                             f"got {self.draft_vocab!r}")
        capture = tuple(self.capture) or default_capture(self.target.n_layers)
        if len(capture) != 3 or not all(0 <= i < self.target.n_layers for i in capture):
            raise ValueError(f"capture must be 3 layer ids in [0, {self.target.n_layers}), got {capture}")
        object.__setattr__(self, "capture", tuple(int(i) for i in capture))
        object.__setattr__(self, "target", dataclasses.replace(self.target, tp_axis=""))

    @property
    def layer(self) -> ModelConfig:
        """The head's decoder layer as a one-layer ``ModelConfig`` (the target's heads, head dim,
        RoPE and norms; full attention, no biases, no q/k norms, no sandwich norms)."""
        t = self.target
        return dataclasses.replace(
            t, vocab_size=self.draft_vocab, n_layers=1, ffn_dim=self.ffn_dim or t.ffn_dim, layer_types=(),
            sliding_window=0, attn_bias=False, qk_norm=False, sandwich_norms=False, norm_offset=0.0,
            final_softcap=0.0, tp_axis="", name=f"eagle3[{t.name}]")

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft_vocab": self.draft_vocab, "capture": list(self.capture),
                "ffn_dim": self.ffn_dim}

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        return cls(ModelConfig.from_dict(d["target"]), int(d["draft_vocab"]), tuple(d["capture"]), int(d["ffn_dim"]))


def param_shapes(config: EagleConfig) -> dict:
    """The head's params pytree with shape tuples as leaves (module docstring)."""
    c = config.layer
    d, f, hd = c.dim, c.ffn_dim, c.head_dim
    layer = {"input_norm": (d,), "hidden_norm": (d,), "wq": (2 * d, c.n_heads * hd),
             "wk": (2 * d, c.n_kv_heads * hd), "wv": (2 * d, c.n_kv_heads * hd), "wo": (c.n_heads * hd, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    return {"fc": (3 * d, d), "layer": layer, "norm": (d,), "lm_head": (d, config.draft_vocab)}


def init_params(config: EagleConfig, key: jax.Array, dtype=jnp.float32, scale: float = 1.0) -> dict:
    """Random head params: norms 1, matrices normal with std ``scale / sqrt(fan_in)``."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))

    def one(shape, k):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(k, shape) * scale / np.sqrt(shape[0])).astype(dtype)

    return jax.tree_util.tree_unflatten(treedef, [one(s, k) for s, k in zip(leaves, keys)])


def fuse(params: dict, captured: tuple) -> jax.Array:
    """The fused feature ``[..., D]``: ``concat(low, mid, high) @ fc`` of the three captured
    target layers (each ``[..., D]``)."""
    return linear(jnp.concatenate(captured, axis=-1), params["fc"])


def empty_cache(config: EagleConfig, batch: int, slots: int, dtype) -> KVCache:
    """The head's own KV cache: one layer, ``slots`` slots."""
    return KVCache.zeros(config.layer, batch, slots, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadOutput:
    """``logits`` float32 ``[B, T, Vd]`` over the draft vocabulary; ``hidden`` ``[B, T, D]``
    (the layer's output before the final norm: the next draft step's feature); ``cache``."""

    logits: jax.Array
    hidden: jax.Array
    cache: KVCache


def forward(params: dict, config: EagleConfig, embed_table: jax.Array, tokens: jax.Array, features: jax.Array,
            positions: jax.Array, cache: KVCache, *, write_at: jax.Array | None = None,
            mask: decoder.TreeMask | None = None) -> HeadOutput:
    """One head step over T entries: entry t pairs ``features[:, t]`` (a fused target feature,
    or the head's own previous hidden state) with ``tokens[:, t]``, the token that FOLLOWS the
    position the feature was computed at, and predicts the token after that.

    Args:
      params: the head (module docstring); embed_table: the target's ``[V, D]`` embedding.
      tokens: int32 ``[B, T]`` target ids; features: ``[B, T, D]``.
      positions: int32 ``[B, T]``: entry t sits at the position of its feature (RoPE).
      cache: the head's ``KVCache``; write_at, mask: as ``jaxspec.models.forward``'s.

    Returns:
      ``HeadOutput``.
    """
    c = config.layer
    layer = params["layer"]
    emb = decoder.embed({"embed": embed_table}, config.target, tokens).astype(features.dtype)
    write_at = positions[:, 0] if write_at is None else write_at
    visible = decoder.visibility(positions, cache.max_len, mask, c)
    y = jnp.concatenate([decoder.rms_norm(emb, layer["input_norm"], c.norm_eps),
                         decoder.rms_norm(features, layer["hidden_norm"], c.norm_eps)], axis=-1)
    a, k, v = decoder.self_attention(layer, 0, y, positions, write_at, cache.k[0], cache.v[0], c, visible)
    x = decoder.mlp_residual(layer, features + a, c)
    return HeadOutput(head_logits(params, config, x), x, KVCache(k=(k,), v=(v,)))


def head_logits(params: dict, config: EagleConfig, hidden: jax.Array) -> jax.Array:
    """The head's draft-vocabulary logits, float32 ``[..., Vd]``, of its hidden states
    ``[..., D]`` (``HeadOutput.hidden``): final norm, then its output head."""
    h = decoder.rms_norm(hidden, params["norm"], config.layer.norm_eps)
    return linear(h, params["lm_head"], out_dtype=jnp.float32)


def target_logits(logits: jax.Array, d2t: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocabulary logits ``[..., Vd]`` as target-vocabulary logits ``[..., V]``: -inf for
    every token outside the draft vocabulary (it is never drafted: q = 0 there)."""
    full = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    return full.at[..., d2t].set(logits)
