"""Draft trees: the typed proposal every drafter returns, and the topology the engine derives
from it to verify all nodes in one target forward.

A proposal is a tree of N candidate tokens hanging off the last committed token (the root).
Node ``i`` of row ``b`` holds ``tokens[b, i]``, continues node ``parents[b, i]`` (``-1``: the
root) and counts only where ``valid[b, i]``. Parents come before their children
(``parents[b, i] < i``), so one pass over the nodes in index order meets every parent first;
a chain of ``gamma`` drafts is ``parents = -1, 0, 1, ..., gamma - 2``. N is static; the
topology is data, so per-row and per-step trees (EAGLE-2's dynamic trees, Li et al. 2024)
never recompile.

The verify window is ``[root, node 0, ..., node N-1]`` (window index ``w = i + 1`` for node
``i``); ``Tree`` gives each window entry its depth (root 0), its parent's window index and its
ancestors (itself included), which are all the window entries its query may attend to
(SpecInfer's tree attention, Miao et al. 2024, Sec. 4.1).

Shape letters (the package's legend): B batch, N tree nodes, W = N + 1 window entries,
V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """What a drafter proposes for one step.

    Attributes:
      tokens: int32 ``[B, N]``, the candidate token of each node.
      parents: int32 ``[B, N]``, each node's parent node, ``-1`` for children of the root;
        ``parents[b, i] < i``.
      valid: bool ``[B, N]``, which nodes are candidates; a node under an invalid parent is
        treated as invalid too.
      q: float32 ``[B, N, V]``, the distribution each node's token was drawn from (given its
        parent), or None for deterministic drafters: acceptance then treats every node as a
        one-hot proposal (``jaxspec.acceptance``).
    """

    tokens: jax.Array
    parents: jax.Array
    valid: jax.Array
    q: jax.Array | None = None

    @property
    def n_nodes(self) -> int:
        """N, the static node budget."""
        return self.tokens.shape[1]

    @classmethod
    def chain(cls, tokens: jax.Array, valid: jax.Array | None = None, q: jax.Array | None = None) -> "Proposal":
        """A chain of drafts ``tokens`` int32 ``[B, gamma]``: node i continues node i - 1."""
        b, n = tokens.shape
        parents = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (b, n))
        valid = jnp.ones((b, n), bool) if valid is None else valid
        return cls(tokens.astype(jnp.int32), parents, valid, q)

    @classmethod
    def empty(cls, batch: int) -> "Proposal":
        """No nodes (plain decoding)."""
        z = jnp.zeros((batch, 0), jnp.int32)
        return cls(z, z, jnp.zeros((batch, 0), bool), None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """Topology of the verify window ``[root, nodes]`` (W = N + 1 entries).

    Attributes:
      tokens: int32 ``[B, W]``, root token then node tokens. Invalid nodes keep the
        proposal's token when it is a token id (>= 0), else hold the root's: they are computed
        by the verify forward (a lookahead branch's Jacobi guesses, ``Committed.argmax``) but
        never visible to a valid node nor accepted.
      parent: int32 ``[B, W]``, window index of each entry's parent (the root's is -1).
      valid: bool ``[B, W]``, the root is valid; a node is valid when it and all its
        ancestors were proposed as valid.
      depth: int32 ``[B, W]``, 0 for the root, parent's depth + 1 for nodes.
      ancestors: bool ``[B, W, W]``, ``ancestors[b, w, u]``: entry u is w or an ancestor of w.
    """

    tokens: jax.Array
    parent: jax.Array
    valid: jax.Array
    depth: jax.Array
    ancestors: jax.Array

    @classmethod
    def of(cls, root: jax.Array, proposal: Proposal) -> "Tree":
        """The window of ``root`` int32 ``[B]`` (the last committed token) and ``proposal``."""
        b, n = proposal.tokens.shape
        w = n + 1
        parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), proposal.parents.astype(jnp.int32) + 1], axis=1)
        valid = jnp.concatenate([jnp.ones((b, 1), bool), proposal.valid], axis=1)
        depth = jnp.zeros((b, w), jnp.int32)
        ancestors = jnp.zeros((b, w, w), bool).at[:, 0, 0].set(True)
        rows = jnp.arange(b)
        for i in range(1, w):  # parents come first: one pass fills every entry
            par = jnp.clip(parent[:, i], 0, i - 1)
            valid = valid.at[:, i].set(valid[:, i] & valid[rows, par])
            depth = depth.at[:, i].set(depth[rows, par] + 1)
            ancestors = ancestors.at[:, i].set(ancestors[rows, par].at[:, i].set(True))
        kept = valid[:, 1:] | (proposal.tokens >= 0)
        tokens = jnp.concatenate([root[:, None], jnp.where(kept, proposal.tokens, root[:, None])], axis=1)
        return cls(tokens.astype(jnp.int32), parent, valid, depth, ancestors)

    @property
    def width(self) -> int:
        """W = N + 1."""
        return self.tokens.shape[1]

    def path_counts(self, vocab_size: int) -> jax.Array:
        """int32 ``[B, W, V]``: how often each token occurs on the path from the root (excluded:
        it is already in the history) to entry w, entry w included. Window entry w's next token
        is scored with the history's counts plus these (penalties along a node's own
        ancestors, not the whole window)."""
        on_path = (self.ancestors & self.valid[:, None, :]).at[:, :, 0].set(False).astype(jnp.int32)
        return jnp.einsum("bwu,buv->bwv", on_path, jax.nn.one_hot(self.tokens, vocab_size, dtype=jnp.int32))
