"""When speculation pays: the batch-aware policy ``jaxspec.generate`` applies.

Speculation trades extra target compute (every row verifies a window of up to N + 1 tokens
per step) for fewer sequential target passes. At batch 1 a pass is bound by reading the
weights and the extra tokens are nearly free; as the batch grows the pass turns
compute-bound, the extra tokens cost their full price, and past some batch size speculation
is slower than plain decoding (users of every peer meet it: sglang #4759, vllm #21278).
Like vLLM's ``speculative_disable_by_batch_size``, ``generate`` then decodes plainly: a call
whose batch has more rows (prompts x ``n``) than ``disable_by_batch_size`` runs without the
drafter, and its metrics say so (``Metrics.speculation``). Plain decoding gives the same
greedy tokens and the same output distribution, so the policy changes speed, never output
(sampled tokens for a given seed differ, as they differ between any two drafters).

``disable_by_batch_size``:
- ``"auto"`` (default): ``MEASURED[(backend, drafter class)]``, the largest batch at which the
  drafter was measured faster than plain decoding on that backend
  (``benchmarks/batch_sweep.py``; the measurements are in ``benchmarks/results/``); a pair
  that was not measured is never disabled;
- an int ``k >= 1``: speculate up to k rows, decode plainly above;
- ``None``: always speculate (what benchmarks of speculation itself need).

Calls with synthetic acceptance (``jaxspec.synthetic``, a benchmark of the system) are never
disabled. Under ``mesh=`` the rows counted are the whole batch's, all data shards together.
"""

from __future__ import annotations

import jax

# (jax backend, drafter class name) -> the largest batch (rows) at which speculation was
# measured faster than plain decoding; batches above it decode plainly under "auto".
# cpu, NGramDrafter: SmolLM2-135M on 2 CPU cores, 32 Spec-Bench questions, 64 new tokens,
# greedy: 1.14x at batch 1, 0.98x at 2, 0.98x at 4, 0.90x at 8, 0.95x at 16
# (benchmarks/results/batch_sweep_smollm2_cpu_2026-12-02.json); Qwen2.5-Coder-1.5B, 16
# questions, 32 new tokens: 1.03x at batch 1, 0.95x at 4, 0.80x at 16; 32 other questions: 1.01x
# at 2 (within run-to-run noise, and SmolLM2's 0.98x at 2 says no), 0.84x at 8, 0.78x at 32
# (batch_sweep_qwen_cpu_2026-12-03_b2_8_32.json). One entry serves every target, so it is the
# largest batch that pays on both.
# cpu, ModelDrafter: Qwen2.5-Coder-1.5B with the 0.5B draft, gamma 4, the same sweep: 0.84x at
# batch 1 on the mixed questions (1.20x on the coding ones, 128 tokens:
# spec_bench_qwen2.5-coder-1.5b_2026-12-03_gamma.json), 0.92x at 4, 0.75x at 16
# (benchmarks/results/batch_sweep_qwen_cpu_2026-12-03.json); 0.96x at 2, 0.79x at 8, 0.78x at
# 32 (..._b2_8_32.json): it pays at batch 1 on the text it suits and at no larger batch.
# cpu, EagleDrafter and MedusaDrafter: the heads that ship for SmolLM2-135M (EAGLE-3 gamma 2,
# Medusa-1 chain of 3), 16 questions of at most 128 prompt tokens, 64 new tokens: EAGLE 0.96x at
# batch 1, 0.91x at 2, 0.92x at 4; Medusa 0.81x, 0.81x, 0.89x
# (benchmarks/results/batch_sweep_smollm2_cpu_2026-12-03_heads.json). Neither pays at any batch
# on this CPU; batch 1 stays speculative (a drafter the caller chose, where it comes closest and
# where EAGLE pays on some categories), batches above it decode plainly.
# A limit is never below 1: "auto" disables only what a larger batch costs.
MEASURED: dict[tuple[str, str], int] = {("cpu", "NGramDrafter"): 1, ("cpu", "ModelDrafter"): 1,
                                        ("cpu", "EagleDrafter"): 1, ("cpu", "MedusaDrafter"): 1}


def limit(disable_by_batch_size, drafter, backend: str | None = None) -> int | None:
    """The batch size above which ``generate`` decodes plainly (None: never).

    Args:
      disable_by_batch_size: ``"auto"``, an int >= 1 or None (module docstring).
      drafter: the drafter object (its class names the ``MEASURED`` entry).
      backend: ``jax.default_backend()`` when None.

    Raises:
      ValueError: anything else, named with what is allowed.
    """
    if disable_by_batch_size is None:
        return None
    if disable_by_batch_size == "auto":
        return MEASURED.get((backend or jax.default_backend(), type(drafter).__name__))
    ok = isinstance(disable_by_batch_size, int) and not isinstance(disable_by_batch_size, bool)
    if not ok or disable_by_batch_size < 1:
        raise ValueError(f"disable_by_batch_size must be 'auto', None or an integer >= 1, got {disable_by_batch_size!r}")
    return disable_by_batch_size


def decide(disable_by_batch_size, drafter, rows: int, synthetic: bool = False) -> str | None:
    """None to speculate, else the sentence that says why this call decodes plainly.

    Raises:
      ValueError: a bad ``disable_by_batch_size`` (``limit``).
    """
    k = limit(disable_by_batch_size, drafter)
    if drafter is None or synthetic or k is None or rows <= k:
        return None
    source = "measured for " + f"{type(drafter).__name__} on {jax.default_backend()}" \
        if disable_by_batch_size == "auto" else "set by the caller"
    return f"plain decoding: {rows} rows > disable_by_batch_size {k} ({source}; pass disable_by_batch_size=None " \
           f"to speculate anyway)"
