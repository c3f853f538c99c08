"""The target-model protocol: what the engine asks of the model it verifies drafts with.

The engine (``jaxspec.engine``) never calls a decoder directly: it reads a ``TargetModel``,
an object with a few facts (vocabulary, context, special ids, layers it can report) and three
functions over a params pytree:

* ``init_cache(params, batch, max_len)``: the empty static-shape KV cache, a pytree whose
  every leaf is ``[B, S, ...]`` (slot axis 1);
* ``forward(params, tokens, positions, cache, *, write_at, mask, capture, head,
  visible_slots, write)``: T new tokens at any positions, with a causal or tree visibility
  (``TreeMask``), returning a ``ForwardOutput`` (logits, final hidden states, requested
  layer outputs, and the cache with the tokens written, or with ``write=False`` their own
  keys and values: the cache's pytree with ``[B, T, ...]`` leaves, which the engine writes
  along the accepted path only);
* ``logits(params, hidden)``: the output head, float32 ``[..., V]``.

Implementations:

* ``Decoder``: jaxspec's own decoder (``jaxspec.models.decoder``) for a ``ModelConfig``.
  Passing a ``ModelConfig`` anywhere a target is expected means ``Decoder(config)``
  (``as_target``); the compiled program is the one the engine built before the protocol
  existed (same StableHLO).
* ``MaskedTarget``: a model of your own written as one function that writes the new tokens'
  keys and values at given slots and attends where a dense ``[B, T, S]`` mask says, plus its
  output head and cache initializer. The adapter derives everything else (the kept-apart
  window of a tree verify is written into slots past the committed text, then read back
  from them). ``jaxspec.models.nnx.NnxTarget`` wraps a flax.nnx module the same way.

Drafters that reuse the target's internals need more than the protocol: an EAGLE-3 head reads
chosen layers' outputs (``n_layers`` > 0 and ``capture``), early exit and Medusa read
jaxspec's decoder layout (a ``ModelConfig`` target). ``generate`` refuses the other cases
before compiling, naming what is missing (``check_drafter``).

The protocol follows the shape of Hugging Face's ``forward(input_ids, position_ids,
past_key_values, attention_mask)`` with a static cache (transformers ``StaticCache``) and of
the gemma library's ``Transformer.__call__(tokens, positions=, cache=, attention_mask=)``;
tree verification needs only the explicit mask (SpecInfer, Miao et al. 2024, Sec. 4.2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache, read
from jaxspec.config import ModelConfig
from jaxspec.models import decoder
from jaxspec.models.decoder import ForwardOutput, TreeMask


@runtime_checkable
class TargetModel(Protocol):
    """What the engine reads of a target model (module docstring). Implementations must be
    hashable (a frozen dataclass): the target is part of the compiled program's key.

    Attributes:
      name: used in messages. vocab_size: V. max_position: the longest context, in tokens.
      bos_id: beginning-of-sequence id, or -1. eos_ids: ids that end generation.
      n_layers: layers whose outputs ``forward(capture=...)`` can return (0: none).
    """

    name: str
    vocab_size: int
    max_position: int
    bos_id: int
    eos_ids: tuple[int, ...]
    n_layers: int

    def init_cache(self, params: Any, batch: int, max_len: int) -> Any:
        """The empty cache for ``batch`` rows of ``max_len`` slots: a pytree of ``[B, S, ...]``."""

    def forward(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Any, *,
                write_at: jax.Array | None = None, mask: TreeMask | None = None, capture: tuple[int, ...] = (),
                head: bool = True, visible_slots: int | None = None, write: bool = True) -> ForwardOutput:
        """``jaxspec.models.forward``'s contract (its docstring), for this model."""

    def logits(self, params: Any, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[..., V]`` of final hidden states ``[..., D]``."""


MEMBERS = ("name", "vocab_size", "max_position", "bos_id", "eos_ids", "n_layers", "init_cache", "forward", "logits")


@dataclasses.dataclass(frozen=True)
class Decoder:
    """jaxspec's own decoder (``jaxspec.models.decoder``) as a ``TargetModel``: params in its
    layout for ``config``, the cache a ``KVCache`` in the dtype of the embedding table."""

    config: ModelConfig

    name = property(lambda self: self.config.name)
    vocab_size = property(lambda self: self.config.vocab_size)
    max_position = property(lambda self: self.config.max_position)
    bos_id = property(lambda self: self.config.bos_id)
    eos_ids = property(lambda self: self.config.eos_ids)
    n_layers = property(lambda self: self.config.n_layers)

    def init_cache(self, params: dict, batch: int, max_len: int) -> KVCache:
        return KVCache.zeros(self.config, batch, max_len, params["embed"].dtype)

    def forward(self, params: dict, tokens, positions, cache, **options) -> ForwardOutput:
        return decoder.forward(params, self.config, tokens, positions, cache, **options)

    def logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        return decoder.logits_from_hidden(params, self.config, hidden)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MaskedForward:
    """``TargetModel.forward`` and friends from ``apply``/``head``/``make_cache`` (``MaskedTarget``),
    and the facts every such target declares (keywords: the subclasses' own fields come first)."""

    name: str
    vocab_size: int
    max_position: int
    bos_id: int = -1
    eos_ids: tuple[int, ...] = ()
    row_offsets: bool = True
    n_layers = 0  # (not a field) apply returns no layer outputs

    def init_cache(self, params, batch: int, max_len: int):
        cache = self.make_cache(params, batch, max_len)
        bad = [x.shape for x in jax.tree.leaves(cache) if x.ndim < 2 or x.shape[:2] != (batch, max_len)]
        if bad:
            raise ValueError(f"{self.name}: every cache leaf must be [batch, max_len, ...] = [{batch}, {max_len}, ...] "
                             f"(the engine writes and reads slots along axis 1), got shapes {bad[:3]}")
        return cache

    def forward(self, params, tokens, positions, cache, *, write_at=None, mask=None, capture=(), head=True,
                visible_slots=None, write=True) -> ForwardOutput:
        if capture:
            raise ValueError(f"{self.name} returns no layer outputs (capture={tuple(capture)}): a drafter that reads "
                             "them (EAGLE-3) needs jaxspec's decoder as the target")
        t = tokens.shape[1]
        n_slots = jax.tree.leaves(cache)[0].shape[1]
        if write:
            start = positions[:, 0] if write_at is None else write_at
        elif mask is None or mask.visible.shape[-1] != t:
            raise ValueError("forward(write=False) needs a TreeMask over the new tokens (visible [B, T, T])")
        else:
            start = mask.start  # the window goes to the slots after the committed text, then is read back
        # visible_slots only bounds what a query sees (an optimization): the full mask is the same
        seen = decoder.slots_visible(positions, n_slots, mask, 0)
        apply = self.apply if self.row_offsets else self._row_by_row
        hidden, new_cache = apply(params, tokens, positions, cache, start, seen)
        logits = self.logits(params, hidden) if head else None
        if not write:
            new_cache = jax.tree.map(lambda x: read(x, start, t), new_cache)
        return ForwardOutput(logits, hidden, (), new_cache)

    def logits(self, params, hidden):
        return self.head(params, hidden).astype(jnp.float32)

    def _row_by_row(self, params, tokens, positions, cache, write_at, mask):
        """``apply`` over each row as a batch of one (``jax.vmap``), for a model that writes
        every row of a batch at one offset (``row_offsets=False``)."""
        def one(*row):
            out = self.apply(params, *jax.tree.map(lambda x: x[None], row))
            return jax.tree.map(lambda x: x[0], out)

        return jax.vmap(one)(tokens, positions, cache, write_at, mask)


@dataclasses.dataclass(frozen=True)
class MaskedTarget(_MaskedForward):
    """A ``TargetModel`` from three functions of your own model.

    Attributes:
      apply: ``(params, tokens, positions, cache, write_at, mask) -> (hidden, cache)``:
        tokens and positions int32 ``[B, T]``; ``write_at`` int32 ``[B]``: write the T tokens'
        keys and values at cache slots ``write_at[b] ..`` (each row its own offset); ``mask``
        bool ``[B, T, S]``: query t attends to slot s where ``mask[b, t, s]`` (the new tokens'
        own slots included: causal, or a draft tree's ancestors). Slot s of the committed text
        holds position s; a tree's nodes sit in slots after it at positions ``committed length
        + depth``, so a model that masks by position (sliding windows) must take key positions
        from the slots it wrote. Returns the final hidden states ``[B, T, D]`` (after the final
        norm) and the updated cache.
      head: ``(params, hidden [..., D]) -> logits [..., V]``.
      make_cache: ``(params, batch, max_len) -> cache``, a pytree whose leaves are all
        ``[batch, max_len, ...]``.
      name, vocab_size, max_position, bos_id, eos_ids (keywords): as in ``TargetModel``.
      row_offsets (keyword): True (default) when ``apply`` writes each row at its own ``write_at[b]``;
        False for a model whose cache has one write index for the whole batch (the gemma
        library's ``end_index``, a Hugging Face ``cache_position``): the adapter then runs
        each row as a batch of one under ``jax.vmap`` (rows of a batch advance by different
        numbers of accepted tokens, so their offsets differ).

    To keep greedy speculation bitwise equal to plain decoding on CPU, build the model's
    products and attention from ``jaxspec.models.linear.linear`` and
    ``jaxspec.models.attention.attention`` (row-invariant: docs/cpu_kernel.md); other ops
    keep it exact in distribution, and token for token except where rounding breaks a near-tie.
    """

    apply: Callable
    head: Callable
    make_cache: Callable


def as_target(config) -> TargetModel:
    """The ``TargetModel`` of ``config``: ``Decoder(config)`` for a ``ModelConfig``, the object
    itself when it has the protocol's members.

    Raises:
      ValueError: neither, naming the missing members.
    """
    if isinstance(config, ModelConfig):
        return Decoder(config)
    missing = [m for m in MEMBERS if not hasattr(config, m)]
    if missing:
        raise ValueError(f"config must be a jaxspec.ModelConfig or a target model (jaxspec.models.TargetModel: "
                         f"e.g. jaxspec.models.MaskedTarget), got a {type(config).__name__}: {config!r:.80} "
                         f"(it lacks {', '.join(missing)})")
    return config


def check_drafter(target: TargetModel, drafter) -> None:
    """Raise ``ValueError`` if ``drafter`` reads layer outputs ``target`` cannot return."""
    capture = drafter.capabilities.capture
    bad = [i for i in capture if not 0 <= i < target.n_layers]
    if bad:
        raise ValueError(f"{type(drafter).__name__} reads the outputs of layers {tuple(capture)}, which the target "
                         f"{target.name} does not return (it reports {target.n_layers} layers); use a drafter that "
                         "needs only tokens: NGramDrafter, LookaheadDrafter or ModelDrafter")


_MASK_CHECKED: set = set()  # targets whose probe passed (``check_mask``)


def check_mask(target: TargetModel, params) -> None:
    """Raise ``ValueError`` if ``target`` lets a token see what its mask hides: a probe
    forward of two sibling tokens at position 0 of an empty 4-slot cache, each seeing only
    itself (a draft tree's mask), run twice with a different first token; the second token's
    logits must not change. Once per target (jaxspec's ``Decoder`` is not probed).

    The bound: logits that differ by more than 1e-4 (relative to their largest magnitude, at
    least 1). A correct model computes the second token's logits from the same inputs in
    both runs; a model that ignores the mask mixes in the other token, which moves them by
    far more than float32 rounding on a random model (~0.1 on the tests' tiny nnx model).
    """
    if isinstance(target, Decoder) or target in _MASK_CHECKED:
        return
    tokens = [jnp.asarray([[a, 1]], jnp.int32) for a in (0, min(2, target.vocab_size - 1))]
    positions = jnp.zeros((1, 2), jnp.int32)
    mask = TreeMask(jnp.zeros((1,), jnp.int32), jnp.eye(2, dtype=bool)[None], positions)
    cache = target.init_cache(params, 1, 4)
    second = [target.forward(params, t, positions, cache, mask=mask, write=False).logits[0, 1] for t in tokens]
    diff = float(jnp.max(jnp.abs(second[0] - second[1])))
    if diff > 1e-4 * max(1.0, float(jnp.max(jnp.abs(second[0])))):
        raise ValueError(f"{target.name} ignores the attention mask: a token's logits changed by {diff:.3g} when a "
                         "token it must not see changed (apply must attend only where mask[b, t, s] is True)")
    _MASK_CHECKED.add(target)


def require_decoder(target_config, drafter: str, reads: str) -> None:
    """Raise ``ValueError`` unless ``target_config`` is a ``ModelConfig`` (jaxspec's decoder):
    for drafters that read ``reads`` of the target's layout."""
    if not isinstance(target_config, ModelConfig):
        raise ValueError(f"{drafter} reads {reads} in jaxspec's decoder layout; the target "
                         f"{getattr(target_config, 'name', target_config)!r} is a model of its own "
                         "(jaxspec.models.TargetModel): use NGramDrafter, LookaheadDrafter or ModelDrafter")
