"""Speculative acceptance over a draft tree: which path to keep and which token to add.

The rule is multi-candidate speculative sampling (SpecInfer, Miao et al. 2024, "SpecInfer:
Accelerating Generative LLM Serving with Tree-based Speculative Inference and
Verification", Sec. 4.2, Alg. 2), which is speculative sampling (Leviathan et al. 2023,
Alg. 1; Chen et al. 2023, Alg. 2) tried sibling after sibling. Walking down from the root,
at the current node with target distribution p:

- the residual starts as r = p; each child c (in node order) is accepted with probability
  ``min(1, r(c) / q_c(c))``; on acceptance the walk moves to c (r = the target's p after c);
- on rejection the residual becomes ``r = norm(max(0, r - q_c))`` and the next sibling is
  tried;
- when no child is accepted, the emitted token is drawn from r: the replacement, or the
  bonus token when the walk ended at a leaf.

``q_c`` is the distribution the drafter drew c from. Deterministic drafters (n-gram lookup,
top-k trees) give none: ``q_c`` is then the one-hot of c, so c is accepted with probability
``r(c)`` and a rejection removes c from r and renormalises, the rule EAGLE-2 uses for
distinct top-k siblings (Li et al. 2024, Sec. 4). Either way the emitted tokens follow p
exactly. One rule covers every case:

- a chain is the tree whose nodes each have one child: exactly speculative sampling;
- greedy (temperature 0): p is one-hot on the argmax (``jaxspec.sampling``), so the walk
  follows the longest path whose every token is the target's argmax after its parent, and
  the token added is the target's argmax after it;
- plain decoding is the empty tree: the "bonus" token is a sample from p.

Since a node's children come after it, one pass over the nodes in index order is the whole
walk (a node is a candidate when its parent is the current node): N steps of O(V) work.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.sampling import fold_rows, sample
from jaxspec.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Accepted:
    """Result of verifying one tree per row (W = N + 1 window entries).

    Attributes:
      n_accepted: int32 ``[B]`` in ``[0, N]``, drafts accepted (the accepted path's depth).
      path: int32 ``[B, W]``, window indices of the emitted tokens' positions: ``path[:, 0]``
        is the root (0), ``path[:, k]`` for ``k <= n_accepted`` the k-th accepted node; the
        emitted token k is scored by the target at window entry ``path[:, k]``. Entries past
        ``n_accepted`` repeat the last accepted entry.
      tokens: int32 ``[B, W]``, the emitted tokens: the accepted drafts, then the replacement
        or bonus token; entries past ``n_accepted`` are unspecified.
    """

    n_accepted: jax.Array
    path: jax.Array
    tokens: jax.Array


def accept(keys: jax.Array, p: jax.Array, q: jax.Array | None, tree: Tree) -> Accepted:
    """Verify a draft tree against the target.

    Args:
      keys: ``[B]`` PRNG key array, one per row (a row's result depends only on its own key).
      p: float32 ``[B, W, V]``, the target's processed distribution of the token after each
        window entry (root, then the nodes).
      q: float32 ``[B, N, V]``, the distribution each node was drawn from, or None for
        deterministic drafters (one-hot on each node's token).
      tree: the window's ``Tree`` (``Tree.of(root, proposal)``); invalid nodes are never
        candidates, which is what q = 0 at a rejected position gives.

    Returns:
      ``Accepted``.
    """
    b, w, v = p.shape
    n = w - 1
    key_u, key_r = fold_rows(keys, 0), fold_rows(keys, 1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(key_u)  # one uniform per node
    rows = jnp.arange(b)

    def visit(i, carry):
        current, depth, residual, path, emitted = carry
        node = i + 1
        token = tree.tokens[:, node]
        candidate = tree.valid[:, node] & (tree.parent[:, node] == current)
        q_i = jax.nn.one_hot(token, v, dtype=p.dtype) if q is None else q[:, i]
        r_c = residual[rows, token]
        accepted = candidate & (u[:, i] * q_i[rows, token] < r_c)  # u < min(1, r/q) without dividing
        rejected = candidate & ~accepted
        left = jnp.maximum(residual - q_i, 0.0)
        mass = jnp.sum(left, axis=-1, keepdims=True)
        # mass == 0 only when r == q on a rejected candidate, which has probability 0: keep r.
        left = jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), residual)
        residual = jnp.where(accepted[:, None], p[:, node], jnp.where(rejected[:, None], left, residual))
        depth = depth + accepted
        path = jnp.where(accepted[:, None] & (jnp.arange(w)[None] >= depth[:, None]), node, path)
        emitted = emitted.at[rows, jnp.where(accepted, depth - 1, w)].set(token, mode="drop")
        current = jnp.where(accepted, node, current)
        return current, depth, residual, path, emitted

    zeros = jnp.zeros((b,), jnp.int32)
    init = (zeros, zeros, p[:, 0], jnp.zeros((b, w), jnp.int32), jnp.zeros((b, w), jnp.int32))
    _, n_accepted, residual, path, emitted = jax.lax.fori_loop(0, n, visit, init) if n else init
    last = sample(key_r, residual)
    emitted = emitted.at[rows, n_accepted].set(last)
    return Accepted(n_accepted=n_accepted, path=path, tokens=emitted)


@dataclasses.dataclass(frozen=True)
class Exact:
    """The exact acceptance rule (``accept``), lossless: a static argument of the compiled
    program (``engine.run_program``'s ``rule``). Its benchmark-only counterpart, with the same
    members, is ``jaxspec.synthetic.Synthetic``."""

    narrows = True  # an abstaining drafter's window may be verified at the width its valid nodes need

    def fill(self, proposal, root):
        """The ``Proposal`` to verify: the drafter's, as it is."""
        return proposal

    def accept(self, keys, p, proposal, tree: Tree, inputs) -> Accepted:
        """The accepted path of the window (``accept`` with the proposal's q)."""
        return accept(keys, p, proposal.q, tree)


EXACT = Exact()

