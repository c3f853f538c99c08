"""Earlier rollouts of each prompt, kept for ``HistoryDrafter`` across the steps of an RL loop.

``RolloutHistory`` is an immutable value: ``generate(..., drafter=HistoryDrafter(),
drafter_params=history)`` drafts from it and returns the history with the call's rollouts
added (``GenerationResult.history``), as an optimizer returns its new state. Per prompt (its
token ids) it keeps the newest ``capacity`` rollouts, each as the prompt's last
``PROMPT_TAIL`` tokens (so a match can span the end of the prompt) followed by the output,
cut to ``max_tokens`` tokens in all; the oldest rollouts are evicted first. A call's own rows
are never evicted by each other: a call with more samples of one prompt than ``capacity``
is refused (the siblings of a batch are looked up live, not through the history).

The drafter reads the history as one array per call, each row's prompt's rollouts gathered
(``rows``): ``HistoryRows`` of ``[batch, capacity, max_tokens]``; a different capacity or
``max_tokens`` is another shape, so another compiled program.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxspec.drafters.history import HistoryRows
from jaxspec.drafters.ngram import MAX_NGRAM

PROMPT_TAIL = MAX_NGRAM  # prompt tokens kept before each output: the longest n-gram matched
MAX_CAPACITY = 256


@dataclasses.dataclass(frozen=True)
class RolloutHistory:
    """Earlier rollouts per prompt (module docstring).

    Attributes:
      vocab_size: the vocabulary the token ids belong to (checked against the target).
      capacity: rollouts kept per prompt, in [1, 256].
      max_tokens: tokens kept per rollout (prompt tail + output), in [PROMPT_TAIL + 1, 2**16].
      entries: prompt token ids -> rollouts, newest first, each int32 ``[<= max_tokens]``,
        and where its output starts.

    Raises:
      ValueError: at construction, a field out of range.
    """

    vocab_size: int
    capacity: int = 16
    max_tokens: int = 512
    entries: Mapping[tuple[int, ...], tuple[tuple[np.ndarray, int], ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name, value, low, high in (("vocab_size", self.vocab_size, 1, None),
                                       ("capacity", self.capacity, 1, MAX_CAPACITY),
                                       ("max_tokens", self.max_tokens, PROMPT_TAIL + 1, 1 << 16)):
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low
            if not ok or (high is not None and value > high):
                limit = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"RolloutHistory {name} must be an integer {limit}, got {value!r}")

    def __len__(self) -> int:
        """Rollouts held, over all prompts."""
        return sum(len(v) for v in self.entries.values())

    def rollouts(self, prompt: Sequence[int]) -> list[list[int]]:
        """The outputs held for ``prompt`` (token ids), newest first (cut to ``max_tokens``)."""
        return [r[start:].tolist() for r, start in self.entries.get(_key(prompt), ())]

    def add(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> "RolloutHistory":
        """The history with one rollout per row added: ``outputs[i]`` sampled after
        ``prompts[i]`` (token ids); per prompt, the newest ``capacity`` are kept.

        Raises:
          ValueError: rows and outputs of different counts, a token id outside the
            vocabulary, or more rollouts of one prompt in this call than ``capacity``
            (``check_rows``).
        """
        if len(prompts) != len(outputs):
            raise ValueError(f"add() takes one output per prompt row, got {len(prompts)} prompts and "
                             f"{len(outputs)} outputs")
        self.check_rows(prompts)
        new: dict[tuple[int, ...], list] = {}
        for p, out in zip(prompts, outputs):
            key = _key(p)
            ids = np.asarray(list(out), np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise ValueError(f"a rollout holds token id {int(ids.max() if ids.max() >= self.vocab_size else ids.min())} "
                                 f"outside the vocabulary [0, {self.vocab_size})")
            tail = np.asarray(key[-PROMPT_TAIL:], np.int64)
            text = np.concatenate([tail, ids])[: self.max_tokens].astype(np.int32)
            new.setdefault(key, []).append((text, len(tail)))
        entries = dict(self.entries)
        for key, rows in new.items():
            entries[key] = (tuple(reversed(rows)) + tuple(entries.get(key, ())))[: self.capacity]
        return dataclasses.replace(self, entries=entries)

    def check_rows(self, prompts: Sequence[Sequence[int]]) -> None:
        """Raise ``ValueError`` when more rows than ``capacity`` sample one prompt: adding their
        rollouts would evict some of them (``generate`` checks before it runs)."""
        counts = collections.Counter(_key(p) for p in prompts)
        most = max(counts.values(), default=0)
        if most > self.capacity:
            raise ValueError(f"this call samples {most} rollouts of one prompt but the history keeps "
                             f"capacity={self.capacity} per prompt: raise capacity to at least {most}")

    def misses(self, prompts: Sequence[Sequence[int]]) -> int:
        """How many of ``prompts`` (one per row) have no rollout held."""
        return sum(_key(p) not in self.entries for p in prompts)

    def rows(self, prompts: Sequence[Sequence[int]], batch: int) -> HistoryRows:
        """``HistoryRows`` of ``batch`` rows: row i gets its prompt's rollouts, newest first;
        rows past ``len(prompts)`` (a batch's padding) none."""
        tokens = np.zeros((batch, self.capacity, self.max_tokens), np.int32)
        lens = np.zeros((batch, self.capacity), np.int32)
        starts = np.zeros((batch, self.capacity), np.int32)
        for i, p in enumerate(prompts):
            held = self.entries.get(_key(p), ())
            for h, (text, start) in enumerate(held):
                tokens[i, h, : len(text)] = text
                lens[i, h], starts[i, h] = len(text), start
        return HistoryRows(tokens, lens, starts)


def _key(prompt: Sequence[int]) -> tuple[int, ...]:
    """A prompt's token ids as the history's key."""
    return tuple(int(t) for t in prompt)
