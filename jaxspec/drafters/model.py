"""Drafting with a smaller model: a separate draft model, or the target's own first layers,
as a chain of sampled drafts or a top-k tree.

- ``ModelDrafter``: a separate draft model sharing the target's vocabulary (Leviathan et al.
  2023; Chen et al. 2023).
- ``EarlyExitDrafter``: self-speculation with the target's first ``n_layers`` blocks followed
  by its final norm and output head, no training needed (the "early-exit" drafting of
  Elhoushi et al. 2024, "LayerSkip", Sec. 4; Zhang et al. 2024, "Draft & Verify").

Chain mode (``tree_nodes=0``): ``gamma`` drafts drawn one after another from the drafter's
processed distribution q, which acceptance uses (lossless at any temperature).

Tree mode (``tree_nodes=N``): EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", Sec. 4): expand the root into its
``branching`` most probable tokens; at each further depth expand the ``branching`` frontier
nodes of highest cumulative draft log-probability (one drafter forward over them, with a tree
mask), each into its ``branching`` most probable children; after ``gamma`` depths keep the N
candidates of highest cumulative log-probability (a child scores below its parent, so the
kept set is a tree). Ranking uses the draft model's raw distribution; the selection is
deterministic, so acceptance treats nodes as one-hot proposals (``jaxspec.acceptance``):
lossless at any temperature.

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
from jaxspec.drafters.base import Capabilities, check_gamma, check_int
from jaxspec.sampling import fold_rows, processed_probs, sample
from jaxspec.tree import Proposal


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
        if self.tree_nodes:
            grown = self.branching + (self.gamma - 1) * self.branching**2
            check_int("tree_nodes", self.tree_nodes, 1, grown,
                      f" (0 = chain; a tree of depth gamma={self.gamma} with branching={self.branching} grows "
                      f"{grown} candidates)")

    @property
    def n_nodes(self) -> int:
        """N: ``gamma`` for a chain, ``tree_nodes`` for a tree."""
        return self.tree_nodes or self.gamma

    @property
    def scratch(self) -> int:
        """Slots after the root a proposal writes into the drafter's cache."""
        return self.gamma if not self.tree_nodes else 1 + (self.gamma - 1) * self.branching

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
        cfg, keys = self.config, context.keys

        def draft(logits, history, i):
            # q: the drafter's distribution after the same processing as the target's p.
            q = processed_probs(logits, context.sampling, history)
            d = sample(fold_rows(keys, i), q)
            return d, q, history.add(d[:, None], jnp.ones_like(d[:, None], bool))

        d0, q0, history = draft(logits, context.history, 0)

        def step(carry, i):
            cache, token, history = carry
            pos = (context.seq_lens - 1 + i)[:, None]
            out = models.forward(params, cfg, token[:, None], pos, cache)
            d, q, history = draft(out.logits[:, 0], history, i)
            return (out.cache, d, history), (d, q)

        (cache, _, _), (ds, qs) = jax.lax.scan(step, (cache, d0, history), jnp.arange(1, self.gamma, dtype=jnp.int32))
        drafts = jnp.concatenate([d0[:, None], ds.T], axis=1)
        q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        b = drafts.shape[0]
        fed = jnp.where(jnp.arange(self.gamma) < self.gamma - 1, jnp.arange(1, self.gamma + 1), -1)
        return DraftState(cache, jnp.broadcast_to(fed, (b, self.gamma)).astype(jnp.int32)), Proposal.chain(drafts, q=q)

    def _tree(self, params, cache, logits, context):
        cfg, k, depth = self.config, self.branching, self.gamma
        b = logits.shape[0]
        rows = jnp.arange(b)[:, None]
        start = context.seq_lens - 1
        span = self.scratch
        # window positions of the scratch slots: root, then `k` slots per fed depth
        slot_depth = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.repeat(jnp.arange(1, depth), k)])
        win_positions = start[:, None] + slot_depth[None]
        # Candidates, level by level: token, cumulative log-probability, parent candidate id (-1 root),
        # scratch slot (-1 unfed).
        lp, tok = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
        cand_tok, cand_score, cand_parent = [tok], [lp], [jnp.full((b, k), -1, jnp.int32)]
        cand_slot = [jnp.full((b, k), -1, jnp.int32)]
        front_ids, front_tok, front_score = jnp.broadcast_to(jnp.arange(k), (b, k)), tok, lp
        front_seen = jnp.zeros((b, k, span), bool).at[:, :, 0].set(True)  # slots each frontier node attends to
        n_cands = k
        for level in range(1, depth):
            first_slot = 1 + (level - 1) * k
            slots = first_slot + jnp.arange(k)
            front_seen = front_seen.at[:, jnp.arange(k), slots].set(True)
            cand_slot[-1] = cand_slot[-1].at[rows, front_ids - (n_cands - cand_tok[-1].shape[1])].set(slots[None])
            mask = models.TreeMask(start, front_seen, win_positions)
            positions = jnp.broadcast_to((start + level)[:, None], (b, k))
            out = models.forward(params, cfg, front_tok, positions, cache, write_at=start + first_slot, mask=mask)
            cache = out.cache
            child_lp, child_tok = jax.lax.top_k(jax.nn.log_softmax(out.logits, axis=-1), k)  # [B, k, k]
            score = (front_score[:, :, None] + child_lp).reshape(b, k * k)
            ids = n_cands + jnp.arange(k * k)
            cand_tok.append(child_tok.reshape(b, k * k))
            cand_score.append(score)
            cand_parent.append(jnp.broadcast_to(jnp.repeat(front_ids, k, axis=1), (b, k * k)))
            cand_slot.append(jnp.full((b, k * k), -1, jnp.int32))
            if level < depth - 1:
                front_score, pick = jax.lax.top_k(score, k)
                front_ids = ids[pick]
                front_tok = jnp.take_along_axis(cand_tok[-1], pick, axis=1)
                front_seen = jnp.take_along_axis(front_seen, (pick // k)[:, :, None], axis=1)
            n_cands += k * k
        cand_tok, cand_parent, cand_slot = (jnp.concatenate(x, axis=1) for x in (cand_tok, cand_parent, cand_slot))
        cand_depth = jnp.concatenate([jnp.full((k,), 1)] + [jnp.full((k * k,), d) for d in range(2, depth + 1)])
        # A child never ties its parent: subtract a hair per depth so the kept set is ancestor-closed.
        score = jnp.concatenate(cand_score, axis=1) - 1e-6 * cand_depth[None]
        _, keep = jax.lax.top_k(score, self.tree_nodes)
        keep = jnp.sort(keep, axis=1)  # candidate ids are ordered by depth: parents first
        node_of = jnp.full((b, n_cands), -1, jnp.int32).at[rows, keep].set(jnp.arange(self.tree_nodes))
        par = jnp.take_along_axis(cand_parent, keep, axis=1)
        parents = jnp.where(par >= 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1), -1)
        valid = jnp.isfinite(jnp.take_along_axis(score, keep, axis=1))
        proposal = Proposal(jnp.take_along_axis(cand_tok, keep, axis=1), parents, valid, None)
        return DraftState(cache, jnp.take_along_axis(cand_slot, keep, axis=1)), proposal

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
