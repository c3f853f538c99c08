"""A flax.nnx module as the target model (``jaxspec.models.target``).

    target, params = NnxTarget.split(module, vocab_size=V, max_position=P, name="mine")
    out = jaxspec.generate(params, prompt_ids, config=target, drafter=jaxspec.NGramDrafter(gamma=4))

The module provides the three functions of ``MaskedTarget`` as methods:

* ``__call__(tokens, positions, cache, write_at, mask) -> (hidden, cache)``: write the new
  tokens' keys and values at slots ``write_at[b] ..`` of each row and attend where ``mask``
  (bool ``[B, T, S]``) says (``MaskedTarget.apply``'s contract, without ``params``);
* ``head(hidden) -> logits``;
* ``init_cache(batch, max_len) -> cache``: a pytree whose leaves are all ``[batch, max_len, ...]``.

``split`` separates the module into its static graph (part of the target, hence of the
compiled program's key) and its ``nnx.State`` (the params pytree the program takes as an
argument: new weights of the same shapes reuse the compiled program). flax is imported only
here: ``pip install 'jaxspec[nnx]'``. A worked example: docs/own_model.md and
tests/test_own_model.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from jaxspec.models.target import _MaskedForward


@dataclasses.dataclass(frozen=True)
class NnxTarget(_MaskedForward):
    """A ``TargetModel`` running a flax.nnx module's ``__call__``, ``head`` and ``init_cache``
    on the params it is given (``nnx.merge(graphdef, params)``).

    Attributes:
      graphdef: the module's ``nnx.GraphDef`` (``nnx.split``).
      name, vocab_size, max_position, bos_id, eos_ids (keywords): as in ``jaxspec.models.TargetModel``.
      row_offsets (keyword): as in ``MaskedTarget`` (False: a module that writes every row at
        ``write_at[0]`` runs row by row).
    """

    graphdef: Any

    @classmethod
    def split(cls, module: nnx.Module, **facts) -> tuple[NnxTarget, nnx.State]:
        """``(NnxTarget, params)`` of ``module``; ``facts``: the keyword fields (name, vocab_size, ...)."""
        graphdef, params = nnx.split(module)
        return cls(graphdef, **facts), params

    def apply(self, params, tokens, positions, cache, write_at, mask):
        return nnx.merge(self.graphdef, params)(tokens, positions, cache, write_at, mask)

    def head(self, params, hidden):
        return nnx.merge(self.graphdef, params).head(hidden)

    def make_cache(self, params, batch: int, max_len: int):
        return nnx.merge(self.graphdef, params).init_cache(batch, max_len)
