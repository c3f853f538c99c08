"""Speculative-decoding metrics, per row and for the whole call.

Terms (Leviathan et al. 2023, Sec. 3; Spec-Bench, Xia et al. 2024, Sec. 4.1):

- a *target forward* is one pass of the target: the prefill, which emits the first token,
  and then one *verify step* per loop iteration in which the row was active;
- *drafted* tokens are the valid draft nodes proposed to verification; *accepted* tokens are
  the drafts that verification accepted AND that were emitted: a draft accepted but then cut
  off by a stop id, a stop string or ``max_new_tokens`` is not counted (it is not in the
  output);
- the *acceptance rate* is accepted / drafted; at draft depth i it is the fraction of verify
  steps that emitted an accepted draft at depth i;
- *tau*, the mean accepted length (Spec-Bench's "#Mean Accepted Tokens"), is the number of
  tokens emitted per verify step, bonus/replacement token included: plain decoding has
  tau = 1. The first token, emitted by the prefill, is not counted, as Spec-Bench starts
  counting after the prefill. A row that ended at its first token had no verify step; its tau
  is 1.0 (one token from one target forward, as plain decoding), never NaN.

A call run with synthetic acceptance (``jaxspec.synthetic``: drafts accepted at random,
NOT lossless) says so in every form its metrics take: ``synthetic``, ``synthetic_rates``,
and the ``"synthetic"`` key of ``row`` and ``summary``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Counts are int numpy arrays ``[B]``; rates float64; times in seconds.

    Attributes:
      prompt_tokens, new_tokens: tokens per row, in and out (stop token included).
      target_forwards: verify passes per row plus one prefill.
      drafted, accepted: draft tokens proposed / accepted and emitted per row.
      accepted_at: int ``[B, gamma]``, verify steps that emitted an accepted draft at depth
        i + 1.
      gamma: draft window; compile_s: compile time of this call (0 when cached);
      run_s: time of the compiled program including the one transfer of its results.
      compiled: True when this call compiled a program: its ``Program`` (drafter, buckets,
        settings that are static) or its inputs' shapes and dtypes were new. New params of
        the same shapes and dtypes (a training step) reuse the compiled program, so a
        training loop can assert ``not compiled`` after its first call.
      host_s: host time of the call outside the compiled program and the compile: checks,
        tokenization, the request's arrays, the result (the CPU layout of new params is
        dispatched asynchronously: its time shows in ``run_s``).
      history_misses: with a ``jaxspec.RolloutHistory`` as ``drafter_params``, the rows whose
        prompt had no earlier rollout (they draft from their own text and siblings), counted
        also when the batch policy decoded the call plainly; None without a history.
      synthetic: True when drafts were accepted at random (``jaxspec.synthetic``): tau and
        acceptance rates are then the chosen ones, not the drafter's, and the tokens are not
        the model's output. synthetic_rates: the conditional rates per position, or ().
      speculation: None when the call ran with the drafter it was given; else the sentence
        saying why the batch-aware policy (``jaxspec.policy``) decoded plainly instead.
      gate_tau: the acceptance gate's threshold (``jaxspec.policy``), or None (no gate).
      gated: bool ``[B]``: rows whose tau over their last ``policy.GATE_WINDOW`` verify steps
        fell below ``gate_tau``, so that they decoded plainly from then on (their drafted and
        accepted counts stop growing there).
    """

    prompt_tokens: np.ndarray
    new_tokens: np.ndarray
    target_forwards: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    accepted_at: np.ndarray
    gamma: int
    compile_s: float
    run_s: float
    compiled: bool = False
    host_s: float = 0.0
    history_misses: int | None = None
    synthetic: bool = False
    synthetic_rates: tuple[float, ...] = ()
    speculation: str | None = None
    gate_tau: float | None = None
    gated: np.ndarray | None = None

    @property
    def verify_steps(self) -> np.ndarray:
        """Verify passes per row (target forwards without the prefill)."""
        return self.target_forwards - 1

    @property
    def tau(self) -> float:
        """Mean accepted length over the batch: tokens emitted by verify steps / verify steps
        (1.0 when no row reached a verify step)."""
        return _tau(int((self.new_tokens - 1).clip(0).sum()), int(self.verify_steps.sum()))

    @property
    def acceptance_rate(self) -> float:
        """Accepted (emitted) / drafted draft tokens over the batch; nan when nothing was drafted
        (plain decoding, or a drafter that abstained at every step)."""
        drafted = int(self.drafted.sum())
        return float(self.accepted.sum() / drafted) if drafted else float("nan")

    @property
    def acceptance_rate_per_position(self) -> np.ndarray:
        """float64 ``[gamma]``: fraction of verify steps that emitted an accepted draft at depth
        i + 1 (0 without a verify step)."""
        steps = int(self.verify_steps.sum())
        return self.accepted_at.sum(axis=0) / max(steps, 1)

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the batch per second of ``run_s``."""
        return float(self.new_tokens.sum() / self.run_s) if self.run_s > 0 else float("nan")

    def row(self, b: int) -> dict:
        """Metrics of row ``b`` as a JSON-ready dict."""
        steps = int(self.verify_steps[b])
        return {
            "prompt_tokens": int(self.prompt_tokens[b]),
            "new_tokens": int(self.new_tokens[b]),
            "target_forwards": int(self.target_forwards[b]),
            "drafted": int(self.drafted[b]),
            "accepted": int(self.accepted[b]),
            "acceptance_rate": float(self.accepted[b] / self.drafted[b]) if self.drafted[b] else None,
            "acceptance_rate_per_position": [float(x) / max(steps, 1) for x in self.accepted_at[b]],
            "tau": _tau(max(int(self.new_tokens[b]) - 1, 0), steps),
            "gated": bool(self.gated[b]) if self.gated is not None else False,
            "synthetic": self.synthetic,
        }

    def summary(self) -> dict:
        """Batch totals as a JSON-ready dict."""
        return {
            "batch": int(self.new_tokens.shape[0]),
            "gamma": self.gamma,
            "new_tokens": int(self.new_tokens.sum()),
            "target_forwards": int(self.target_forwards.sum()),
            "drafted": int(self.drafted.sum()),
            "accepted": int(self.accepted.sum()),
            "acceptance_rate": _nan_none(self.acceptance_rate),
            "acceptance_rate_per_position": [float(x) for x in self.acceptance_rate_per_position],
            "tau": _nan_none(self.tau),
            "compile_s": self.compile_s,
            "compiled": self.compiled,
            "run_s": self.run_s,
            "host_s": self.host_s,
            "history_misses": self.history_misses,
            "tokens_per_s": _nan_none(self.tokens_per_s),
            "synthetic": self.synthetic,
            "synthetic_acceptance_rates": list(self.synthetic_rates) if self.synthetic else None,
            "speculation_off": self.speculation,
            "gate_tau": self.gate_tau,
            "rows_gated": int(self.gated.sum()) if self.gated is not None else 0,
        }


def _tau(emitted: int, steps: int) -> float:
    """Tokens per verify step; 1.0 without a verify step (the prefill's one token per forward)."""
    return emitted / steps if steps else 1.0


def _nan_none(x: float) -> float | None:
    """JSON has no NaN: None stands for an undefined rate."""
    return None if x != x else x
