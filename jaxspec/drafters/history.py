"""Rollout-history drafting: the row's suffix looked up in its own text, in its siblings' and in
earlier rollouts of its prompt, and the continuations found drafted as a frequency tree.

RL post-training samples G answers to each prompt every step, and the same prompts come back
every epoch; sibling answers and earlier answers share much of their text. This drafter needs
no weights of its own, so it never drifts from the policy as the weights move (SuffixDecoding,
Oliaro et al. 2024, arXiv 2411.04975, Sec. 3-4; DAS, Shao et al. 2025, arXiv 2511.13841,
Sec. 3). Everything runs on device, with static shapes:

- **Sources.** For row b: (a) its own text, prompt and output so far (prompt lookup: any
  earlier slot); (b) up to ``siblings`` other rows of the batch with the same prompt, their
  output as far as it has got (rows sampling one prompt ``n`` times, or the same prompt given
  several times); (c) the earlier rollouts of its prompt that ``generate`` was given as the
  drafter's params (``jaxspec.rollouts.RolloutHistory``), each stored as its prompt's last
  tokens and its output.
- **Matches.** For each source slot c: the longest n in [min_n, max_n] for which the n tokens
  before c equal the row's last n tokens, and a continuation token at c exists (for (b) and
  (c) in the output part). Only occurrences of the longest n found anywhere count (the
  deepest suffix-tree node matched, SuffixDecoding Sec. 3); of those, the first
  ``MAX_CANDIDATES`` (own text first, most recent first, then siblings, then history).
- **Tree.** Each candidate's continuation is up to ``gamma`` tokens (the own text's cycles with
  the match's period when it runs into the present, as ``ngram.continuation``; a sibling's or
  an earlier rollout's ends where its text does). Every distinct prefix of the continuations is
  a node, scored by how many candidates share it: the empirical frequency of that continuation
  after this suffix, which estimates the target's chance of sampling it (SuffixDecoding
  Sec. 4, greedy expansion by estimated probability). The ``tree_nodes`` best nodes are
  drafted, ties going to the shallower node, so every node's parent is in the tree (a parent
  is shared by at least as many candidates as its child). With one candidate the tree is its
  chain.

Deterministic: ``q`` is None (exact for distinct siblings: ``jaxspec.acceptance``). Lossless at
any temperature, siblings included: the siblings' tokens are random, but a row's drafts at a
step are a function of the text committed before the step, and the row's acceptance draws at
that step are fresh keys of its own, independent of everything drafted from
(tests/test_distribution.py runs the chi-square test with siblings, and rejects a drafter that
peeks at the row's acceptance draws).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Capabilities, Unsplit, check_gamma, check_int
from jaxspec.drafters.ngram import MAX_NGRAM, match_sizes
from jaxspec.tree import Proposal

MAX_CANDIDATES = 32  # occurrences whose continuations are counted (static: [C, C, gamma] compares)
MAX_SIBLINGS = 64
MAX_NODES = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryRows:
    """Each row's earlier rollouts of its prompt, as one call's drafter params
    (``jaxspec.rollouts.RolloutHistory.rows``).

    Attributes:
      tokens: int32 ``[B, H, L]``: rollout h of row b's prompt, its prompt's last tokens then
        its output, newest first; lens: int32 ``[B, H]``, valid tokens (0: no rollout);
      starts: int32 ``[B, H]``, where the output begins (continuations start there or later).
    """

    tokens: jax.Array
    lens: jax.Array
    starts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryState:
    """Siblings, found once from the prompts (``init``).

    Attributes:
      siblings: int32 ``[B, K]``, rows with the same prompt (-1: none); prompt_lens: int32 ``[B]``.
    """

    siblings: jax.Array
    prompt_lens: jax.Array


def find_siblings(prompt: jax.Array, lens: jax.Array, k: int) -> jax.Array:
    """int32 ``[B, min(k, B - 1)]``: for each row, up to ``k`` other rows with the same prompt
    (``prompt [B, P]`` right-padded alike, ``lens [B]``), the lowest rows first; -1 where fewer.

    O(B log B): rows are sorted by a hash of their prompt, each row's candidates are the first
    ``k + 1`` rows of its hash's run, and a candidate counts only if its prompt is equal
    (a hash collision never makes siblings)."""
    b = prompt.shape[0]
    k = min(k, b - 1)
    if k <= 0:
        return jnp.zeros((b, 0), jnp.int32)
    powers = jnp.asarray(np.cumprod(np.full(prompt.shape[1], 1000003, np.uint64)) % (1 << 32), jnp.uint32)
    h = jnp.sum(prompt.astype(jnp.uint32) * powers[None, :], axis=1, dtype=jnp.uint32) ^ lens.astype(jnp.uint32)
    order = jnp.argsort(h, stable=True)  # equal hashes keep row order
    hs = h[order]
    run_start = jnp.concatenate([jnp.ones((1,), bool), hs[1:] != hs[:-1]])
    first = jax.lax.cummax(jnp.where(run_start, jnp.arange(b), 0))  # [B] in sorted order
    at = first[:, None] + jnp.arange(k + 1)[None, :]  # candidate positions, sorted order
    cand = order[jnp.clip(at, 0, b - 1)]
    me = order[:, None]
    ok = (at < b) & (hs[jnp.clip(at, 0, b - 1)] == hs[:, None]) & (cand != me)
    ok &= jnp.all(prompt[cand] == prompt[me], axis=2) & (lens[cand] == lens[me])
    rank = jnp.argsort(jnp.where(ok, 0, 1), axis=1, stable=True)[:, :k]  # the valid ones first, in order
    sib = jnp.where(jnp.take_along_axis(ok, rank, 1), jnp.take_along_axis(cand, rank, 1), -1)
    return jnp.zeros((b, k), jnp.int32).at[order].set(sib.astype(jnp.int32))


def frequency_tree(conts: jax.Array, ok: jax.Array, n_nodes: int):
    """The ``n_nodes`` most shared prefixes of ``C`` continuations, as a tree.

    Args:
      conts: int32 ``[C, gamma]``; ok: bool ``[C, gamma]``, valid tokens (a prefix of each row).

    Returns:
      ``(tokens, parents, valid)``, ``[n_nodes]`` each, best first: node = the prefix
      ``conts[i, : d + 1]`` of its first candidate i, scored by the candidates sharing it, ties
      to the shallower then the earlier; parents index earlier nodes (-1: the root).
    """
    c, g = conts.shape
    same = jnp.cumprod((conts[:, None, :] == conts[None, :, :]) & ok[:, None, :] & ok[None, :, :], axis=2)
    same = same.astype(bool)  # [C, C, g]: candidates i and j agree through depth d
    count = same.sum(axis=1)  # [C, g]
    first = jnp.argmax(same, axis=1)  # [C, g]: the first candidate with the same prefix
    owner = ok & (first == jnp.arange(c)[:, None])
    depth, cand = jnp.arange(g)[None, :], jnp.arange(c)[:, None]
    key = jnp.where(owner, (count * g + (g - 1 - depth)) * c + (c - 1 - cand), -1).reshape(-1)
    k = min(n_nodes, c * g)
    top, sel = jax.lax.top_k(key, k)
    valid = top >= 0
    i, d = sel // g, sel % g
    pos = jnp.full((c * g,), -1, jnp.int32).at[jnp.where(valid, sel, c * g)].set(jnp.arange(k, dtype=jnp.int32),
                                                                                   mode="drop")
    parent_owner = first[i, jnp.maximum(d - 1, 0)]
    parents = jnp.where(d == 0, -1, pos[parent_owner * g + jnp.maximum(d - 1, 0)])
    tokens, parents, valid = conts[i, d], jnp.where(valid, parents, -1), valid
    pad = n_nodes - k
    return (jnp.pad(tokens, (0, pad)), jnp.pad(parents, (0, pad), constant_values=-1), jnp.pad(valid, (0, pad)))


@dataclasses.dataclass(frozen=True)
class HistoryDrafter(Unsplit):
    """Drafts from the row's own text, its siblings' and earlier rollouts of its prompt.

    Attributes:
      gamma: deepest draft (>= 1).
      tree_nodes: node budget N, in [gamma, 64]; the best N prefixes are drafted.
      max_n, min_n: n-gram sizes matched (``1 <= min_n <= max_n <= 16``).
      siblings: other rows of the same prompt looked up, in [0, 64] (0: none).

    Params: None (own text and siblings) or ``jaxspec.rollouts.HistoryRows`` (what
    ``generate`` makes of a ``jaxspec.rollouts.RolloutHistory`` given as ``drafter_params``).

    Raises:
      ValueError: at construction, a field out of range; ``validate``: params that are not a
        history, or a history of another vocabulary.
    """

    gamma: int = 6
    tree_nodes: int = 12
    max_n: int = 4
    min_n: int = 2
    siblings: int = 7
    kind = "history"  # class attribute, not a field

    def __post_init__(self):
        check_gamma(self.gamma)
        check_int("tree_nodes", self.tree_nodes, self.gamma, MAX_NODES, " (at least gamma)")
        if not 1 <= self.min_n <= self.max_n <= MAX_NGRAM:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n <= {MAX_NGRAM}, got min_n={self.min_n}, "
                             f"max_n={self.max_n}")
        check_int("siblings", self.siblings, 0, MAX_SIBLINGS)

    @property
    def n_nodes(self) -> int:
        """N = tree_nodes."""
        return self.tree_nodes

    @property
    def capabilities(self) -> Capabilities:
        """Abstains (no match: no node); best nodes first, so short trees verify short windows."""
        widths = sorted({w for w in (self.gamma, (self.tree_nodes + self.gamma) // 2) if w < self.tree_nodes})
        return Capabilities(abstains=True, verify_widths=tuple(widths))

    def select_params(self, target_params, drafter_params):
        """The history rows as given (None: own text and siblings only)."""
        return drafter_params

    def validate(self, target_config: ModelConfig, drafter_params) -> None:
        """Raise ``ValueError`` unless the params are None, a ``RolloutHistory`` over the
        target's vocabulary, or ``HistoryRows``."""
        from jaxspec.rollouts import RolloutHistory

        if drafter_params is None or isinstance(drafter_params, HistoryRows):
            return
        if not isinstance(drafter_params, RolloutHistory):
            raise ValueError(f"HistoryDrafter's drafter_params must be None or a jaxspec.RolloutHistory, got a "
                             f"{type(drafter_params).__name__}")
        if drafter_params.vocab_size != target_config.vocab_size:
            raise ValueError(f"the RolloutHistory was built for a vocabulary of {drafter_params.vocab_size} tokens, "
                             f"the target {target_config.name} has {target_config.vocab_size}")

    def init(self, params, prefill, max_len) -> HistoryState:
        """Each row's siblings (``find_siblings``)."""
        return HistoryState(find_siblings(prefill.prompt, prefill.prompt_lens, self.siblings), prefill.prompt_lens)

    def commit(self, params, state, committed):
        """Unchanged: the sources are read afresh at every step."""
        return state

    def _row(self, row, n, sib_tokens, sib_lo, sib_hi, hist):
        """``(tokens, parents, valid)`` ``[N]`` of one row (sources stacked ``[M, W]``)."""
        s = row.shape[0]
        sources = [row[None]] + ([sib_tokens] if sib_tokens.shape[0] else [])
        lo = [jnp.zeros((1,), jnp.int32)] + ([sib_lo] if sib_tokens.shape[0] else [])
        hi = [n[None]] + ([sib_hi] if sib_tokens.shape[0] else [])
        if hist is not None:
            h_tokens, h_lens, h_starts = hist
            w = max(s, h_tokens.shape[1])
            sources = [jnp.pad(x, ((0, 0), (0, w - x.shape[1]))) for x in sources]
            sources.append(jnp.pad(h_tokens, ((0, 0), (0, w - h_tokens.shape[1]))))
            lo.append(h_starts)
            hi.append(h_lens)
        sources, lo, hi = jnp.concatenate(sources), jnp.concatenate(lo), jnp.concatenate(hi)
        m, w = sources.shape
        sizes = jax.vmap(lambda src, a, z: match_sizes(src, a, z, row, n, self.max_n, self.min_n))(sources, lo, hi)
        best = jnp.max(sizes)
        flat = sizes.reshape(-1)
        order = m * w - 1 - (jnp.arange(m)[:, None] * w + (w - 1 - jnp.arange(w))[None, :]).reshape(-1)
        score = jnp.where((flat == best) & (best > 0), order, -1)
        k = min(MAX_CANDIDATES, m * w)
        top, idx = jax.lax.top_k(score, k)
        found = top >= 0
        src, c = idx // w, idx % w
        d = jnp.arange(self.gamma)[None, :]
        own = src == 0
        period = jnp.maximum(n - c, 1)
        slot = jnp.where(own[:, None], c[:, None] + d % period[:, None], c[:, None] + d)
        conts = sources[src[:, None], jnp.clip(slot, 0, w - 1)]
        ok = found[:, None] & (own[:, None] | (slot < hi[src][:, None]))
        return frequency_tree(conts, ok, self.tree_nodes)

    def propose(self, params, state: HistoryState, context):
        """The frequency tree of every row (module docstring)."""
        tokens, lens = context.tokens, context.seq_lens
        sib = state.siblings
        has = sib >= 0
        sib_c = jnp.maximum(sib, 0)
        sib_tokens = tokens[sib_c]  # [B, K, S]
        sib_lo = state.prompt_lens[sib_c]
        sib_hi = jnp.where(has, lens[sib_c], 0)
        hist = None if params is None else (params.tokens, params.lens, params.starts)
        rows = jax.vmap(self._row, in_axes=(0, 0, 0, 0, 0, None if hist is None else 0))
        out = rows(tokens, lens, sib_tokens, sib_lo, sib_hi, hist)
        return state, Proposal(*out, None)
