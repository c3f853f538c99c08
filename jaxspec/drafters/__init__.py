"""Drafters behind one protocol (``base.Drafter``): draft model, early exit, n-gram lookup, lookahead."""

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.model import EarlyExitDrafter, ModelDrafter
from jaxspec.drafters.lookahead import LookaheadDrafter
from jaxspec.drafters.ngram import NGramDrafter

__all__ = ["Drafter", "EarlyExitDrafter", "LookaheadDrafter", "ModelDrafter", "NGramDrafter"]
