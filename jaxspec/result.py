"""What a ``generate`` call returns: the compiled program's ``Output`` (one pytree, one
transfer to the host) and the ``GenerationResult`` built from it (``make``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxspec import engine, stopping
from jaxspec.metrics import Metrics


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Output of ``generate``; one entry per sample, prompt-major (prompt i, sample j at
    ``i * n + j``).

    Attributes:
      tokens: generated token ids (a stop token or the token completing a stop string is the
        last one).
      texts: decoded text (special tokens skipped, cut at a stop string), or None without a
        tokenizer.
      finish_reasons: ``"stop"`` (EOS, a stop id or a stop string, or the text is complete
        under the row's grammar and it allows nothing more), ``"length"``, or ``"dead_end"``
        (the row's grammar allows no token and does not accept: ``jaxspec.grammar``).
      stop_reasons: the stop string or stop token id that ended the sample, else None.
      logprobs: when requested, per sample one float per token (natural log).
      top_logprobs: when requested, per sample and token the ``(id, logprob)`` pairs of the
        most probable tokens, most probable first.
      metrics: ``Metrics`` of the call.
      synthetic: True when the call ran with synthetic acceptance (``jaxspec.synthetic``):
        the tokens and texts are then NOT the model's output, only its speed is meaningful.
      history: with a ``jaxspec.RolloutHistory`` as ``drafter_params``, that history with this
        call's rollouts added (``RolloutHistory.add``); else None.
    """

    tokens: list[list[int]]
    texts: list[str] | None
    metrics: Metrics
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    stop_reasons: list = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    synthetic: bool = False
    history: Any = None

    @property
    def text(self) -> str:
        """The text of a single-sample call."""
        if self.texts is None or len(self.texts) != 1:
            raise ValueError("text is defined for a single prompt with a tokenizer; use texts")
        return self.texts[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Output:
    """What the compiled program returns: the final ``engine.LoopState``'s fields of these
    names (device arrays), or, after the one ``jax.device_get``, numpy arrays. B rows, S cache
    slots (the package legend), gamma the deepest draft.

    Attributes:
      tokens: int32 ``[B, S]``: prompt, then generated tokens, up to ``seq_lens``.
      seq_lens, n_steps, n_drafted, n_accepted: int32 ``[B]``.
      accepted_at: int32 ``[B, gamma]``.
      speculating: bool ``[B]``: False where the acceptance gate turned the row's drafts off.
      logprobs: ``engine.Logprobs`` (``[B, S]``, ``[B, S, N]``, ``[B, S, N]``) or None.
    """

    tokens: Any
    seq_lens: Any
    n_steps: Any
    n_drafted: Any
    n_accepted: Any
    accepted_at: Any
    speculating: Any
    logprobs: Any

    @classmethod
    def of(cls, state: engine.LoopState) -> Output:
        """The fields of ``state`` that ``generate`` reports, read by name."""
        return cls(**{f.name: getattr(state, f.name) for f in dataclasses.fields(cls)})

    def rows(self, n: int) -> Output:
        """The first ``n`` rows (padded rows dropped)."""
        return jax.tree_util.tree_map(lambda x: x[:n], self)


def _logprobs(out: Output, lens, seq_lens):
    """``(logprobs, top_logprobs)`` of each row's generated tokens, or ``(None, None)``."""
    if out.logprobs is None:
        return None, None
    lp = out.logprobs
    span = [slice(lens[i], seq_lens[i]) for i in range(len(lens))]
    logprobs = [lp.chosen[i, s].tolist() for i, s in enumerate(span)]
    top = [[list(zip(ids, lps)) for ids, lps in zip(lp.top_ids[i, s].tolist(), lp.top[i, s].tolist())]
           for i, s in enumerate(span)]
    return logprobs, top


def _finish(req, row: int, tokens: list[int], reason) -> str:
    """Row ``row``'s finish reason: ``"stop"`` at a stop id or string, or where its grammar's
    automaton accepts and allows nothing more; ``"dead_end"`` where the automaton allows
    nothing more and does not accept; else ``"length"``."""
    if reason is not None:
        return "stop"
    g = req.grammar
    if g is not None and tokens:
        state = g.run(row, tokens)
        if state >= 0 and not g.live[state]:
            return "stop" if g.final[state] else "dead_end"
    return "length"


def make(out: Output, req, gamma: int, tokenizer, compile_s: float, run_s: float, synthetic_acceptance=None,
         speculation: str | None = None, gate_tau: float | None = None) -> GenerationResult:
    """``GenerationResult`` of the request's rows (``jaxspec.request.Request``) from the
    program's ``Output`` (numpy, padded rows dropped), marked synthetic when
    ``synthetic_acceptance`` ran; ``gamma``: the deepest draft (0 for plain decoding, the
    metrics' per-depth columns); ``speculation``: why the policy decoded plainly, or None;
    ``gate_tau``: the acceptance gate's threshold, or None."""
    lens, seq_lens = req.prompt_lens, out.seq_lens
    tokens = [out.tokens[i, lens[i] : seq_lens[i]].tolist() for i in range(len(req.rows))]
    metrics = Metrics(
        prompt_tokens=lens, new_tokens=seq_lens - lens, target_forwards=out.n_steps + 1, drafted=out.n_drafted,
        accepted=out.n_accepted, accepted_at=out.accepted_at, gamma=gamma, compile_s=compile_s, run_s=run_s,
        synthetic=synthetic_acceptance is not None,
        synthetic_rates=() if synthetic_acceptance is None else synthetic_acceptance.rates,
        speculation=speculation, gate_tau=gate_tau,
        gated=~out.speculating if gate_tau is not None else np.zeros(len(lens), bool),
    )
    ends = [stopping.finish(t, req.stop_ids, tokenizer, req.sampling, req.settings["min_new_tokens"][i])
            for i, t in enumerate(tokens)]
    logprobs, top_logprobs = _logprobs(out, lens, seq_lens)
    return GenerationResult(tokens=tokens, texts=None if tokenizer is None else [text for text, _ in ends],
                            metrics=metrics, finish_reasons=[_finish(req, i, t, r) for i, (t, (_, r)) in
                                                             enumerate(zip(tokens, ends))],
                            stop_reasons=[r for _, r in ends], logprobs=logprobs, top_logprobs=top_logprobs,
                            synthetic=synthetic_acceptance is not None)
