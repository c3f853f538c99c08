"""Plain decoding with every target pass padded to at least M tokens
(``jaxspec.engine.MIN_PASS_TOKENS``) against unpadded plain decoding, side by side in one
process, on a real model: tok/s of each and whether the tokens are identical.

The question behind it: on the H200 a 1-token pass of the Llama-3.1-8B shape took longer than a
2-token one (``benchmarks/results/accelerator_summary_nvidia-h200_2026-12-04.md``), so running plain
decoding's pass as a 2-token one (the token and a copy, the copy's outputs dropped) may be
faster there; on a CPU a wider pass costs more. A backend goes into ``MIN_PASS_TOKENS`` only
where this measures faster.

Batch 1, greedy, the first ``--per-category`` Spec-Bench questions of each category (chat
template, first turn), ``--max-new-tokens`` tokens each (``ignore_eos``). Each question runs
every setting in turn (interleaved, so that machine load hits them alike) ``--reps`` times
after one compile-and-warm-up call per setting; per setting the median over questions of each
question's median tokens per second of ``Metrics.run_s`` (the whole call, prefill included,
which pulls the ratio toward 1 on long prompts; compile excluded), and the ratio
to unpadded plain per question (median). Writes JSON with the machine, versions and command.

Run from the repository root::

    python -m benchmarks.experiments.padded_plain [--model smollm2-135m] [--min-pass-tokens 2,3]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import time

from benchmarks.bench_env import (
    command,
    machine_info,
    result_stem,
    versions,
    write_record,
)
from benchmarks.spec_bench import QUESTIONS, load_questions


def main(argv=None) -> int:
    """Run the comparison (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a jaxspec.load name or path (smollm2-135m)")
    ap.add_argument("--min-pass-tokens", default="2", help="comma-separated widths >= 2 to compare with 1 (2)")
    ap.add_argument("--questions", default=QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=1, help="questions per category (1)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per question (64)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per question and setting (3)")
    ap.add_argument("--out", default=None, help="output JSON path")
    args = ap.parse_args(argv)
    widths = [int(m) for m in args.min_pass_tokens.split(",") if m]
    if not widths or any(m < 2 for m in widths):
        ap.error(f"--min-pass-tokens: widths >= 2, got {args.min_pass_tokens!r}")
    if args.reps < 1 or args.per_category < 1 or args.max_new_tokens < 1:
        ap.error("--reps, --per-category and --max-new-tokens must be >= 1")

    import jax

    import jaxspec
    from jaxspec import engine

    model = jaxspec.load(args.model)
    tok = model.tokenizer
    questions = load_questions(args.questions, args.per_category)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["text"]}]) for q in questions]
    settings = [1] + widths
    started, t_start = _dt.datetime.now(_dt.timezone.utc), time.perf_counter()

    def run(m, prompt):
        with engine.min_pass_tokens_set(m):
            out = jaxspec.generate(model, [prompt], max_new_tokens=args.max_new_tokens, ignore_eos=True)
        return out.tokens[0], out.metrics.new_tokens[0] / out.metrics.run_s

    rows = []
    for i, (q, prompt) in enumerate(zip(questions, prompts)):
        tokens, rates = {}, {m: [] for m in settings}
        for m in settings:  # compile (a new prompt bucket) and warm up
            tokens[m] = run(m, prompt)[0]
        for _ in range(args.reps):
            for m in settings:
                t, r = run(m, prompt)
                rates[m].append(r)
                if t != tokens[m]:  # greedy: the same tokens every call
                    raise RuntimeError(f"question {q['question_id']}, min_pass_tokens {m}: the tokens changed "
                                       f"between calls")
        row = {"question_id": q["question_id"], "category": q["category"],
               "tokens_per_s": {str(m): statistics.median(rates[m]) for m in settings},
               "identical_to_unpadded": {str(m): tokens[m] == tokens[1] for m in widths}}
        row["vs_unpadded"] = {str(m): row["tokens_per_s"][str(m)] / row["tokens_per_s"]["1"] for m in widths}
        rows.append(row)
        print(f"[{i + 1}/{len(questions)}] {q['category']}: " + ", ".join(
            f"M={m} {row['tokens_per_s'][str(m)]:.1f} tok/s" for m in settings), flush=True)

    summary = {str(m): {"median_tokens_per_s": statistics.median(r["tokens_per_s"][str(m)] for r in rows)}
               for m in settings}
    for m in widths:
        summary[str(m)]["median_vs_unpadded"] = statistics.median(r["vs_unpadded"][str(m)] for r in rows)
        summary[str(m)]["identical_to_unpadded"] = sum(r["identical_to_unpadded"][str(m)] for r in rows)
    print(f"{len(rows)} questions: " + "; ".join(
        f"M={m}: {s['median_tokens_per_s']:.1f} tok/s" + ("" if m == "1" else (
            f", {s['median_vs_unpadded']:.3f}x unpadded, identical {s['identical_to_unpadded']}/{len(rows)}"))
        for m, s in summary.items()))
    path = args.out or result_stem("padded_plain", args.model, started) + ".json"
    write_record({"benchmark": "padded_plain", "command": command(argv, __spec__.name),
                  "started_utc": started.isoformat(),
                  "machine": {**machine_info(), "backend": jax.default_backend(),
                              "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
                  "versions": versions(), "settings": vars(args), "summary": summary, "rows": rows,
                  "elapsed_s": time.perf_counter() - t_start}, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
