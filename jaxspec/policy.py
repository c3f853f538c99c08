"""When speculation pays: the batch-aware policy and the acceptance gate ``jaxspec.generate``
applies.

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
- ``"auto"`` (default): ``MEASURED[(backend, drafter kind)]``, the largest batch at which the
  drafter was measured faster than plain decoding on that backend
  (``benchmarks/batch_sweep.py``; the measurements are in ``benchmarks/results/``); a pair
  that was not measured is never disabled;
- an int ``k >= 1``: speculate up to k rows, decode plainly above;
- ``None``: always speculate (what benchmarks of speculation itself need).

Calls with synthetic acceptance (``jaxspec.synthetic``, a benchmark of the system) are never
disabled. Under ``mesh=`` the rows counted are the whole batch's, all data shards together.

The acceptance gate. Even at batch 1 a drafter pays only on text it predicts: a step costs
more than a plain one (the drafter's forwards, a wider verify), so a row whose drafts are
mostly rejected runs slower than plain decoding (the Qwen2.5-Coder pair: 1.24x on code, 0.92x
on mixed questions). Like TensorRT-LLM's acceptance-based speculation-off
(``acceptance_window`` / ``acceptance_length_threshold``, NVIDIA/TensorRT-LLM #12905), each
row tracks its tokens per verify step (tau) over its last ``GATE_WINDOW`` steps; once that
mean falls below ``disable_by_acceptance`` the row decodes plainly for the rest of the call
(its drafts are masked out; once no active row speculates, the program leaves its speculative
loop for a loop of plain steps that never runs the drafter). Off is permanent, as in
TensorRT-LLM: resuming would first need the drafter's own cache to read every token it
skipped (for the 0.5B Qwen draft on this CPU a 9-token forward costs 2.5x a 1-token one,
``benchmarks/results/pass_cost_qwen2.5-coder-0.5b-qwen2.5-coder-1.5b_cpu_2026-12-03.json``,
i.e. ~0.8 of a target step per resume). The gate reads only the row's past, so every step stays lossless: same greedy
tokens, same output distribution. Measured with the thresholds of 2026-12-04 (batch 1, greedy):
Qwen pair 0.92x -> 0.97x median over 15 questions, code unchanged; SmolLM2's Medusa 0.81x ->
0.99x, EAGLE 0.98x -> 0.99x (``benchmarks/results/spec_bench_*-gate_cpu_2026-12-04.md``). On the
CPU kernels of 2026-12-07 (``BREAK_EVEN`` below, measured again), SmolLM2's heads gated at their
new thresholds ran 0.96-1.03x plain, EAGLE chains of 2 ungated 1.04x
(``benchmarks/results/spec_bench_smollm2-135m-gate_cpu_2026-12-07.md``).

``disable_by_acceptance``:
- ``"auto"`` (default): ``BREAK_EVEN[(backend, drafter kind, gamma)]``, the tau below which
  that drafter's chains were measured slower than plain decoding on that backend (a step's
  cost in plain steps); trees, and drafters not measured there, are never gated;
- a number ``t`` in ``(1, gamma + 1]``: gate below tau ``t``;
- ``None``: never gate (what benchmarks of speculation itself need).
"""

from __future__ import annotations

import jax

# (jax backend, drafter kind: ``Drafter.kind``, jaxspec.drafters.kinds) -> the largest batch (rows) at which speculation was
# measured faster than plain decoding; batches above it decode plainly under "auto".
# cpu, ngram (NGramDrafter): SmolLM2-135M on 2 CPU cores, 32 Spec-Bench questions, 64 new tokens,
# greedy: 1.14x at batch 1, 0.98x at 2, 0.98x at 4, 0.90x at 8, 0.95x at 16
# (benchmarks/results/batch_sweep_smollm2-135m_cpu_2026-12-02.json); Qwen2.5-Coder-1.5B, 16
# questions, 32 new tokens: 1.03x at batch 1, 0.95x at 4, 0.80x at 16; 32 other questions: 1.01x
# at 2 (within run-to-run noise, and SmolLM2's 0.98x at 2 says no), 0.84x at 8, 0.78x at 32
# (batch_sweep_qwen2.5-coder-1.5b-b2-8-32_cpu_2026-12-03.json). One entry serves every target, so it is the
# largest batch that pays on both.
# cpu, model (ModelDrafter): Qwen2.5-Coder-1.5B with the 0.5B draft, gamma 4, the same sweep: 0.84x at
# batch 1 on the mixed questions (1.20x on the coding ones, 128 tokens:
# spec_bench_qwen2.5-coder-1.5b-gamma_cpu_2026-12-03.json), 0.92x at 4, 0.75x at 16
# (benchmarks/results/batch_sweep_qwen2.5-coder-1.5b_cpu_2026-12-03.json); 0.96x at 2, 0.79x at 8, 0.78x at
# 32 (batch_sweep_qwen2.5-coder-1.5b-b2-8-32_cpu_2026-12-03.json): it pays at batch 1 on the text it
# suits and at no larger batch.
# cpu, eagle (EagleDrafter) and medusa (MedusaDrafter): the heads that ship for SmolLM2-135M (EAGLE-3 gamma 2,
# Medusa-1 chain of 3), 16 questions of at most 128 prompt tokens, 64 new tokens: EAGLE 0.96x at
# batch 1, 0.91x at 2, 0.92x at 4; Medusa 0.81x, 0.81x, 0.89x
# (benchmarks/results/batch_sweep_smollm2-135m-heads_cpu_2026-12-03.json). Neither pays at any batch
# on this CPU; batch 1 stays speculative (a drafter the caller chose, where it comes closest and
# where EAGLE pays on some categories), batches above it decode plainly.
# cpu, history (HistoryDrafter): Qwen2.5-Coder-0.5B, 2 arithmetic problems x 4 samples at temperature
# 1, 64 new tokens, the second epoch (the history holding the first): 1.58x at batch 1 (tau 2.53),
# 1.11x at 2 (tau 2.61), 0.67x at 4 (tau 2.31); the first epoch: 1.17x, 0.92x, 0.66x
# (benchmarks/results/rollouts_qwen2.5-coder-0.5b-float32-g4-rows{1,2,4}_cpu_2026-12-07.json).
# cpu, hybrid (HybridDrafter): Qwen2.5-Coder-1.5B, the history with the 0.5B draft model, 2 problems x 4
# samples, 96 new tokens, batch 1: 1.29x (first epoch), 1.45x (second)
# (rollouts_qwen2.5-coder-1.5b-float32-g4-rows1-draft-qwen2.5-coder-0.5b_cpu_2026-12-07.json); larger batches
# not measured: the lower of its parts' limits (model 1, history 2).
# A limit is never below 1: "auto" disables only what a larger batch costs.
MEASURED: dict[tuple[str, str], int] = {("cpu", "ngram"): 1, ("cpu", "model"): 1, ("cpu", "eagle"): 1,
                                        ("cpu", "medusa"): 1, ("cpu", "history"): 2, ("cpu", "hybrid"): 1}


# Verify steps a row's tau is averaged over before (and while) the gate may turn it off.
GATE_WINDOW = 8

# (jax backend, drafter kind, gamma) -> break-even tau of that drafter's CHAINS (N ==
# gamma nodes; a tree's step costs more, and none was measured): a row below it over its last
# GATE_WINDOW steps decodes plainly (the cost of one of that drafter's steps in plain steps,
# tau / speedup, from side-by-side runs):
# cpu, model, 4: Qwen2.5-Coder-1.5B with the 0.5B draft, gamma 4, confidence 0.3, batch 1, 13
# Spec-Bench questions, 64 new tokens, gate off, on the CPU kernels of 2026-12-07: a step's cost in
# plain steps (tau / speedup) grows with the drafts kept (tau 1.64 -> 2.14, tau 4.00 -> 3.12); the
# least-squares line through the 13 questions (cost = 0.66 tau + 0.87) crosses tau = cost at 2.52
# (benchmarks/results/spec_bench_qwen2.5-coder-1.5b-pair_cpu_2026-12-07.json; a noisy host: one
# question had tau 3.56 at 0.79x). Before the kernels (2026-12-03) the line through two runs,
# mixed questions and code, crossed at 3.24.
# cpu, eagle, 2 and 4, medusa, 3 and 4: SmolLM2-135M's shipped heads (EAGLE-3, Medusa-1 chains),
# batch 1, 13 Spec-Bench questions, 64 new tokens, gate off, on the CPU kernels of 2026-12-07
# (panels, the attention with its queries in vector lanes): median over the questions of each
# one's tau / speedup: EAGLE g2 1.27 (tau 1.45, 1.08x), Medusa chain of 3 1.26 (tau 1.19,
# 0.93x), EAGLE g4 1.53 (tau 1.49, 0.93x), Medusa chain of 4 1.31 (tau 1.19, 0.90x)
# (benchmarks/results/spec_bench_smollm2-135m-heads_cpu_2026-12-07.json). Measured on
# 2026-12-03, before the kernels, they were 1.55, 1.49, 1.83 and 1.46: a verify window now costs
# less against a 1-token pass, so less acceptance pays.
# n-gram is not gated: where it finds no match it abstains, and that step costs a plain one
# (a threshold the caller gives counts such steps as the one token they emit, as it does for a
# draft model whose confidence stopped every chain: that step did cost a draft forward).
BREAK_EVEN: dict[tuple[str, str, int], float] = {("cpu", "model", 4): 2.52, ("cpu", "eagle", 2): 1.27, ("cpu", "medusa", 3): 1.26,
                                                 ("cpu", "eagle", 4): 1.53, ("cpu", "medusa", 4): 1.31}


def gate(disable_by_acceptance, drafter, backend: str | None = None) -> float | None:
    """The tau below which a row stops speculating (None: never), for ``drafter`` (None: plain).

    Args:
      disable_by_acceptance: ``"auto"``, a number in ``(1, gamma + 1]`` or None (module
        docstring): every verify step emits at least 1 token and at most gamma + 1.
      drafter: the drafter object (its ``kind`` and ``gamma`` name the ``BREAK_EVEN`` entry, which
        applies to chains only: ``n_nodes == gamma``).
      backend: ``jax.default_backend()`` when None.

    Raises:
      ValueError: anything else, named with what is allowed.
    """
    if disable_by_acceptance == "auto":
        if drafter is None or drafter.n_nodes != drafter.gamma:  # plain decoding, or a tree
            return None
        return BREAK_EVEN.get((backend or jax.default_backend(), drafter.kind, drafter.gamma))
    if disable_by_acceptance is None:
        return None
    top = None if drafter is None else drafter.gamma + 1
    ok = isinstance(disable_by_acceptance, (int, float)) and not isinstance(disable_by_acceptance, bool)
    if not ok or not 1 < disable_by_acceptance <= (top or float("inf")):
        raise ValueError(f"disable_by_acceptance must be 'auto', None or a mean accepted length (tau) in "
                         f"(1, {top or 'gamma + 1'}] (every verify step emits at least 1 token and at most gamma + 1"
                         f"{'' if drafter is None else f', gamma {drafter.gamma} here'}), got {disable_by_acceptance!r}")
    return None if drafter is None else float(disable_by_acceptance)


def limit(disable_by_batch_size, drafter, backend: str | None = None) -> int | None:
    """The batch size above which ``generate`` decodes plainly (None: never).

    Args:
      disable_by_batch_size: ``"auto"``, an int >= 1 or None (module docstring).
      drafter: the drafter object (its ``kind`` names the ``MEASURED`` entry).
      backend: ``jax.default_backend()`` when None.

    Raises:
      ValueError: anything else, named with what is allowed.
    """
    if disable_by_batch_size is None:
        return None
    if disable_by_batch_size == "auto":
        return None if drafter is None else MEASURED.get((backend or jax.default_backend(), drafter.kind))
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
    source = "measured for " + f"drafter kind {drafter.kind!r} on {jax.default_backend()}" \
        if disable_by_batch_size == "auto" else "set by the caller"
    return f"plain decoding: {rows} rows > disable_by_batch_size {k} ({source}; pass disable_by_batch_size=None " \
           f"to speculate anyway)"
