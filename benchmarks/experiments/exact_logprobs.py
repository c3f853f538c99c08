"""Greedy speculative decoding against plain decoding on a real model, to the bit: for each
prompt, dtype and drafter, whether the text is identical and whether every emitted token's
logprob (and its top alternative) is bitwise plain decoding's.

The question behind it: with jaxspec's CPU kernels (products, RoPE, attention; docs/cpu_kernel.md)
a token's logits are the same bits in a 1-token pass and anywhere in a verify window; does that
hold end to end on prompts nobody tuned for, in float32 and bfloat16? Before the attention
kernel, bfloat16 n-gram speculation changed the text of 2 of 12 mixed prompts, and float32
logprobs differed in the last bits on every prompt.

Prompts: the first ``--per-category`` Spec-Bench questions of each category (chat template, first
turn) and the mixed prompts in ``MIXED`` (code, lists, rewrites, arithmetic, prose; written for
this check, none used elsewhere), batch 1 as the command line runs them, ``--max-new-tokens``
each with ``ignore_eos``. Drafters: the n-gram chain (gamma 4) and the n-gram tree (gamma 4,
2 branches), with the batch and acceptance policies off (every step speculates).

Run from the repository root::

    python -m benchmarks.experiments.exact_logprobs [--dtypes float32,bfloat16] [--per-category 1]

Writes ``benchmarks/results/exact_logprobs_<model>_<host>_<date>.json`` (machine, versions, command).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time

from benchmarks.bench_env import command, machine_info, result_stem, versions, write_record
from benchmarks.spec_bench import QUESTIONS, load_questions

MIXED = [
    "Write a Python function that returns the k largest items of a list, with a docstring.",
    "List five rivers of Europe and the countries each one flows through.",
    "Rewrite in the passive voice: The committee approved the new budget on Friday.",
    "What is 17 times 23? Show the steps.",
    "Explain in three sentences why the sky is blue.",
    "Translate to French: The library opens at nine and closes at six.",
    "Give a shell command that counts the lines of every .py file in a folder.",
    "Summarize: The city council met on Monday to discuss the new bus routes. After a long debate, "
    "members agreed to add two lines to the northern districts and to extend evening service.",
    "Write a haiku about a lighthouse in winter.",
    "Fix the bugs: def mean(xs): return sum(xs) / len(x)",
    "Name three differences between a list and a tuple in Python.",
    "Describe the water cycle for a ten-year-old.",
]


def main(argv=None) -> int:
    """Run the comparison (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a jaxspec.load name or path (smollm2-135m)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    ap.add_argument("--questions", default=QUESTIONS, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=1, help="Spec-Bench questions per category (1; 0: none)")
    ap.add_argument("--mixed", type=int, default=len(MIXED), help=f"how many of the mixed prompts ({len(MIXED)})")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (64)")
    ap.add_argument("--out", default=None, help="output JSON path")
    args = ap.parse_args(argv)
    if args.per_category < 0 or not 0 <= args.mixed <= len(MIXED) or args.max_new_tokens < 1:
        ap.error(f"--per-category >= 0, --mixed in [0, {len(MIXED)}], --max-new-tokens >= 1")

    import jax

    import jaxspec
    from jaxspec.kernels import cpu_matmul

    drafters = {"ngram_chain": jaxspec.NGramDrafter(gamma=4),
                "ngram_tree": jaxspec.NGramDrafter(gamma=4, branches=2)}
    questions = load_questions(args.questions, args.per_category) if args.per_category else []
    texts = [(f"spec_bench/{q['category']}/{q['question_id']}", q["text"]) for q in questions]
    texts += [(f"mixed/{i}", t) for i, t in enumerate(MIXED[: args.mixed])]
    started, t_start = _dt.datetime.now(_dt.timezone.utc), time.perf_counter()
    rows, summary = [], {}
    for dtype in [d for d in args.dtypes.split(",") if d]:
        model = jaxspec.load(args.model, dtype=dtype)
        kw = dict(chat=True, max_new_tokens=args.max_new_tokens, ignore_eos=True, logprobs=1,
                  disable_by_batch_size=None, disable_by_acceptance=None)
        for name, text in texts:
            base = jaxspec.generate(model, [text], **kw)
            for kind, drafter in drafters.items():
                spec = jaxspec.generate(model, [text], drafter=drafter, **kw)
                a, b = spec.logprobs[0], base.logprobs[0]
                n = min(len(a), len(b))
                row = {"dtype": dtype, "prompt": name, "drafter": kind,
                       "text_identical": spec.texts == base.texts and spec.tokens == base.tokens,
                       "logprobs_bitwise": a == b and spec.top_logprobs == base.top_logprobs,
                       "logprobs_differing": sum(x != y for x, y in zip(a[:n], b[:n])),
                       "max_abs_logprob_diff": max((abs(x - y) for x, y in zip(a[:n], b[:n])), default=0.0),
                       "first_token_diff": next((i for i, (x, y) in enumerate(zip(spec.tokens[0], base.tokens[0]))
                                                 if x != y), None),
                       "tau": float(spec.metrics.tau), "accepted": int(spec.metrics.accepted.sum())}
                rows.append(row)
                print(f"{dtype} {name} {kind}: text {'same' if row['text_identical'] else 'DIFFERS'}, logprobs "
                      f"{'bitwise' if row['logprobs_bitwise'] else 'differ (%d)' % row['logprobs_differing']}, "
                      f"tau {row['tau']:.2f}", flush=True)
        for kind in drafters:
            mine = [r for r in rows if r["dtype"] == dtype and r["drafter"] == kind]
            summary[f"{dtype}/{kind}"] = {"prompts": len(mine),
                                          "text_identical": sum(r["text_identical"] for r in mine),
                                          "logprobs_bitwise": sum(r["logprobs_bitwise"] for r in mine),
                                          "accepted": sum(r["accepted"] for r in mine)}
    for key, s in summary.items():
        print(f"{key}: text identical {s['text_identical']}/{s['prompts']}, logprobs bitwise "
              f"{s['logprobs_bitwise']}/{s['prompts']}, {s['accepted']} drafts accepted")
    path = args.out or result_stem("exact_logprobs", args.model, started) + ".json"
    write_record({"benchmark": "exact_logprobs", "command": command(argv, __spec__.name),
                  "started_utc": started.isoformat(),
                  "machine": {**machine_info(), "backend": jax.default_backend(),
                              "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "cpu_kernels": cpu_matmul.describe()},
                  "versions": versions(), "settings": vars(args), "summary": summary, "rows": rows,
                  "elapsed_s": time.perf_counter() - t_start}, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
