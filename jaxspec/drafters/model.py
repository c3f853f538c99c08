"""Drafting with a smaller model: a separate draft model, or the target's own first layers,
as a chain of sampled drafts or a top-k tree.

- ``ModelDrafter``: a separate draft model sharing the target's vocabulary (Leviathan et al.
  2023; Chen et al. 2023).
- ``EarlyExitDrafter``: self-speculation with the target's first ``n_layers`` blocks followed
  by its final norm and output head, no training needed (the "early-exit" drafting of
  Elhoushi et al. 2024, "LayerSkip", Sec. 4; Zhang et al. 2024, "Draft & Verify").

Chain mode (``tree_nodes=0``): ``gamma`` drafts drawn one after another from the drafter's
processed distribution q, which acceptance uses (lossless at any temperature).

Tree mode (``tree_nodes=N``): EAGLE-2's dynamic tree of depth ``gamma``
(``jaxspec.drafters.dynamic_tree``), ranked by the draft model's raw distribution; the
selection is deterministic, so acceptance treats nodes as one-hot proposals
(``jaxspec.acceptance``): lossless at any temperature.

The drafter keeps its own static KV cache. Every ``propose`` starts by reading the two newest
tokens (positions ``seq_len - 2`` and ``seq_len - 1``): the root and the deepest accepted
node, the only accepted node a proposal may not have fed to the drafter (a leaf). Nodes it
fed sit in scratch slots after the root (chain: node i at slot root + i + 1, i.e. in place);
``commit`` moves the accepted path's entries into contiguous slots with the same
``KVCache.keep_path`` the target's cache uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters import dynamic_tree
from jaxspec.drafters.dynamic_tree import check_tree
from jaxspec.drafters.base import Capabilities, check_gamma, check_int
from jaxspec.sampling import fold_rows, processed_probs, sample
from jaxspec.tree import Proposal


def draw_chain(step, carry: Any, logits: jax.Array, context, gamma: int) -> tuple[Any, Proposal]:
    """A chain of ``gamma`` drafts, each drawn from the drafter's processed distribution q
    (the target's processing: ``processed_probs`` with the history plus the drafts so far),
    which the proposal carries, so acceptance is lossless at any temperature.

    Args:
      step: ``step(carry, token [B], i) -> (carry, logits [B, V])``: feed draft ``i - 1``
        (``token``) and score draft ``i`` (i = 1 .. gamma - 1).
      carry: the drafter's state threaded through ``step`` (a ``lax.scan`` carry).
      logits: float32 ``[B, V]`` scoring draft 0; context: the ``Context``.

    Returns:
      ``(carry, Proposal.chain of [B, gamma] with q [B, gamma, V])``.
    """
    keys = context.keys

    def draft(logits, history, i):
        q = processed_probs(logits, context.sampling, history)
        d = sample(fold_rows(keys, i), q)
        return d, q, history.add(d[:, None], jnp.ones_like(d[:, None], bool))

    d0, q0, history = draft(logits, context.history, 0)

    def scan_step(scan_carry, i):
        carry, token, history = scan_carry
        carry, logits = step(carry, token, i)
        d, q, history = draft(logits, history, i)
        return (carry, d, history), (d, q)

    (carry, _, _), (ds, qs) = jax.lax.scan(scan_step, (carry, d0, history), jnp.arange(1, gamma, dtype=jnp.int32))
    drafts = jnp.concatenate([d0[:, None], ds.T], axis=1)
    q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    return carry, Proposal.chain(drafts, q=q)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """A model drafter's state.

    Attributes:
      cache: the draft model's ``KVCache`` (S + scratch slots).
      node_slots: int32 ``[B, N]``, slot of each node of the last proposal relative to its
        root (-1: not fed to the drafter).
    """

    cache: KVCache
    node_slots: jax.Array


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """Draft with a small Llama-family model: a chain of ``gamma`` sampled tokens, or a top-k
    tree of ``tree_nodes`` nodes and depth ``gamma``.

    Attributes:
      config: the draft model's ``ModelConfig``; ``vocab_size`` must equal the target's.
      gamma: chain length, or the tree's depth (>= 1).
      tree_nodes: 0 for a chain; else N, the tree's node budget, in
        ``[1, branching + (gamma - 1) * branching ** 2]`` (the candidates it grows).
      branching: children per expanded node and expanded nodes per depth (tree mode), >= 1.

    Raises:
      ValueError: ``gamma``, ``tree_nodes`` or ``branching`` out of range (at construction);
        vocabulary sizes, BOS or EOS ids differ, or no draft params (at ``validate``, before
        any compile). ``jaxspec.check_pair`` also compares the tokenizers' strings.
    """

    config: ModelConfig
    gamma: int = 4
    tree_nodes: int = 0
    branching: int = 4
    capabilities = Capabilities()

    def __post_init__(self):
        check_gamma(self.gamma)
        check_int("branching", self.branching, 1, self.config.vocab_size)
        check_tree(self.gamma, self.tree_nodes, self.branching)

    @property
    def n_nodes(self) -> int:
        """N: ``gamma`` for a chain, ``tree_nodes`` for a tree."""
        return self.tree_nodes or self.gamma

    @property
    def scratch(self) -> int:
        """Slots after the root a proposal writes into the drafter's cache."""
        return self.gamma if not self.tree_nodes else dynamic_tree.scratch_slots(self.gamma, self.branching)

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return drafter_params

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        from jaxspec.checkpoints.pairing import check_configs

        check_configs(target_config, self.config)  # vocabulary size, BOS, EOS
        if drafter_params is None:
            raise ValueError("ModelDrafter needs drafter_params (the draft model's weights)")

    def init(self, params, prefill, max_len):
        prompt = prefill.prompt
        cache = KVCache.zeros(self.config, prompt.shape[0], max_len + self.scratch, params["embed"].dtype)
        positions = jnp.broadcast_to(jnp.arange(prompt.shape[1], dtype=jnp.int32), prompt.shape)
        out = models.forward(params, self.config, prompt, positions, cache, head=False, visible_slots=prompt.shape[1])
        return DraftState(out.cache, jnp.zeros((prompt.shape[0], self.n_nodes), jnp.int32))

    def _read_newest(self, params, cache, context):
        positions = (context.seq_lens - 2)[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        out = models.forward(params, self.config, jnp.take_along_axis(context.tokens, positions, axis=1), positions,
                             cache)
        return out.logits[:, -1], out.cache

    def propose(self, params, state: DraftState, context):
        logits, cache = self._read_newest(params, state.cache, context)
        if self.tree_nodes:
            return self._tree(params, cache, logits, context)
        return self._chain(params, cache, logits, context)

    def _chain(self, params, cache, logits, context):
        cfg = self.config

        def step(cache, token, i):
            pos = (context.seq_lens - 1 + i)[:, None]
            out = models.forward(params, cfg, token[:, None], pos, cache)
            return out.cache, out.logits[:, 0]

        cache, proposal = draw_chain(step, cache, logits, context, self.gamma)
        b = proposal.tokens.shape[0]
        fed = jnp.where(jnp.arange(self.gamma) < self.gamma - 1, jnp.arange(1, self.gamma + 1), -1)
        return DraftState(cache, jnp.broadcast_to(fed, (b, self.gamma)).astype(jnp.int32)), proposal

    def _tree(self, params, cache, logits, context):
        cfg, k = self.config, self.branching

        def expand(cache, tokens, feats, positions, write_at, mask):
            out = models.forward(params, cfg, tokens, positions, cache, write_at=write_at, mask=mask)
            child_lp, child_tok = jax.lax.top_k(jax.nn.log_softmax(out.logits, axis=-1), k)
            return out.cache, child_lp, child_tok, None

        root_lp, root_tok = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
        cache, proposal, slots = dynamic_tree.grow(expand, cache, root_lp, root_tok, None, context.seq_lens - 1,
                                                   depth=self.gamma, branching=k, n_nodes=self.tree_nodes)
        return DraftState(cache, slots), proposal

    def commit(self, params, state: DraftState, committed):
        node = jnp.maximum(committed.path - 1, 0)
        slot = jnp.where(committed.path > 0, jnp.take_along_axis(state.node_slots, node, axis=1), 0)
        cache = state.cache.keep_path(committed.start, jnp.maximum(slot, 0), span=max(self.scratch, slot.shape[1]))
        return DraftState(cache, state.node_slots)


@dataclasses.dataclass(frozen=True, init=False)
class EarlyExitDrafter(ModelDrafter):
    """Self-speculation: the target's first ``n_layers`` blocks, final norm and head.

    Args:
      target_config: the target's ``ModelConfig``.
      n_layers: blocks to keep, ``1 <= n_layers < target_config.n_layers``.
      gamma, tree_nodes, branching: as ``ModelDrafter``'s (chain by default).

    The drafter's params are a view of the target's (no copy): ``select_params`` slices them.

    Raises:
      ValueError: ``n_layers``, ``gamma``, ``tree_nodes`` or ``branching`` out of range (at
        construction); a target whose config is not the one this drafter was built for (at
        ``validate``).
    """

    n_layers: int = 1
    # its params are the target's, so it runs on the target's shards under a mesh (``jaxspec.sharding``)
    capabilities = Capabilities(shares_target_weights=True)

    def __init__(self, target_config: ModelConfig, n_layers: int, gamma: int = 4, tree_nodes: int = 0,
                 branching: int = 4):
        if not isinstance(n_layers, int) or not 1 <= n_layers < target_config.n_layers:
            raise ValueError(
                f"n_layers for early exit must be in [1, {target_config.n_layers - 1}] "
                f"(the target has {target_config.n_layers} layers), got {n_layers}"
            )
        fields = dict(config=target_config.truncated(n_layers), gamma=gamma, tree_nodes=tree_nodes,
                      branching=branching, n_layers=n_layers)
        for name, value in fields.items():  # a frozen dataclass sets its fields in __init__ this way
            object.__setattr__(self, name, value)
        self.__post_init__()

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        return {**target_params, "layers": list(target_params["layers"][: self.n_layers])}

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        if target_config.truncated(self.n_layers) != self.config:
            raise ValueError(f"EarlyExitDrafter was built for {self.config.name}, not the target {target_config.name}")
