"""Drafters behind one protocol (``base.Drafter``): draft model, early exit, n-gram lookup, EAGLE-3 head, Medusa heads."""

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.model import EarlyExitDrafter, ModelDrafter
from jaxspec.drafters.ngram import NGramDrafter

__all__ = ["Drafter", "EagleDrafter", "EarlyExitDrafter", "MedusaDrafter", "ModelDrafter", "NGramDrafter"]
