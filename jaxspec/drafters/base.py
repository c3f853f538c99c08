"""The drafter protocol: what the engine asks of every way of proposing draft trees.

A drafter is a frozen, hashable object (a static argument of the compiled program); its
weights, if any, travel separately as a params pytree so they are traced, not baked in. The
engine owns the token buffer, the target and its cache; drafters know nothing of its loop:

- ``init(params, prefill, max_len)`` builds the drafter's state once the target has read the
  prompt; ``prefill`` (``Prefill``) holds the prompt and the target's outputs of the layers
  the drafter asked for (``Capabilities.capture``);
- ``propose(params, state, context)`` returns a ``jaxspec.tree.Proposal`` (a tree of at most
  ``n_nodes`` nodes, a chain being the special case) from the text so far (``Context``);
- ``commit(params, state, committed)`` receives what verification kept (``Committed``): the
  accepted path's window indices, the emitted tokens and the target's hidden states along
  the path (what EAGLE and Medusa heads feed on), after the engine advanced ``seq_lens``;
  and the target's most probable next token after EVERY window entry, accepted or not (what
  Jacobi / lookahead decoding feeds on).

What a drafter can do is declared, not guessed: ``capabilities`` (``Capabilities``).

Token buffer conventions: ``tokens`` int32 ``[B, S]`` holds prompt then generated tokens at
their absolute positions; slots at and past ``seq_lens[b]`` are stale. ``seq_lens`` int32
``[B]``; the last token, ``tokens[b, seq_lens[b] - 1]``, is the root of the next tree and is
not yet in any cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from jaxspec.config import ModelConfig
from jaxspec.sampling import History, SamplingParams
from jaxspec.tree import Proposal


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a drafter declares about itself (read by the engine and ``jaxspec.sharding``).

    Attributes:
      abstains: ``propose`` may leave nodes invalid (nothing to propose there), packing its
        valid nodes first; the engine then verifies only the shortest of the widths 0,
        ``gamma``, ``verify_widths`` and N nodes that holds every active row's valid nodes
        (no draft: a one-token step).
      shares_target_weights: the drafter's params are a view of the target's (early exit), so
        under a mesh it runs on the target's shards.
      capture: target layer ids whose outputs ``init`` and ``commit`` receive (empty: none).
      verify_widths: for an abstaining drafter, further node counts its proposals pack into
        (each a branch of the compiled step: the n-gram drafter's adaptive depths).

    Whether nodes carry q is not a flag: it is whether ``Proposal.q`` is None.
    """

    abstains: bool = False
    shares_target_weights: bool = False
    capture: tuple[int, ...] = ()
    verify_widths: tuple[int, ...] = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
    """What the drafter sees after the target read the prompt.

    Attributes:
      prompt: int32 ``[B, P]``, right-padded; prompt_lens: int32 ``[B]``.
      captured: tuple of ``[B, P, D]``, the target's outputs of ``Capabilities.capture``'s
        layers over the prompt (``jaxspec.models.ForwardOutput.captured``).
      hidden: ``[B, P, D]``, the target's final hidden states over the prompt.
    """

    prompt: jax.Array
    prompt_lens: jax.Array
    captured: tuple
    hidden: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Context:
    """The text so far, as ``propose`` sees it.

    Attributes:
      tokens: int32 ``[B, S]``; seq_lens: int32 ``[B]`` (conventions in the module docstring).
      keys: ``[B]`` PRNG keys for this step.
      sampling: per-row ``SamplingParams``; history: ``History`` of the text so far. A drafter
        with q must return the distributions its nodes were drawn from; processing its logits
        like the target's (``processed_probs``) keeps q close to p.
      grammar, grammar_state: the call's structured-output automata
        (``jaxspec.grammar.GrammarTables``) and each row's state after its text (int32
        ``[B]``), or None. A drafter with q draws from q masked like the target's p
        (``draw_chain``); the engine applies the grammar to proposals without q itself
        (``jaxspec.grammar.constrain``).
      active: bool ``[B]``, rows still generating and speculating (the engine discards the
        proposals of the others: done rows, rows the acceptance gate turned off), or None
        (every row).
    """

    tokens: jax.Array
    seq_lens: jax.Array
    keys: jax.Array
    sampling: SamplingParams
    history: History
    grammar: Any = None
    grammar_state: jax.Array | None = None
    active: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Committed:
    """What verification kept, for ``commit`` (W = N + 1 window entries).

    Attributes:
      tokens: int32 ``[B, S]``, the buffer with the emitted tokens written;
      seq_lens: int32 ``[B]``, already advanced;
      n_accepted: int32 ``[B]``, accepted nodes (0 where the row emitted nothing this step);
      path: int32 ``[B, W]``, window indices along the accepted path (``Accepted.path``): the
        root, then the accepted nodes;
      start: int32 ``[B]``, the cache slot of the root (the window's first slot);
      hidden: ``[B, W, D]``, the target's final hidden states along ``path``;
      captured: tuple of ``[B, W, D]`` along ``path``, one per ``Capabilities.capture`` layer;
      argmax: int32 ``[B, W]``, the target's most probable next token (argmax of its raw
        logits, before any sampling setting) after each window entry, in window order: entry
        0 the root, entry k node k - 1, whether the node was valid, accepted or neither. It is
        one Jacobi iteration over the whole window (Santilli et al. 2023; Fu et al. 2024,
        "Lookahead Decoding", Sec. 3.1): what a lookahead branch of invalid nodes, computed in
        the verify forward and never accepted, feeds on (``jaxspec.drafters.lookahead``).
        Where the engine verified fewer entries than W (an abstaining drafter's short step),
        the last verified entry's value is repeated.
    """

    tokens: jax.Array
    seq_lens: jax.Array
    n_accepted: jax.Array
    path: jax.Array
    start: jax.Array
    hidden: jax.Array
    captured: tuple
    argmax: jax.Array


class Drafter(Protocol):
    """Protocol of all drafters.

    ``gamma`` (>= 1) is the deepest a proposal goes, ``n_nodes`` (>= gamma) its static node
    budget N; a chain has ``n_nodes == gamma``.
    """

    gamma: int
    capabilities: Capabilities
    kind: str  # the registry's name of the kind (``jaxspec.drafters.kinds``), what ``jaxspec.policy`` keys on

    @property
    def n_nodes(self) -> int:
        """N, the static number of nodes of every proposal."""

    def localized(self, model_shards: int) -> Drafter:
        """The drafter as each of ``model_shards`` shards runs it when its weights are split
        over a mesh's ``model`` axis (``jaxspec.sharding.plan``: always for a drafter that
        shares the target's weights, else with ``shard_drafter=True``); ``ValueError`` for a
        drafter whose weights are never split (``Unsplit``)."""

    def select_params(self, target_params: Any, drafter_params: Any) -> Any:
        """The params pytree the drafter runs on (its own weights, a view of the target's, or None)."""

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        """Raise ``ValueError`` naming the problem if this drafter cannot serve the target."""

    def init(self, params: Any, prefill: Prefill, max_len: int) -> Any:
        """Drafter state after the prompt, for sequences of at most ``max_len`` cache slots."""

    def propose(self, params: Any, state: Any, context: Context) -> tuple[Any, Proposal]:
        """``(state, Proposal with n_nodes nodes)``."""

    def commit(self, params: Any, state: Any, committed: Committed) -> Any:
        """State after verification kept ``committed``."""


class Unsplit:
    """``localized`` of a drafter whose weights, if any, are never split over a mesh (n-gram,
    repeat, lookahead, EAGLE and Medusa heads): replicated on every device, it runs as it is."""

    def localized(self, model_shards: int) -> Drafter:
        """Raise ``ValueError``: only a model drafter's weights can be split (``shard_drafter``)."""
        raise ValueError(f"shard_drafter=True needs a model drafter, got {type(self).__name__}")


class Stateless(Unsplit):
    """The protocol methods of a drafter with no weights and no state (n-gram lookup, repeat):
    a mixin, so such a drafter writes only ``propose``."""

    def select_params(self, target_params: Any, drafter_params: Any) -> None:
        """None: no weights."""
        return None

    def validate(self, target_config: ModelConfig, drafter_params: Any) -> None:
        """Nothing to check: any target fits."""
        return None

    def init(self, params: Any, prefill: Prefill, max_len: int) -> None:
        """None: no state."""
        return None

    def commit(self, params: Any, state: Any, committed: Committed) -> Any:
        """The state unchanged."""
        return state


class StatelessChain(Stateless):
    """A ``Stateless`` drafter of chains of ``gamma`` nodes (a dataclass field of the
    subclass), checked at construction: ``RepeatDrafter``, ``GrammarDrafter``."""

    def __post_init__(self):
        check_gamma(self.gamma)

    @property
    def n_nodes(self) -> int:
        """N = gamma (a chain)."""
        return self.gamma


def check_gamma(gamma: int) -> None:
    """Raise ``ValueError`` unless ``gamma`` is an int >= 1."""
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 for a drafter, got {gamma!r}")


def check_int(name: str, value, low: int, high: int | None = None, why: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int in ``[low, high]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {limit}{why}, got {value!r}")


def check_confidence(confidence, tree_nodes: int) -> None:
    """Raise ``ValueError`` unless ``confidence`` is a number in ``[0, 1)``, and 0 for a tree
    (``tree_nodes`` > 0: a dynamic tree is already grown by draft confidence within its node
    budget)."""
    ok = isinstance(confidence, (int, float)) and not isinstance(confidence, bool) and 0 <= confidence < 1
    if not ok:
        raise ValueError(f"confidence must be a number in [0, 1) (0: always draft gamma tokens), got {confidence!r}")
    if confidence and tree_nodes:
        raise ValueError(f"confidence applies to chains (tree_nodes=0): a tree is grown by draft confidence within "
                         f"its node budget already; got confidence={confidence} with tree_nodes={tree_nodes}")


def chain_capabilities(gamma: int, confidence: float, **flags) -> Capabilities:
    """A chain drafter's ``Capabilities``: with a confidence threshold (``draw_chain``) its
    chains stop early, so it abstains and is verified at the width its longest active chain
    needs (every width 0 .. ``gamma``, a branch each); ``flags``: the other fields."""
    if confidence:
        return Capabilities(abstains=True, verify_widths=tuple(range(1, gamma)), **flags)
    return Capabilities(**flags)
