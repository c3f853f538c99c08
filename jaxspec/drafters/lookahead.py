"""Lookahead decoding on device: Jacobi iterations fill an n-gram pool inside the verify forward.

Lookahead decoding (Fu, Bailis, Stoica, Zhang 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", ICML; reference code ``hao-ai-lab/LookaheadDecoding``,
``lade/decoding.py``) needs no draft model and no training. Each step's ONE target forward
runs two branches beside the root (the last committed token):

- the lookahead branch (Sec. 3.1, Fig. 2): a 2-D window of ``ngram - 1`` levels of ``window``
  tokens, the last ``ngram - 1`` Jacobi iterates. Level 0 (the oldest) is a chain: column i
  sits at depth i + 1 and continues column i - 1 (column 0 continues the root); the token
  at level l >= 1, column i continues (level l - 1, column i) and sits at depth i + 1 + l.
  So every token sees the committed text, level 0's columns 0..i and its own column's lower
  levels: column i read upwards is a run of consecutive positions, the trajectory the paper
  collects. This is the attention mask of Fig. 2(b) (rows of W tokens at relative
  positions 1..W, 2..W+1, ...), obtained here as the ancestor mask of a tree
  (``jaxspec.tree``) whose lookahead nodes are INVALID: computed, never candidates.
  (``lade`` puts the root in level 0's first column, one token fewer; we keep the paper's
  count, W (N - 1) tokens.)
- the verification branch (Sec. 3.2): up to ``guesses`` n-grams from the pool whose first
  token is the root, their ``ngram - 1`` continuation tokens merged into a trie (shared
  prefixes once: ``ngram.merge_branches``) of VALID nodes, verified by the engine like any
  draft tree.

After verification (``commit``) the target's argmax after every window entry
(``Committed.argmax``) gives the next Jacobi iterate: the new level is the argmax at the
last level's nodes; each column (level 0 .. last level, new token) is an n-gram added to the
pool; the levels shift (level 0 dropped, the new level appended). As in ``lade`` the window
moves one position per step whatever was accepted (its ``ALWAYS_FWD_ONE`` default): the
guesses stay guesses, the verification keeps the output exact.

The pool (static shapes, per row): ``pool_size`` slots of n-grams, each with the step clock
at which it was last seen. Replacement policy, written down: no duplicates; an n-gram seen
again is refreshed (its stamp moves to now), a new one takes the slot least recently seen
(empty slots first): least recently used over the whole pool. The candidates of a root are
the ``guesses`` most recently seen n-grams starting with it. ``lade`` keeps at most
``guesses`` n-grams per first token with the same LRU refresh; with a pool large enough
that nothing is evicted, the candidates are the same set. Items of one update are seen in
order (stamps ``clock + j``); refreshes apply before new n-grams are placed; when one update
brings more new n-grams than the pool holds (a long prompt), the most recent are kept.
What enters the pool: the prompt's n-grams at ``init`` (``lade``'s ``POOL_FROM_PROMPT``),
then per step the n-grams ending at the root and at each newly emitted token (text the
target wrote, like prompt lookup), then the window's W columns.

Initial window: level l, column i holds the prompt token at ``len - (window + ngram - 2) + i
+ l`` (mod the prompt length): the prompt's tail, each column an n-gram of it (the paper
fills the window with random prompt tokens; a deterministic choice needs no key and
converges the same way: Jacobi iteration overwrites it within ``ngram - 1`` steps).

Lossless: greedy keeps the longest path of target argmaxes; sampling uses the paper's
multi-candidate rule (Sec. 3.3, after SpecInfer): candidates are deterministic (q = None),
so each child c is accepted with probability r(c), else c is removed from r, r renormalised
and the next sibling tried (``jaxspec.acceptance``); the candidates depend only on the text
before the step, never on the step's draws. Every sampling setting applies as for any
drafter. Cost per step: ``(window + guesses) * (ngram - 1)`` tokens besides the root.

Shape letters: the package legend, plus ``R = ngram - 1`` levels (rows of the window),
``C = window`` columns, ``G = guesses``, ``Q = pool_size`` slots and ``U`` n-grams in one pool
update (the paper's W, N, G are ``window``, ``ngram``, ``guesses``: in this package W and N
name the verify window and the tree's nodes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Capabilities, Unsplit, check_int
from jaxspec.drafters.ngram import merge_branches
from jaxspec.tree import Proposal

MAX_WINDOW = 64
MAX_NGRAM = 16
MAX_GUESSES = 64
MAX_POOL = 1 << 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookaheadState:
    """The drafter's loop state, all device arrays.

    Attributes:
      levels: int32 ``[B, R, C]``, the lookahead window, level 0 the oldest iterate.
      pool: int32 ``[B, Q, ngram]``, n-grams; column 0 is the key (first token).
      seen: int32 ``[B, Q]``, the clock at which each slot's n-gram was last seen; -1: empty.
      clock: int32 ``[B]``, n-grams offered to the pool so far (the next stamp).
    """

    levels: jax.Array
    pool: jax.Array
    seen: jax.Array
    clock: jax.Array


def _same(a: jax.Array, b: jax.Array) -> jax.Array:
    """bool ``[U, K]``: n-gram ``a[u]`` equals ``b[k]`` (``a [U, n]``, ``b [K, n]``), one
    column at a time so no ``[U, K, n]`` array is built."""
    eq = jnp.ones((a.shape[0], b.shape[0]), bool)
    for k in range(a.shape[1]):
        eq &= a[:, None, k] == b[None, :, k]
    return eq


def _last_copies(items: jax.Array, ok: jax.Array) -> jax.Array:
    """bool ``[U]``: the counted items whose n-gram does not occur again later among the
    counted items of ``items [U, n]``. By one sort (counted first, then by n-gram, then by
    position), not pairwise: a long prompt's n-grams would need a ``[U, U]`` table."""
    m, n = items.shape
    order = jnp.lexsort((jnp.arange(m),) + tuple(items[:, k] for k in reversed(range(n))) + (~ok,))
    ranked, counted = items[order], ok[order]
    next_same = jnp.all(ranked[1:] == ranked[:-1], axis=1) & counted[1:]
    last = counted & ~jnp.concatenate([next_same, jnp.zeros((1,), bool)])
    return jnp.zeros((m,), bool).at[order].set(last)


def pool_insert(pool: jax.Array, seen: jax.Array, clock: jax.Array, items: jax.Array, ok: jax.Array,
                empty: bool = False):
    """One row's pool after seeing ``items`` in order (the replacement policy of the module
    docstring).

    Args:
      pool: int32 ``[Q, n]``; seen: int32 ``[Q]`` (-1 empty); clock: int32 scalar.
      items: int32 ``[U, n]``, item j stamped ``clock + j``; ok: bool ``[U]``, which count.
      empty: static: the pool is known to be empty (``init``), so nothing is looked up.

    Returns:
      ``(pool, seen, clock + U)``. The caller guarantees ``U <= Q`` unless the pool is empty.
    """
    m, q = items.shape[0], pool.shape[0]
    j = jnp.arange(m)
    stamp = clock + j
    last = _last_copies(items, ok)  # the last copy of each n-gram of this update
    new = last
    if not empty:
        hit = _same(items, pool) & (seen >= 0)[None, :] & last[:, None]  # [U, Q]
        seen = jnp.maximum(seen, jnp.max(jnp.where(hit, stamp[:, None], -1), axis=0))
        new = last & ~jnp.any(hit, axis=1)
    rank = jnp.cumsum(new[::-1])[::-1] - 1  # 0 for the most recent new n-gram
    if empty:
        order, k = jnp.arange(q), q
    else:  # the k least recently seen slots (empty ones, seen -1, first): no sort of the pool
        k = min(m, q)
        order = jax.lax.top_k(-seen, k)[1]
    slot = jnp.where(new & (rank < k), order[jnp.clip(rank, 0, k - 1)], q)
    pool = pool.at[slot].set(items, mode="drop")
    seen = seen.at[slot].set(stamp, mode="drop")
    return pool, seen, clock + m


def _ngrams(tokens: jax.Array, ends: jax.Array, n: int) -> jax.Array:
    """int32 ``[B, U, n]``: the n tokens of ``tokens [B, S]`` ending at slots ``ends [B, U]``
    (clipped into the buffer; callers mask the n-grams that start before slot 0)."""
    b, m = ends.shape
    idx = ends[:, :, None] - (n - 1) + jnp.arange(n)[None, None]
    idx = jnp.clip(idx, 0, tokens.shape[1] - 1).reshape(b, m * n)
    return jnp.take_along_axis(tokens, idx, axis=1).reshape(b, m, n)


@dataclasses.dataclass(frozen=True)
class LookaheadDrafter(Unsplit):
    """Lookahead decoding: Jacobi lookahead branch + n-gram pool verification, on device.

    Attributes:
      window: W (W, N, G are the paper's symbols, Sec. 3), columns of the lookahead window (tokens per Jacobi level), in [1, 64].
      ngram: N, n-gram size: levels kept = N - 1, candidate depth = N - 1, in [2, 16].
      guesses: G, most candidates verified per step, in [1, 64].
      pool_size: n-gram slots per row, in [window + ngram + 1, 65536] (one step offers
        ``window + ngram + 1`` n-grams), and >= guesses. The default, 4096, holds the
        n-grams of a prompt of a few thousand tokens plus ~200 steps of new ones: LRU evicts
        the oldest first, i.e. the start of the prompt, which a rewrite copies first. A
        step's pool work is O(pool_size x ngram) compares.

    Per step the target verifies ``1 + (window + guesses) * (ngram - 1)`` tokens (``n_nodes``
    + the root): the lookahead branch's W (N - 1) and the candidates' G (N - 1) node slots.

    Raises:
      ValueError: at construction, naming the setting and its range.
    """

    window: int = 5
    ngram: int = 4
    guesses: int = 5
    pool_size: int = 4096
    capabilities = Capabilities()  # class attributes, not fields: never abstains (the window always runs)
    kind = "lookahead"

    def __post_init__(self):
        check_int("window", self.window, 1, MAX_WINDOW, " (W, lookahead window columns)")
        check_int("ngram", self.ngram, 2, MAX_NGRAM, " (N, n-gram size: N - 1 Jacobi levels)")
        check_int("guesses", self.guesses, 1, MAX_GUESSES, " (G, candidates verified per step)")
        low = max(self.window + self.ngram + 1, self.guesses)
        check_int("pool_size", self.pool_size, low, MAX_POOL,
                  f" (one step offers window + ngram + 1 = {self.window + self.ngram + 1} n-grams to the pool and "
                  f"up to guesses = {self.guesses} are read)")

    @property
    def gamma(self) -> int:
        """The deepest candidate: ``ngram - 1``."""
        return self.ngram - 1

    @property
    def n_nodes(self) -> int:
        """N nodes = (window + guesses) * (ngram - 1): candidate trie first, then the window."""
        return (self.window + self.guesses) * (self.ngram - 1)

    @property
    def first_window_node(self) -> int:
        """Node index of level 0, column 0 (after the ``guesses * (ngram - 1)`` trie slots)."""
        return self.guesses * (self.ngram - 1)

    def window_parents(self) -> np.ndarray:
        """int32 ``[R * C]``: each window node's parent node, level-major (node
        ``first_window_node + l * C + i`` is level l, column i)."""
        o, c = self.first_window_node, self.window
        level, col = np.divmod(np.arange((self.ngram - 1) * c), c)
        chain = np.where(col == 0, -1, o + col - 1)  # level 0: the previous column (column 0: the root)
        above = o + (level - 1) * c + col  # level l >= 1: the same column one level down
        return np.where(level == 0, chain, above).astype(np.int32)

    def select_params(self, target_params, drafter_params):
        return None

    def validate(self, target_config: ModelConfig, drafter_params) -> None:
        return None

    def init(self, params, prefill, max_len) -> LookaheadState:
        """The window from the prompt's tail and the pool seeded with the prompt's n-grams
        (the one ending at slot e stamped e; the clock starts at the prompt length)."""
        prompt, lens = prefill.prompt, prefill.prompt_lens
        b, p = prompt.shape
        n, c = self.ngram, self.window
        offsets = np.arange(n - 1)[:, None] + np.arange(c)[None, :] - (c + n - 2)  # [R, C]
        idx = jnp.mod(lens[:, None, None] + offsets[None], lens[:, None, None])
        levels = jnp.take_along_axis(prompt, idx.reshape(b, -1), axis=1).reshape(b, n - 1, c)
        ends = jnp.broadcast_to(jnp.arange(p)[None], (b, p))
        ok = (ends >= n - 1) & (ends < lens[:, None])
        pool = jnp.zeros((b, self.pool_size, n), jnp.int32)
        seen = jnp.full((b, self.pool_size), -1, jnp.int32)
        seed = functools.partial(pool_insert, empty=True)
        pool, seen, _ = jax.vmap(seed)(pool, seen, jnp.zeros((b,), jnp.int32), _ngrams(prompt, ends, n), ok)
        return LookaheadState(levels.astype(jnp.int32), pool, seen, lens.astype(jnp.int32))

    def candidates(self, state: LookaheadState, root: jax.Array):
        """The ``guesses`` most recently seen pool n-grams starting with ``root`` int32 ``[B]``:
        ``(continuations int32 [B, G, ngram - 1], found bool [B, G])``, most recent first."""
        score = jnp.where((state.pool[:, :, 0] == root[:, None]) & (state.seen >= 0), state.seen, -1)
        top, idx = jax.lax.top_k(score, self.guesses)
        grams = jnp.take_along_axis(state.pool, idx[:, :, None], axis=1)
        return grams[:, :, 1:], top >= 0

    def propose(self, params, state: LookaheadState, context):
        """``(state, Proposal)``: the candidates' trie (valid, ``guesses * (ngram - 1)`` slots),
        then the window level-major (invalid: computed by the verify forward, never accepted)."""
        b = context.tokens.shape[0]
        root = jnp.take_along_axis(context.tokens, (context.seq_lens - 1)[:, None], axis=1)[:, 0]
        conts, found = self.candidates(state, root)
        tokens, parents, valid = jax.vmap(merge_branches)(conts, found)
        n_window = (self.ngram - 1) * self.window
        tokens = jnp.concatenate([tokens, state.levels.reshape(b, n_window)], axis=1)
        parents = jnp.concatenate([parents, jnp.broadcast_to(jnp.asarray(self.window_parents()), (b, n_window))],
                                  axis=1)
        valid = jnp.concatenate([valid, jnp.zeros((b, n_window), bool)], axis=1)
        return state, Proposal(tokens, parents, valid, None)

    def commit(self, params, state: LookaheadState, committed) -> LookaheadState:
        """The next Jacobi level from ``committed.argmax``, the window's columns and the new
        text's n-grams into the pool, the levels shifted by one."""
        n, c = self.ngram, self.window
        last_level = 1 + self.first_window_node + (n - 2) * c + np.arange(c)  # window indices
        new = committed.argmax[:, last_level]  # [B, C]
        columns = jnp.concatenate([state.levels, new[:, None]], axis=1).transpose(0, 2, 1)  # [B, C, n]
        ends = committed.start[:, None] + jnp.arange(n + 1)[None]  # the root, then up to n emitted tokens
        text = _ngrams(committed.tokens, ends, n)
        ok = jnp.concatenate([(ends >= n - 1) & (ends < committed.seq_lens[:, None]),
                              jnp.ones(new.shape, bool)], axis=1)
        pool, seen, clock = jax.vmap(pool_insert)(state.pool, state.seen, state.clock,
                                                  jnp.concatenate([text, columns], axis=1), ok)
        levels = jnp.concatenate([state.levels[:, 1:], new[:, None]], axis=1)
        return LookaheadState(levels, pool, seen, clock)
