"""EAGLE-2's dynamic draft tree, grown by draft confidence (Li et al. 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", Sec. 4), for every drafter that can
score a frontier of nodes in one forward: a draft model, early exit, an EAGLE-3 head.

Expand the root into its ``branching`` most probable tokens; at each further depth expand
the ``branching`` frontier nodes of highest cumulative draft log-probability (one drafter
forward over them, with a tree mask), each into its ``branching`` most probable children;
after ``depth`` levels keep the N candidates of highest cumulative log-probability (a child
scores below its parent, so the kept set is a tree). The selection is deterministic, so
acceptance treats nodes as one-hot proposals (``jaxspec.acceptance``): lossless at any
temperature.

Scratch layout in the drafter's cache: the entry that scored the root's children sits at
slot (and position) ``start``; frontier level L (1 .. depth - 1) is written at slots
``start + 1 + (L - 1) * branching ..`` with position ``start + L``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxspec import grammar as grammar_lib, models
from jaxspec.drafters.base import check_int
from jaxspec.tree import Proposal


def scratch_slots(depth: int, branching: int) -> int:
    """Slots from ``start`` on that a tree of ``depth`` levels writes: the root entry, then
    ``branching`` per fed level."""
    return 1 + (depth - 1) * branching


def max_nodes(depth: int, branching: int) -> int:
    """Candidates a tree grows (the largest useful node budget)."""
    return branching + (depth - 1) * branching**2


def check_tree(depth: int, n_nodes: int, branching: int) -> None:
    """Raise ``ValueError`` unless ``n_nodes`` is 0 (a chain) or in ``[1, max_nodes]``."""
    if n_nodes:
        grown = max_nodes(depth, branching)
        check_int("tree_nodes", n_nodes, 1, grown,
                  f" (0 = chain; a tree of depth gamma={depth} with branching={branching} grows {grown} candidates)")


def best_children(logits: jax.Array, k: int, allowed: jax.Array | None = None, d2t: jax.Array | None = None):
    """``(log-probabilities, target token ids)`` ``[..., k]`` of the ``k`` most probable
    children under ``logits [..., V']`` (a draft vocabulary mapped to target ids by ``d2t``
    ``[V']``, or the target's), renormalised over the tokens a grammar ``allowed`` (bool
    ``[..., V]`` in target ids, or None: all) so the tree spends no node on a token the
    target may not take; where fewer than ``k`` are allowed the rest score -inf (invalid
    nodes). A position that allows nothing is left unmasked (the engine emits nothing from
    one)."""
    if allowed is not None:
        ok = allowed if d2t is None else allowed[..., d2t]
        ok = ok | ~jnp.any(ok, axis=-1, keepdims=True)
        logits = jnp.where(ok, logits, -jnp.inf)
    lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
    return lp, ids if d2t is None else d2t[ids]


def grow(expand: Callable, cache: Any, root_lp: jax.Array, root_tok: jax.Array, root_feat: Any, start: jax.Array, *,
         depth: int, branching: int, n_nodes: int, grammar=None, state: jax.Array | None = None
         ) -> tuple[Any, Proposal, jax.Array]:
    """Grow one dynamic tree per row.

    Args:
      expand: ``expand(cache, tokens [B, k], feats, positions [B, k], write_at [B], mask,
        allowed) -> (cache, child_lp [B, k, k], child_tok [B, k, k], child_feat)``: feed the
        frontier (each node with its feature pytree ``feats`` ``[B, k, ...]``, or None) at
        ``positions`` into slots ``write_at ..`` under the ``models.TreeMask`` ``mask``, and
        return each node's ``k`` best children (log-probabilities, target token ids:
        ``best_children`` under ``allowed``, bool ``[B, k, V]`` or None) and the feature its
        children are fed with (``[B, k, ...]``, or None).
      cache: the drafter's cache, already holding the root entry at slot ``start``.
      root_lp, root_tok: ``[B, k]``: the root's ``k`` best children; root_feat: their
        feature pytree ``[B, k, ...]`` (or None).
      start: int32 ``[B]``.
      depth, branching (k), n_nodes (N): static; ``N <= max_nodes(depth, k)``.
      grammar, state: the call's ``jaxspec.grammar.GrammarTables`` and each row's state after
        its text (int32 ``[B]``), or None: each frontier node's children are ranked among the
        tokens the state after its path allows (the root's children the caller ranks so).

    Returns:
      ``(cache, Proposal of N nodes with q None, node_slots int32 [B, N])``: each kept node's
      scratch slot relative to ``start`` (-1: a leaf, never fed).
    """
    k = branching
    b = root_lp.shape[0]
    rows = jnp.arange(b)[:, None]
    span = scratch_slots(depth, k)
    # window positions of the scratch slots: the root entry, then `k` slots per fed depth
    slot_depth = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.repeat(jnp.arange(1, depth), k)])
    win_positions = start[:, None] + slot_depth[None]
    # Candidates, level by level: token, cumulative log-probability, parent candidate id (-1 root),
    # scratch slot (-1 unfed).
    cand_tok, cand_score, cand_parent = [root_tok], [root_lp], [jnp.full((b, k), -1, jnp.int32)]
    cand_slot = [jnp.full((b, k), -1, jnp.int32)]
    front_ids = jnp.broadcast_to(jnp.arange(k), (b, k))
    front_tok, front_score, front_feat = root_tok, root_lp, root_feat
    front_state = None if grammar is None else grammar_lib.advance(grammar, state[:, None], root_tok)
    front_seen = jnp.zeros((b, k, span), bool).at[:, :, 0].set(True)  # slots each frontier node attends to
    n_cands = k
    for level in range(1, depth):
        first_slot = 1 + (level - 1) * k
        slots = first_slot + jnp.arange(k)
        front_seen = front_seen.at[:, jnp.arange(k), slots].set(True)
        cand_slot[-1] = cand_slot[-1].at[rows, front_ids - (n_cands - cand_tok[-1].shape[1])].set(slots[None])
        mask = models.TreeMask(start, front_seen, win_positions)
        positions = jnp.broadcast_to((start + level)[:, None], (b, k))
        allowed = None if grammar is None else grammar_lib.allowed(grammar, front_state)
        cache, child_lp, child_tok, child_feat = expand(cache, front_tok, front_feat, positions, start + first_slot,
                                                        mask, allowed)
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
            if grammar is not None:
                child_state = grammar_lib.advance(grammar, front_state[:, :, None], child_tok).reshape(b, k * k)
                front_state = jnp.take_along_axis(child_state, pick, axis=1)
            parent = pick // k  # the frontier node each new frontier node hangs from
            front_seen = jnp.take_along_axis(front_seen, parent[:, :, None], axis=1)
            front_feat = jax.tree_util.tree_map(
                lambda f: jnp.take_along_axis(f, parent.reshape(parent.shape + (1,) * (f.ndim - 2)), axis=1),
                child_feat)
        n_cands += k * k
    cand_tok, cand_parent, cand_slot = (jnp.concatenate(x, axis=1) for x in (cand_tok, cand_parent, cand_slot))
    cand_depth = jnp.concatenate([jnp.full((k,), 1)] + [jnp.full((k * k,), d) for d in range(2, depth + 1)])
    # A child never ties its parent: subtract a hair per depth so the kept set is ancestor-closed.
    score = jnp.concatenate(cand_score, axis=1) - 1e-6 * cand_depth[None]
    _, keep = jax.lax.top_k(score, n_nodes)
    keep = jnp.sort(keep, axis=1)  # candidate ids are ordered by depth: parents first
    node_of = jnp.full((b, n_cands), -1, jnp.int32).at[rows, keep].set(jnp.arange(n_nodes))
    par = jnp.take_along_axis(cand_parent, keep, axis=1)
    parents = jnp.where(par >= 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1), -1)
    valid = jnp.isfinite(jnp.take_along_axis(score, keep, axis=1))
    proposal = Proposal(jnp.take_along_axis(cand_tok, keep, axis=1), parents, valid, None)
    return cache, proposal, jnp.take_along_axis(cand_slot, keep, axis=1)
