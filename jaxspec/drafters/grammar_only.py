"""Grammar-only speculation: the drafts are the tokens a row's grammar forces.

Structured output forces much of its text: a JSON Schema's keys, quotes, colons and commas,
a regex's literals. SGLang's "jump-forward" decoding appends such text without the model
(Zheng et al. 2024, "SGLang", Sec. 4: compressed finite state machines); here the forced
tokens are drafts, and the target verifies them in one pass like any other drafter's, so the
output stays exactly constrained decoding's (the target may still prefer another spelling of
the forced text, which then wins).

``GrammarDrafter`` proposes nothing itself: the engine fills any proposal without q with the
forced tokens (``jaxspec.grammar.constrain``), so every deterministic drafter (n-gram,
lookahead, Medusa, top-k trees) gets them too, and a drafter with q draws them from its
masked q wherever the grammar allows one token.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.drafters.base import Capabilities, StatelessChain
from jaxspec.tree import Proposal


@dataclasses.dataclass(frozen=True)
class GrammarDrafter(StatelessChain):
    """Drafts only what the request's grammar forces (``regex=`` / ``response_format=``):
    up to ``gamma`` tokens a step, none where the text is free (a one-token step).

    Attributes:
      gamma: the longest forced run drafted per step (>= 1).

    Raises:
      ValueError: at construction, for gamma < 1; ``jaxspec.generate`` without a grammar.
    """

    gamma: int = 8
    kind = "grammar"

    @property
    def capabilities(self) -> Capabilities:
        """Abstains; verified at the narrowest of the widths 1, 2, 4, .. below gamma (and
        gamma) that holds the longest forced run of the batch: forced runs are mostly short,
        and each width is a branch of the compiled step (a branch per width 1 .. gamma
        doubled the compile time of gamma 8)."""
        return Capabilities(abstains=True, verify_widths=tuple(w for w in (1, 2, 4, 8, 16, 32) if w < self.gamma))

    def propose(self, params, state, context):
        """``(None, an empty chain of gamma invalid nodes)``: the engine's grammar step fills it."""
        b = context.seq_lens.shape[0]
        return state, Proposal.chain(jnp.zeros((b, self.gamma), jnp.int32), valid=jnp.zeros((b, self.gamma), bool))
