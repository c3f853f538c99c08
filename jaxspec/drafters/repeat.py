"""The cheapest drafter: a chain of ``gamma`` copies of the last token.

No weights, no lookup, no state: it exists to supply draft tokens at zero cost, so that
synthetic acceptance (``jaxspec.synthetic``) measures the target's verify pass and the loop
alone, for random weights of any model shape. Under real verification it is an ordinary
lossless drafter (accepted only when the target repeats a token), never a useful one.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.drafters.base import Capabilities, StatelessChain
from jaxspec.tree import Proposal


@dataclasses.dataclass(frozen=True)
class RepeatDrafter(StatelessChain):
    """Proposes the chain ``[t, t, ..., t]`` (``gamma`` nodes) after the last token t.

    Attributes:
      gamma: chain length (>= 1).

    Raises:
      ValueError: at construction, for gamma < 1.
    """

    gamma: int = 4
    capabilities = Capabilities()  # class attributes, not fields: never abstains
    kind = "repeat"

    def propose(self, params, state, context):
        """``(None, Proposal.chain(int32 [B, gamma]))``: the last token, ``gamma`` times."""
        last = jnp.take_along_axis(context.tokens, (context.seq_lens - 1)[:, None], axis=1)
        return state, Proposal.chain(jnp.repeat(last, self.gamma, axis=1))
