"""Synthetic acceptance: drafts accepted at random with chosen rates, to measure the system
apart from the drafter's quality. NOT LOSSLESS: the output is not the target's output.

Speculative speed is ``tau / (cost of a step)``; a drafter's quality sets tau, the system
(target verify pass, drafter, loop) sets the cost. To measure the cost at a chosen tau, with
any drafter and random weights of any model shape (no checkpoint, no trained drafter), the
verify step runs exactly as usual (the target forward over the whole window, so every cost
is real), and only the decision which drafts to keep is replaced by coin flips:

- ``rates = (a_1, ..., a_gamma)`` are *conditional* acceptance rates: draft i is accepted with
  probability ``a_i`` given that drafts 1..i-1 were; the first rejection ends the step. This is
  vLLM's reading of ``synthetic_acceptance_rates`` (``--speculative-config
  '{"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [...]}'``, PR 40662)
  and llama.cpp's ``--spec-synthetic-acceptance-rates``. The expected tokens per verify step
  is ``tau = 1 + sum_i a_1 a_2 ... a_i`` (``expected_tau``).
- ``SyntheticAcceptance.from_tau(tau, gamma)`` picks one constant rate a with
  ``a + a^2 + ... + a^gamma = tau - 1`` (llama.cpp's ``--spec-synthetic-acceptance-length``):
  tau = 1 is a = 0 (nothing accepted, but the whole window is still verified), tau =
  gamma + 1 is a = 1 (everything accepted).
- The emitted tokens are the drafter's nodes along the accepted path, then the target's own
  token after them (sampled from its processed distribution: its argmax under greedy), so
  stop ids, ``max_new_tokens``, penalties and the caches work as in real runs, and rates
  of 0 give exactly plain decoding's tokens (the test that the hook changes nothing else).
- Trees: the path follows each node's first valid child (lowest node index; for a chain, the
  chain); a row accepts at most the depth of that path.
- Every node counts as a draft (``fill``): a drafter that abstains (n-gram without a match)
  or leaves nodes invalid still gets its full window verified, the root's token standing in
  for the missing drafts, so the cost measured is that of ``gamma`` (N) drafts per step. Any
  drafter works; ``jaxspec.drafters.RepeatDrafter`` costs nothing and needs no weights.

The rates travel as a per-row array (``engine.Inputs.synthetic_rates``), so sweeping tau does
not recompile. ``jaxspec.generate`` refuses it unless ``allow_synthetic_acceptance=True``,
warns (``SyntheticAcceptanceWarning``) on every call, and marks its results
(``GenerationResult.synthetic``, ``Metrics.synthetic``, ``Metrics.summary()["synthetic"]``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp

from jaxspec.acceptance import Accepted
from jaxspec.sampling import fold_rows, sample
from jaxspec.tree import Proposal, Tree

BANNER = ("SYNTHETIC ACCEPTANCE: drafts are accepted at random (conditional rates {rates}, expected tau {tau:.2f}); "
          "the output is NOT the model's output. For measuring speed only.")


class SyntheticAcceptanceWarning(UserWarning):
    """Warned by every ``generate`` call that runs with synthetic acceptance."""


@dataclasses.dataclass(frozen=True)
class SyntheticAcceptance:
    """Per-position conditional acceptance rates for benchmarking (NOT lossless).

    Attributes:
      rates: ``gamma`` floats in [0, 1]; ``rates[i]`` is the probability that draft i + 1 is
        accepted given that drafts 1..i were (its length must equal the drafter's ``gamma``).

    Raises:
      ValueError: ``rates`` empty, not numbers, or outside [0, 1] (named, with the limit).
    """

    rates: tuple[float, ...]

    def __post_init__(self):
        rates = self.rates
        if isinstance(rates, (int, float)) or not hasattr(rates, "__len__") or len(rates) == 0:
            raise ValueError(f"synthetic acceptance rates must be a non-empty sequence of numbers in [0, 1] (one per "
                             f"draft position), got {rates!r}")
        try:
            values = tuple(float(r) for r in rates)
        except (TypeError, ValueError):
            raise ValueError(f"synthetic acceptance rates must be numbers in [0, 1], got {rates!r}") from None
        for i, r in enumerate(values):
            if not 0.0 <= r <= 1.0:  # NaN fails too
                raise ValueError(f"synthetic acceptance rate {i + 1} must be in [0, 1], got {r}")
        object.__setattr__(self, "rates", values)  # normalised once at construction, never mutated after

    @classmethod
    def from_tau(cls, tau: float, gamma: int) -> "SyntheticAcceptance":
        """One constant conditional rate a for every position, with expected tokens per verify
        step ``1 + a + a^2 + ... + a^gamma = tau`` (solved by bisection to float precision).

        Args:
          tau: mean accepted length (tokens per verify step, bonus token included), in
            ``[1, gamma + 1]``.
          gamma: draft positions (>= 1), the drafter's ``gamma``.

        Raises:
          ValueError: gamma < 1, or tau outside ``[1, gamma + 1]`` (named, with the limit).
        """
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
            raise ValueError(f"gamma must be an integer >= 1 for synthetic acceptance, got {gamma!r}")
        tau = float(tau)
        if not 1.0 <= tau <= gamma + 1:
            raise ValueError(f"synthetic tau must be in [1, gamma + 1] = [1, {gamma + 1}] for gamma {gamma}, got {tau}")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # expected_tau is increasing in a: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _tau_of((mid,) * gamma) < tau else (lo, mid)
        a = 1.0 if tau == gamma + 1 else 0.0 if tau == 1.0 else (lo + hi) / 2
        return cls((a,) * gamma)

    @property
    def gamma(self) -> int:
        """Draft positions the rates cover."""
        return len(self.rates)

    @property
    def expected_tau(self) -> float:
        """``1 + sum_i a_1 ... a_i``: expected tokens per verify step when nothing cuts a step
        short (stops, ``max_new_tokens``, a tree path shallower than ``gamma``)."""
        return _tau_of(self.rates)

    def banner(self) -> str:
        """The loud one-line notice the CLI prints and ``generate`` warns."""
        return BANNER.format(rates=", ".join(f"{r:.3g}" for r in self.rates), tau=self.expected_tau)

    def row_rates(self, batch: int) -> jax.Array:
        """float32 ``[B, gamma]``: the rates for every row (``engine.Inputs.synthetic_rates``)."""
        return jnp.broadcast_to(jnp.asarray(self.rates, jnp.float32), (batch, self.gamma))


def _tau_of(rates) -> float:
    return 1.0 + sum(math.prod(rates[: i + 1]) for i in range(len(rates)))


def check(synthetic, allow: bool, drafter) -> None:
    """Refuse synthetic acceptance unless explicitly allowed and matched to the drafter.

    Raises:
      ValueError: ``synthetic`` is not a ``SyntheticAcceptance``; ``allow_synthetic_acceptance``
        is not True; no drafter (plain decoding has no drafts to accept); the rates' length
        differs from the drafter's ``gamma``.
    """
    if synthetic is None:
        return
    if not isinstance(synthetic, SyntheticAcceptance):
        raise ValueError(f"synthetic_acceptance must be a jaxspec.SyntheticAcceptance (or None), got "
                         f"{type(synthetic).__name__}")
    if allow is not True:
        raise ValueError("synthetic_acceptance is NOT lossless (drafts are accepted at random, the output is not the "
                         "model's): pass allow_synthetic_acceptance=True to run it, for benchmarks only")
    if drafter is None:
        raise ValueError("synthetic_acceptance needs a drafter to supply draft tokens (e.g. "
                         "jaxspec.drafters.RepeatDrafter(gamma)); got drafter=None")
    if synthetic.gamma != drafter.gamma:
        raise ValueError(f"synthetic_acceptance has {synthetic.gamma} rates but the drafter's gamma is "
                         f"{drafter.gamma}: give one rate per draft position")


def warn(synthetic: SyntheticAcceptance) -> None:
    """Warn (``SyntheticAcceptanceWarning``) that this call's output is synthetic."""
    warnings.warn(synthetic.banner(), SyntheticAcceptanceWarning, stacklevel=3)


def fill(proposal: Proposal, root: jax.Array) -> Proposal:
    """Every node valid, invalid ones holding ``root`` (int32 ``[B]``): the full window is
    verified and counted as drafted, whatever the drafter left out."""
    tokens = jnp.where(proposal.valid, proposal.tokens, root[:, None].astype(proposal.tokens.dtype))
    return Proposal(tokens, proposal.parents, jnp.ones_like(proposal.valid), proposal.q)


def accept(keys: jax.Array, p: jax.Array, tree: Tree, rates: jax.Array) -> Accepted:
    """Synthetic verification: accept drafts at random, then the target's token after them.

    Args:
      keys: ``[B]`` PRNG keys, one per row.
      p: float32 ``[B, W, V]``, the target's processed distribution after each window entry.
      tree: the window's ``Tree``; the path follows each node's first valid child.
      rates: float32 ``[B, gamma]``, conditional acceptance rates per depth.

    Returns:
      ``jaxspec.acceptance.Accepted``: ``n_accepted`` = the number of leading depths whose coin
      came up (u_i < a_i), capped by the path's depth; the drafts along the path, then a
      token sampled from p after the last accepted one.
    """
    b, w, _ = p.shape
    gamma = rates.shape[1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (gamma,)))(fold_rows(keys, 0))
    wanted = jnp.sum(jnp.cumprod(u < rates, axis=1), axis=1, dtype=jnp.int32)  # [B]: depths the coins accept
    rows = jnp.arange(b)

    def visit(node, carry):  # nodes in index order: a node's first child is the first one met
        current, depth, path, emitted = carry
        take = tree.valid[:, node] & (tree.parent[:, node] == current) & (depth < wanted)
        depth = depth + take
        path = jnp.where(take[:, None] & (jnp.arange(w)[None] >= depth[:, None]), node, path)
        emitted = emitted.at[rows, jnp.where(take, depth - 1, w)].set(tree.tokens[:, node], mode="drop")
        return jnp.where(take, node, current), depth, path, emitted

    zeros = jnp.zeros((b,), jnp.int32)
    init = (zeros, zeros, jnp.zeros((b, w), jnp.int32), jnp.zeros((b, w), jnp.int32))
    current, n_accepted, path, emitted = jax.lax.fori_loop(1, w, visit, init) if w > 1 else init
    emitted = emitted.at[rows, n_accepted].set(sample(fold_rows(keys, 1), p[rows, current]))
    return Accepted(n_accepted=n_accepted, path=path, tokens=emitted)


@dataclasses.dataclass(frozen=True)
class Synthetic:
    """BENCHMARKS ONLY, NOT LOSSLESS: the acceptance rule that keeps drafts at random at the
    rows' ``engine.Inputs.synthetic_rates`` (``accept``), a static argument of the compiled
    program (``engine.run_program``'s ``rule``) in place of ``jaxspec.acceptance.EXACT``. Every
    step verifies the full window (``fill``: never a narrower width) and the acceptance gate
    never runs, so the cost measured is the full window's; the forward and commit are the
    exact rule's."""

    narrows = False

    def fill(self, proposal: Proposal, root: jax.Array) -> Proposal:
        """The full window, every step (``fill``)."""
        return fill(proposal, root)

    def accept(self, keys, p, proposal: Proposal, tree: Tree, inputs) -> Accepted:
        """Drafts kept at random at ``inputs.synthetic_rates`` (``accept``)."""
        return accept(keys, p, tree, inputs.synthetic_rates)


SYNTHETIC = Synthetic()

