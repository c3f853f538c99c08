"""N-gram prompt lookup drafting, computed on device, as a chain or a tree of several matches.

The drafts are the tokens that followed an earlier occurrence of the sequence's last n tokens,
trying n from ``max_n`` down to ``min_n`` (Saxena 2023, "Prompt Lookup Decoding"; Hugging
Face's ``prompt_lookup_num_tokens``, vLLM's ``ngram`` method). Context is the prompt plus
everything generated so far. With ``branches = k > 1`` the k best matches each give a branch
of ``gamma`` tokens from the root, and branches that start alike are merged into one path
(a trie), so the tree has ``k * gamma`` node slots and no two siblings share a token. Choices,
written down:

- matches are ranked by n-gram length, then recency: the most recent match of the longest
  n wins (Hugging Face takes the earliest): in generated text that repeats itself, the latest
  occurrence is the likeliest continuation; each continuation start counts once;
- when the match's continuation runs into the present, it repeats with the match's period
  (tokens ``[j + n, seq_len)`` cycled), which drafts loops and lists well;
- ``min_n`` defaults to 2: single-token matches draft poorly (on 8 Spec-Bench prompts with
  SmolLM2 on CPU, min_n 1 gave tau 1.43 but 0.99x plain speed, min_n 2 tau 1.31 and 1.10x,
  since a dead window costs a 5-token verify instead of a 1-token step);
- with no match it abstains (every node invalid), and branches that found no match are
  invalid; valid nodes come first (best match first), so the engine verifies only the nodes
  the batch uses (``Capabilities.abstains``, ``verify_widths``), a one-token step when
  nothing matched;
- adaptive depth (``short_gamma``): how far the text before the match agrees with the text
  before the present (the match's extent, counted back up to ``long_match`` tokens) says how
  much of the continuation will be accepted. On SmolLM2's greedy answers to 39 Spec-Bench
  questions (not the evaluation subset), the best match got on average 1.9 of 16 drafted
  tokens accepted when it extended over 2 tokens, 3.5 over 4, 9.3 over 10-15 and 11.2 over
  16-31 (copying). So a match that extends over ``long_match`` tokens drafts ``gamma``, any
  other ``short_gamma``, and the engine verifies windows of either size: long drafts where
  the text is being copied (code edits, extraction), short and cheap ones elsewhere
  (``benchmarks/experiments/ngram_replay.py`` replays the policies over recorded outputs);
- a tree with adaptive depth drafts ``branches`` short branches when no match is copying,
  but only the copying match, as one chain of ``gamma``, when one is: the other matches'
  branches would add ``(branches - 1) * gamma`` nodes to every verify while the text is
  copied (a 33-token verify instead of 17 for 2 x 16; on SmolLM2 on CPU a 33-token pass
  costs 1.4x a 17-token one after 200 committed tokens and 1.2x after 830,
  ``benchmarks/results/pass_cost_smollm2-135m-gemma3-270m_cpu_2026-12-01.json``,
  ``pass_cost_smollm2-135m-1024slots_cpu_2026-12-04.json``)
  for drafts that the copied one almost always beats. The node budget is then ``max(gamma, branches *
  short_gamma)``;
- a match other than the best drafts a branch only when its n-gram is at least
  ``branch_min_n`` long (default ``max_n``): on the same 39 answers, following the chain's
  path, a second branch of 4 from a 2-gram match raised the accepted length of a step by
  0.25 tokens on average (213 steps), from a 3-gram match by 0.46 (101 steps), while its 4
  nodes cost about 0.3 tokens' worth (a 9-token pass costs 1.2x a 5-token one on CPU, at
  about 1.45 tokens a step); ``benchmarks/experiments/ngram_replay.py`` estimates 1-2% over branching
  from every match. Matches are ranked by size, so the branches kept are the first ones.

Deterministic: ``q`` is ``None`` (acceptance treats every node as a one-hot proposal, which
is exact for distinct siblings: ``jaxspec.acceptance``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Capabilities, Stateless, check_gamma, check_int
from jaxspec.tree import Proposal

MAX_NGRAM = 16  # the lookup unrolls over n-gram sizes: compile time grows ~quadratically
MAX_BRANCHES = 16


def match_sizes(source: jax.Array, lo: jax.Array, hi: jax.Array, row: jax.Array, n: jax.Array, max_n: int,
                min_n: int) -> jax.Array:
    """int32 ``[W]``: for each slot c of ``source`` (``[W]``) with ``lo <= c < hi``, the longest
    n-gram size in ``[min_n, max_n]`` for which ``source[c - size : c]`` equals the row's last
    ``size`` tokens (``row [S]``, ``n`` valid); 0 where none."""
    w = source.shape[0]
    best = jnp.zeros((w,), jnp.int32)
    for size in range(min_n, max_n + 1):
        if size >= w:
            continue
        pattern = jax.lax.dynamic_slice_in_dim(row, jnp.maximum(n - size, 0), size)
        c = jnp.arange(size, w)  # continuation slots, the n-gram being source[c - size : c]
        match = (c >= lo) & (c < hi) & (n >= size)
        for i in range(size):
            match &= source[i : w - size + i] == pattern[i]
        best = best.at[c].max(jnp.where(match, size, 0))
    return best


def match_starts(row: jax.Array, n: jax.Array, k: int, max_n: int, min_n: int) -> tuple[jax.Array, jax.Array]:
    """The first continuation slots of the ``k`` best earlier matches of one sequence's tail.

    Args:
      row: int32 ``[S]`` tokens, valid before ``n``; n: int32 scalar, valid tokens (>= 1).

    Returns:
      ``(starts, sizes)``, int32 ``[k]`` each, best first (longest n-gram, then most recent):
      the slots, -1 where fewer matched, and the matched n-gram sizes, 0 there.
    """
    s = row.shape[0]
    best = match_sizes(row, 0, n, row, n, max_n, min_n)  # best[c]: longest n-gram whose match continues at c < n
    score = jnp.where(best > 0, best * s + jnp.arange(s), -1)
    top, starts = jax.lax.top_k(score, k)
    return jnp.where(top >= 0, starts, -1).astype(jnp.int32), jnp.where(top >= 0, top // s, 0).astype(jnp.int32)


def continuation(row: jax.Array, n: jax.Array, start: jax.Array, gamma: int) -> jax.Array:
    """int32 ``[gamma]``: the tokens from slot ``start`` on, cycled with the match's period
    ``n - start`` when they run into the present."""
    period = jnp.maximum(n - start, 1)
    return row[jnp.clip(start + jnp.arange(gamma) % period, 0, row.shape[0] - 1)]


def match_extent(row: jax.Array, n: jax.Array, start: jax.Array, limit: int) -> jax.Array:
    """int32 scalar: over how many tokens (at most ``limit``) the text before slot ``start``
    equals the text before the present (slot ``n``): the length of the match that continues
    at ``start``, counted back without the n-gram size cap."""
    back = jnp.arange(1, limit + 1)
    ok = (start - back >= 0) & (row[jnp.clip(start - back, 0)] == row[jnp.clip(n - back, 0)])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))


def _pad_to(x: jax.Array, n: int, fill) -> jax.Array:
    """``x [m]`` padded with ``fill`` to ``[n]``."""
    return jnp.pad(x, (0, n - x.shape[0]), constant_values=fill)


def merge_branches(branches: jax.Array, found: jax.Array):
    """Merge ``k`` branches of ``gamma`` tokens from the root into a trie.

    Args:
      branches: int32 ``[k, gamma]``; found: bool ``[k]``, which branches exist.

    Returns:
      ``(tokens [k * gamma], parents [k * gamma], valid [k * gamma])``, node ``b * gamma + l``
      being depth l + 1 of branch b; a node whose path equals an earlier branch's is invalid
      and its children hang off that branch's node instead (parents stay earlier nodes).
    """
    k, gamma = branches.shape
    same = jnp.cumprod(branches[:, None, :] == branches[None, :, :], axis=2).astype(bool)  # [k, k, gamma]
    same &= found[None, :, None]
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # [k, k]: b' < b
    dup = same & earlier[:, :, None]
    first = jnp.argmax(dup, axis=1)  # [k, gamma]: the earliest branch with the same path
    is_dup = jnp.any(dup, axis=1)
    owner = jnp.where(is_dup, first, jnp.arange(k)[:, None])  # who holds node (b, l)
    level = jnp.arange(gamma)[None, :]
    parent_owner = jnp.concatenate([owner[:, :1], owner[:, :-1]], axis=1)
    parents = jnp.where(level == 0, -1, parent_owner * gamma + level - 1).reshape(-1)
    valid = (found[:, None] & ~is_dup).reshape(-1)
    return branches.reshape(-1), parents.astype(jnp.int32), valid


@dataclasses.dataclass(frozen=True)
class NGramDrafter(Stateless):
    """Prompt-lookup drafter.

    Attributes:
      gamma: draft tokens per branch (the tree's depth, >= 1).
      max_n: longest n-gram matched (>= min_n).
      min_n: shortest n-gram matched (>= 1).
      branches: matches drafted as branches of one tree (1 = a chain), in [1, 16]; the node
        budget is ``branches * gamma`` (``max(gamma, branches * short_gamma)`` with adaptive
        depth).
      short_gamma: adaptive depth (0: off, every match drafts ``gamma``): when the best match
        extends over fewer than ``long_match`` tokens (``match_extent``) each branch drafts
        ``short_gamma`` tokens, in [1, gamma); otherwise the best match alone drafts
        ``gamma`` (a chain).
      long_match: the extent, in tokens, from which a match counts as copying and drafts
        ``gamma`` (in [2, 256]; read only with ``short_gamma``).
      branch_min_n: the shortest n-gram with which a match other than the best drafts a
        branch, in [min_n, max_n]; None (default): ``max_n``.

    Raises:
      ValueError: at construction, for gamma < 1, n-gram sizes, branches, short_gamma,
        long_match or branch_min_n out of range.
    """

    gamma: int = 4
    max_n: int = 3
    min_n: int = 2
    branches: int = 1
    short_gamma: int = 0
    long_match: int = 16
    branch_min_n: int | None = None
    kind = "ngram"  # class attribute, not a field

    def __post_init__(self):
        check_gamma(self.gamma)
        if not 1 <= self.min_n <= self.max_n <= MAX_NGRAM:
            raise ValueError(
                f"n-gram sizes need 1 <= min_n <= max_n <= {MAX_NGRAM} (compile time grows with max_n), "
                f"got min_n={self.min_n}, max_n={self.max_n}"
            )
        check_int("branches", self.branches, 1, MAX_BRANCHES)
        if self.short_gamma:
            check_int("short_gamma", self.short_gamma, 1, self.gamma - 1, " (below gamma; 0: off)")
        check_int("long_match", self.long_match, 2, 256)
        if self.branch_min_n is not None:
            check_int("branch_min_n", self.branch_min_n, self.min_n, self.max_n, " (the n-gram sizes matched)")

    @property
    def n_nodes(self) -> int:
        """N = branches * gamma; with adaptive depth ``max(gamma, branches * short_gamma)``."""
        if self.short_gamma:
            return max(self.gamma, self.branches * self.short_gamma)
        return self.branches * self.gamma

    @property
    def capabilities(self) -> Capabilities:
        """Abstains; proposals fill the first ``branches x gamma`` slots, one best match alone
        the first ``gamma``; with adaptive depth the first ``branches x short_gamma`` (one
        match: ``short_gamma``) or, copying, ``gamma``."""
        if self.short_gamma:
            widths = {self.short_gamma, self.branches * self.short_gamma, self.gamma}
        else:
            widths = {self.gamma, self.branches * self.gamma}
        return Capabilities(abstains=True, verify_widths=tuple(sorted(widths)))

    def _draft_row(self, row, n):
        starts, sizes = match_starts(row, n, self.branches, self.max_n, self.min_n)
        conts = jax.vmap(lambda st: continuation(row, n, st, self.gamma))(starts)
        min_n = self.max_n if self.branch_min_n is None else self.branch_min_n
        found = (starts >= 0) & ((jnp.arange(self.branches) == 0) | (sizes >= min_n))  # a prefix: ranked by size
        if not self.short_gamma:
            return merge_branches(conts, found)
        tree = merge_branches(conts[:, : self.short_gamma], found)
        chain = (conts[0], jnp.arange(self.gamma, dtype=jnp.int32) - 1, jnp.full((self.gamma,), starts[0] >= 0))
        copying = match_extent(row, n, starts[0], self.long_match) >= self.long_match
        return tuple(jnp.where(copying, _pad_to(c, self.n_nodes, f), _pad_to(t, self.n_nodes, f))
                     for c, t, f in zip(chain, tree, (0, -1, False)))

    def propose(self, params, state, context):
        tokens, parents, valid = jax.vmap(self._draft_row)(context.tokens, context.seq_lens)
        return state, Proposal(tokens, parents, valid, None)
