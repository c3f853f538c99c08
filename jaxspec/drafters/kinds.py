"""The drafter registry: every drafter kind, its options and their defaults, in one place.

``build(kind, target, **options)`` is the one factory: the command line (``jaxspec.cli``),
``benchmarks/spec_bench.py`` (and ``benchmarks/batch_sweep.py``, which runs spec_bench's
methods) and ``colab/quickstart.ipynb`` build their drafters with it, so a benchmark measures
the program the command line runs. Each kind's ``drafter.kind`` is its name here, and
``jaxspec.policy`` keys its measurements on it.

Defaults: an option left out (or None) takes its default from ``OPTIONS``, which reads the
drafter class's own field defaults, so each default is written once, beside its drafter:

- ``model``: a chain stops below cumulative draft probability 0.3
  (``jaxspec.drafters.model.DEFAULT_CONFIDENCE``, measured there); a tree keeps 0. This is
  the library's and the command line's default. ``benchmarks/spec_bench.py`` used to build
  ``draft_*`` methods with 0 unless given ``_c``; it now builds what the command line runs
  (``_c0`` for a chain without the threshold).
- ``early-exit``: ``n_layers`` a quarter of the target's blocks, at least 1 (``early_exit_layers``);
  confidence 0, as EAGLE's (a cheap drafter: every chain drafts ``gamma``).
- ``medusa``: ``topk`` a chain of 4 heads, ``(1, 1, 1, 1)``.

Kinds, their drafter, and what ``target`` must be:

- ``ngram`` (``NGramDrafter``), ``repeat`` (``RepeatDrafter``), ``lookahead``
  (``LookaheadDrafter``), ``grammar`` (``GrammarDrafter``: a call with ``regex=`` or
  ``response_format=``), ``history`` (``HistoryDrafter``: siblings; earlier rollouts through
  ``generate``'s ``drafter_params``): not read (None);
- ``model`` (``ModelDrafter``): not read; the option ``draft`` is the draft ``Model`` (or its
  ``ModelConfig``);
- ``early-exit`` (``EarlyExitDrafter``): the target ``Model`` or its ``ModelConfig``;
- ``eagle`` (``EagleDrafter``) and ``medusa`` (``MedusaDrafter``): the target ``Model``; the
  option ``head`` / ``heads`` is the head directory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.drafters.eagle import EagleDrafter
from jaxspec.drafters.grammar_only import GrammarDrafter
from jaxspec.drafters.history import HistoryDrafter
from jaxspec.drafters.lookahead import LookaheadDrafter
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.model import EarlyExitDrafter, ModelDrafter
from jaxspec.drafters.ngram import NGramDrafter
from jaxspec.drafters.repeat import RepeatDrafter

CLASSES = {"ngram": NGramDrafter, "early-exit": EarlyExitDrafter, "model": ModelDrafter, "eagle": EagleDrafter,
           "medusa": MedusaDrafter, "lookahead": LookaheadDrafter, "repeat": RepeatDrafter, "grammar": GrammarDrafter,
           "history": HistoryDrafter}
KINDS = tuple(CLASSES)  # the command line's --drafter choices, in its order (besides "none")


def _field_defaults(cls, *skip: str) -> dict[str, Any]:
    """``cls``'s dataclass fields (but ``skip``) and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init and f.name not in skip}


def early_exit_layers(target_config: ModelConfig) -> int:
    """Early exit's default depth: a quarter of the target's blocks, at least 1."""
    return max(1, target_config.n_layers // 4)


# kind -> {option: default}; None where the default depends on what ``build`` is given
# (``ModelDrafter``'s confidence: 0.3 for a chain, 0 for a tree) or the option is required
# (``draft``, ``head``, ``heads``).
OPTIONS: dict[str, dict[str, Any]] = {
    "ngram": _field_defaults(NGramDrafter),
    "early-exit": {**_field_defaults(EarlyExitDrafter, "target_config"), "n_layers": None},
    "model": {"draft": None, **_field_defaults(ModelDrafter, "config")},
    "eagle": {"head": None, **_field_defaults(EagleDrafter, "config")},
    "medusa": {"heads": None, **_field_defaults(MedusaDrafter, "config")},
    "lookahead": _field_defaults(LookaheadDrafter),
    "repeat": _field_defaults(RepeatDrafter),
    "grammar": _field_defaults(GrammarDrafter),
    "history": _field_defaults(HistoryDrafter),
}
REQUIRED = {"model": "draft", "eagle": "head", "medusa": "heads"}


def default(kind: str, option: str) -> Any:
    """The default of ``option`` for ``kind`` (``OPTIONS``)."""
    return OPTIONS[kind][option]


def options_of(kind: str, options: dict) -> dict:
    """``options`` over ``kind``'s defaults (an option given as None takes its default).

    Raises:
      ValueError: an unknown kind, an option ``kind`` does not take (naming those it takes),
        or a required option missing.
    """
    if kind not in OPTIONS:
        raise ValueError(f"unknown drafter kind {kind!r}: one of {', '.join(KINDS)}")
    unknown = sorted(set(options) - set(OPTIONS[kind]))
    if unknown:
        raise ValueError(f"the {kind} drafter takes the options {', '.join(OPTIONS[kind])}; got {', '.join(unknown)}")
    merged = {**OPTIONS[kind], **{k: v for k, v in options.items() if v is not None}}
    need = REQUIRED.get(kind)
    if need is not None and merged[need] is None:
        raise ValueError(f"the {kind} drafter needs {need}=")
    return merged


def build(kind: str, target=None, **options) -> tuple[Any, Any]:
    """The drafter of ``kind`` with ``options`` (the rest their defaults, module docstring).

    Args:
      kind: one of ``KINDS``.
      target: the target ``jaxspec.Model`` (a ``ModelConfig`` is enough for ``early-exit``;
        ``ngram``, ``repeat``, ``lookahead`` and ``model`` do not read it: None is fine).
      options: the kind's options (``OPTIONS[kind]``), e.g. ``gamma=4, tree_nodes=8``.

    Returns:
      ``(drafter, drafter_params)`` to pass to ``jaxspec.generate``: the params are None for
      drafters without weights of their own (early exit reads the target's), the draft
      ``Model`` for ``model`` (so ``generate`` checks the pair's tokenizers; None when
      ``draft`` was a bare ``ModelConfig``), the head's params for ``eagle`` and ``medusa``.

    Raises:
      ValueError: an unknown kind or option, a required option missing (``options_of``),
        and whatever the drafter or head loader raises for a setting out of range.
      FileNotFoundError: a head directory that does not exist.
    """
    o = options_of(kind, options)
    if kind in ("ngram", "repeat", "lookahead", "grammar", "history"):
        return CLASSES[kind](**o), None
    if kind == "model":
        draft = o.pop("draft")
        if isinstance(draft, ModelConfig):
            return ModelDrafter(draft, **o), None
        return ModelDrafter(draft.config, **o), draft
    if kind == "early-exit":
        config = target if isinstance(target, ModelConfig) else target.config
        o["n_layers"] = early_exit_layers(config) if o["n_layers"] is None else o["n_layers"]
        return EarlyExitDrafter(config, **o), None
    from jaxspec.checkpoints.heads import load_eagle_head, load_medusa_heads

    if kind == "eagle":
        return load_eagle_head(o.pop("head"), target, **o)
    return load_medusa_heads(o.pop("heads"), target, topk=o["topk"])
