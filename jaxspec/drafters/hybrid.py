"""A weightless drafter where it finds something to draft, a draft model where it does not.

Lookup drafters (rollout history, prompt lookup) draft long, cheap and well where the text
repeats what they have seen, and nothing elsewhere; a draft model drafts everywhere, at the
cost of its forwards. ``HybridDrafter`` takes each row's proposal from ``first`` where that
proposes any node, and from ``fallback``, a draft model, where ``first`` abstains: the
hybrid of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975, Sec. 4.3: suffix
speculation where its tree scores, a model drafter elsewhere), and of DAS's rollouts with a
draft model (Shao et al. 2025, arXiv 2511.13841).

The draft model has to read every token the text gained, drafted by it or not: a step that
``first`` drafted emits up to ``first.gamma + 1`` tokens the draft model never saw. The
hybrid keeps, per row, how many positions the draft model's cache holds (``fed``). A step
in which every active row takes ``first``'s proposal runs no draft model at all (a loop of
0 trips: a ``lax.cond`` would make XLA copy the draft cache each step);
a step in which some row needs the draft model first reads everything since ``fed``, in
forwards of ``gamma + 1`` tokens ending at the root (``ModelDrafter.read``, as many as the
furthest-behind row needs), then drafts. A model step counts only the root as read: the
drafts it fed and the target kept are read again at the next model step (in the same
forwards), so the draft model's own ``commit`` is not needed.

Lossless at any temperature: which drafter a row takes is a function of its committed text,
and each drafter's nodes carry what acceptance needs (q for a draft model's sampled chains;
a deterministic node is the one-hot q of its token, ``jaxspec.acceptance``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec import grammar
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Capabilities
from jaxspec.drafters.model import DraftState, _DraftModel
from jaxspec.models import layout
from jaxspec.tree import Proposal


def _pad(proposal: Proposal, n: int) -> Proposal:
    """``proposal`` with invalid nodes appended up to ``n`` (its valid nodes stay first)."""
    k = n - proposal.n_nodes
    if not k:
        return proposal
    pad = lambda x, v=0: jnp.pad(x, ((0, 0), (0, k)) + ((0, 0),) * (x.ndim - 2), constant_values=v)  # noqa: E731
    return Proposal(pad(proposal.tokens), pad(proposal.parents, -1), pad(proposal.valid, False),
                    None if proposal.q is None else pad(proposal.q))


def _q(proposal: Proposal, vocab: int) -> jax.Array:
    """The proposal's q ``[B, N, V]``: its own, or the one-hot of each node's token."""
    return jax.nn.one_hot(proposal.tokens, vocab, dtype=jnp.float32) if proposal.q is None else proposal.q


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridState:
    """A hybrid's state: ``first``'s, the draft model's (``DraftState``), and ``fed`` int32
    ``[B]``, the positions ``0 .. fed - 1`` the draft model's cache holds for each row."""

    first: Any
    fallback: DraftState
    fed: jax.Array


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """``first``'s proposal in the rows where it proposes a node, ``fallback``'s elsewhere.

    Attributes:
      first: a drafter that abstains (``capabilities.abstains``) and reads no layer of the
        target: ``HistoryDrafter`` or ``NGramDrafter``.
      fallback: a ``ModelDrafter`` or ``EarlyExitDrafter``, chain or tree.

    ``gamma`` and ``n_nodes`` are the larger of the two drafters'. Params: the pair
    ``(first's params, fallback's params)`` given as ``drafter_params``, e.g.
    ``(jaxspec.RolloutHistory(...), draft.params)`` or ``(None, draft)`` (a draft ``Model``
    is checked against the target as for ``ModelDrafter``). Verified at the widths of either
    drafter's proposals (``first``'s widths, ``fallback.gamma`` and ``fallback.n_nodes``);
    a confident chain of the fallback that stops early is verified at ``fallback.gamma``.
    Under a grammar, when either drafter carries q, ``first``'s nodes take the grammar's
    forced tokens in their tokenizer spelling (``jaxspec.grammar.constrain``).

    Raises:
      ValueError: at construction, a ``first`` that never abstains or reads the target's
        layers, or a ``fallback`` that is not a draft model; at ``validate``, params that are
        not a pair, or either part's own errors.
    """

    first: Any
    fallback: Any
    kind = "hybrid"  # class attribute, not a field: the registry's and the policy's name

    def __post_init__(self):
        caps = getattr(self.first, "capabilities", None)
        if (caps is None or not caps.abstains or caps.capture or isinstance(self.first, _DraftModel)
                or getattr(self.first, "kind", None) == "grammar"):  # GrammarDrafter proposes nothing itself
            raise ValueError(f"HybridDrafter's first drafter must propose where it finds a match, abstain elsewhere "
                             f"and read no layer of the target (HistoryDrafter, NGramDrafter), got "
                             f"{self.first!r:.120}")
        if not isinstance(self.fallback, _DraftModel):
            raise ValueError(f"HybridDrafter's fallback must be a ModelDrafter or EarlyExitDrafter, got "
                             f"{self.fallback!r:.120}")

    @property
    def gamma(self) -> int:
        """The deeper of the two drafters' gamma."""
        return max(self.first.gamma, self.fallback.gamma)

    @property
    def n_nodes(self) -> int:
        """N: the larger node budget of the two."""
        return max(self.first.n_nodes, self.fallback.n_nodes)

    @property
    def capabilities(self) -> Capabilities:
        """Abstains (``first`` may, and the fallback's confident chains may stop); verified at
        either drafter's widths."""
        f = self.first
        widths = {f.gamma, f.n_nodes, *f.capabilities.verify_widths, self.fallback.gamma, self.fallback.n_nodes}
        return Capabilities(abstains=True, shares_target_weights=self.fallback.capabilities.shares_target_weights,
                            verify_widths=tuple(sorted(w for w in widths if w < self.n_nodes)))

    def localized(self, model_shards: int) -> HybridDrafter:
        """The hybrid as each of ``model_shards`` shards runs it: its fallback localized
        (``ModelDrafter.localized``; ``first`` has no weights to split).

        Raises:
          ValueError: ``model_shards`` does not divide the draft model's heads, MLP width or vocabulary.
        """
        return dataclasses.replace(self, fallback=self.fallback.localized(model_shards))

    def select_params(self, target_params, drafter_params):
        """``(first's, fallback's)``, each as its drafter selects them."""
        p0, p1 = drafter_params
        return (self.first.select_params(target_params, p0), self.fallback.select_params(target_params, p1))

    def laid_out(self, drafter_params):
        """The pair with the draft model's matrices laid out for the CPU kernel
        (``jaxspec.models.layout.for_run``), as ``generate`` lays out a ``ModelDrafter``'s
        params when it runs without a mesh."""
        p0, p1 = drafter_params
        return (p0, None if p1 is None else layout.for_run(p1, self.fallback.config))

    def validate(self, target_config: ModelConfig, drafter_params) -> None:
        """Raise ``ValueError`` unless the params are a pair that each drafter takes."""
        if not isinstance(drafter_params, tuple) or len(drafter_params) != 2:
            raise ValueError("HybridDrafter's drafter_params must be the pair (first's params, fallback's params), "
                             f"e.g. (None, draft.params); got a {type(drafter_params).__name__}")
        for i, (part, params) in enumerate(zip((self.first, self.fallback), drafter_params)):
            try:
                part.validate(target_config, params)
            except ValueError as e:
                raise ValueError(f"HybridDrafter's drafter_params[{i}] ({type(part).__name__}'s): {e}") from None

    def init(self, params, prefill, max_len) -> HybridState:
        """Both drafters' states; the draft model has read the prompt."""
        return HybridState(self.first.init(params[0], prefill, max_len),
                           self.fallback.init(params[1], prefill, max_len), prefill.prompt_lens)

    def _catch_up(self, params, cache, context, fed):
        """``(logits [B, V] after the root, cache)`` once the draft model has read positions
        ``fed .. seq_len - 1`` of every row, in forwards of ``gamma + 1`` tokens ending at the root."""
        # As wide as the deeper drafter's step: a small draft model's forward is bound by its
        # weights on a CPU, so fewer, wider windows cost less than more narrow ones
        # (fallback.gamma + 1 = 5 instead of 7 took the Qwen 1.5B/0.5B rollouts from 1.29x to 1.11x
        # plain in the first epoch, and 1.45x to 1.41x in the second, with the same tokens).
        width = self.gamma + 1
        chunks = (jnp.max(context.seq_lens - fed) + width - 1) // width  # >= 1: the root is never fed

        def body(carry):
            j, cache, _ = carry  # chunk j ends j * width tokens before the root
            logits, cache = self.fallback.read(params, cache, context, newest=width, before=(j - 1) * width)
            return j - 1, cache, logits

        init = (chunks, cache, jnp.zeros((fed.shape[0], self.fallback.config.vocab_size), jnp.float32))
        _, cache, logits = jax.lax.while_loop(lambda c: c[0] > 0, body, init)
        return logits, cache

    def propose(self, params, state: HybridState, context):
        """Each row's proposal: ``first``'s where it has a valid node, else the fallback's,
        drafted after the draft model caught up (module docstring)."""
        p0, p1 = params
        s0, mine = self.first.propose(p0, state.first, context)
        model = self.fallback
        use_first = jnp.any(mine.valid, axis=1)

        def draft(carry):
            _, cache, _, _ = carry
            logits, cache = self._catch_up(p1, cache, context, state.fed)
            s1, proposal = model.draft(p1, cache, logits, context)
            return jnp.bool_(False), s1.cache, context.seq_lens, proposal

        # The draft model runs only where some active row needs it: a loop of 0 or 1 trips,
        # not a lax.cond, in which XLA (jaxlib 0.10.2) copies a cache it updates (jaxspec.cache).
        covered = use_first if context.active is None else use_first | ~context.active
        nothing = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                         jax.eval_shape(draft, (True, state.fallback.cache, state.fed, None))[3])
        _, cache, fed, theirs = jax.lax.while_loop(lambda c: c[0], draft,
                                                   (~jnp.all(covered), state.fallback.cache, state.fed, nothing))
        n = self.n_nodes
        mine, theirs = _pad(mine, n), _pad(theirs, n)
        if mine.q is None and theirs.q is None:
            q = None
        else:
            if context.grammar is not None and mine.q is None:  # the engine constrains only proposals without q
                mine = grammar.constrain(context.grammar, context.grammar_state, mine)
            vocab = (theirs.q if theirs.q is not None else mine.q).shape[-1]
            q = jnp.where(use_first[:, None, None], _q(mine, vocab), _q(theirs, vocab))
        pick = lambda a, b: jnp.where(use_first[:, None], a, b)  # noqa: E731
        proposal = Proposal(pick(mine.tokens, theirs.tokens), pick(mine.parents, theirs.parents),
                            pick(mine.valid, theirs.valid), q)
        return HybridState(s0, dataclasses.replace(state.fallback, cache=cache), fed), proposal

    def commit(self, params, state: HybridState, committed):
        """``first``'s commit; the draft model reads what was kept when it next drafts."""
        return dataclasses.replace(state, first=self.first.commit(params[0], state.first, committed))
