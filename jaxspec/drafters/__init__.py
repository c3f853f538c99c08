"""Drafters behind one protocol (``base.Drafter``): draft model, early exit, n-gram lookup,
lookahead, rollout history (``HistoryDrafter``), a lookup drafter with a draft model where it finds nothing (``HybridDrafter``), EAGLE-3 head, Medusa heads, the tokens a grammar forces (``GrammarDrafter``), and the zero-cost ``RepeatDrafter`` (draft tokens for
synthetic acceptance)."""

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.grammar_only import GrammarDrafter
from jaxspec.drafters.history import HistoryDrafter
from jaxspec.drafters.hybrid import HybridDrafter
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.model import EarlyExitDrafter, ModelDrafter
from jaxspec.drafters.lookahead import LookaheadDrafter
from jaxspec.drafters.ngram import NGramDrafter
from jaxspec.drafters.repeat import RepeatDrafter

__all__ = ["Drafter", "EagleDrafter", "EarlyExitDrafter", "GrammarDrafter", "HistoryDrafter", "HybridDrafter", "LookaheadDrafter", "MedusaDrafter", "ModelDrafter", "NGramDrafter",
           "RepeatDrafter"]
