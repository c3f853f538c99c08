"""Speedup of speculation vs batch size: the measurement behind ``jaxspec.policy.MEASURED``.

Every batch size B (``--batch-sizes``, default 1,2,4,8,16,32) runs the SAME ``--questions``
N Spec-Bench questions (default 32, taken round-robin over the categories, so every batch
mixes them), as N / B consecutive batches of B, with every method (``spec_bench.py``'s names:
``plain``, ``ngram_g4``, ``draft_g4``, ...), greedy, ``--max-new-tokens`` each; batches are
interleaved over the methods (the order rotates from batch to batch), compile excluded.
Speculation is measured itself: ``disable_by_batch_size=None``. Reported per (B, method):
total wall seconds over the N questions, tok/s, speedup over plain at the same B (ratio of
the totals), tau, and whether every row equals plain decoding. From it, per method, the policy's limit: the largest B up to which every measured
batch size was faster than plain (None when even batch 1 was not, "all" when every one was).

    python -m benchmarks.batch_sweep --model smollm2-135m --methods plain,ngram_g4
    python -m benchmarks.batch_sweep --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --methods plain,ngram_g4,draft_g4 --batch-sizes 1,4,16 --n-questions 16 --max-new-tokens 32 --max-prompt-tokens 128

Writes ``--out``.json (machine, versions, command, every timing) and .md, and a plot of
speedup vs batch size (.png).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time

from benchmarks import bench_env
from benchmarks.spec_bench import (
    QUESTIONS,
    JaxRunner,
    load_questions,
    parse_method,
    resolve_heads,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def mixed_questions(path: str, n: int, keep=lambda q: True) -> list[dict]:
    """The first ``n`` questions that ``keep`` accepts, taken round-robin over the categories
    (first of each, then second of each, ...)."""
    per = 80  # every question of the file (Spec-Bench: 80 per category)
    by_cat: dict[str, list] = {}
    for q in load_questions(path, per):
        if keep(q):
            by_cat.setdefault(q["category"], []).append(q)
    order = [qs[i] for i in range(per) for qs in by_cat.values() if i < len(qs)]
    if len(order) < n:
        raise SystemExit(f"error: {path} has only {len(order)} questions for a batch of {n}")
    return order[:n]


def policy_limit(speedups: dict[int, float]) -> int | str | None:
    """The largest batch size up to which every measured one was faster than plain."""
    best = None
    for b in sorted(speedups):
        if speedups[b] <= 1.0:
            return best
        best = b
    return "all"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--methods", default="plain,ngram_g4")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-questions", type=int, default=32, help="questions run at every batch size (default 32)")
    ap.add_argument("--questions", default=QUESTIONS)
    ap.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="only questions of at most this many tokens, chat template included (0: all); fewer prompt "
                         "buckets, so fewer compiles on a large target")
    ap.add_argument("--out", default=None, help="output stem (default benchmarks/results/batch_sweep_<model>_<host kind>_<date>)")
    args = ap.parse_args(argv)
    methods = [parse_method(m) for m in args.methods.split(",")]
    if methods[0].kind != "plain":
        ap.error("--methods must start with plain (the baseline)")
    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    started = _dt.datetime.now(_dt.timezone.utc)
    stem = args.out or bench_env.result_stem("batch_sweep", args.model, started)

    import jax

    import jaxspec

    model = jaxspec.load(args.model)
    draft = jaxspec.load(args.draft_model) if args.draft_model else None
    heads = resolve_heads(args.model, methods)  # eagle_* / medusa_*: the heads that ship for --model
    runner = JaxRunner(model, draft, 3, 2, heads["eagle"], heads["medusa"])
    tok = model.tokenizer
    if any(args.n_questions % b for b in sizes):
        ap.error(f"--n-questions ({args.n_questions}) must be a multiple of every batch size {sizes}")

    def encode(q):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": q["text"]}]),
                          add_bos=False)

    questions = mixed_questions(args.questions, args.n_questions,
                                lambda q: not args.max_prompt_tokens or len(encode(q)) <= args.max_prompt_tokens)
    ids = [encode(q) for q in questions]
    results: dict = {}
    t0 = time.perf_counter()
    for b in sizes:
        runs: dict[str, list] = {m.name: [] for m in methods}
        for i in range(0, len(ids), b):
            k = (i // b) % len(methods)
            for m in methods[k:] + methods[:k]:
                runs[m.name].append(runner(m, ids[i : i + b], args.max_new_tokens, 0.0, list(range(i, i + b))))
        plain_s = sum(r.seconds for r in runs["plain"])
        plain_tokens = [t for r in runs["plain"] for t in r.tokens]
        for m in methods:
            rs = runs[m.name]
            sec = sum(r.seconds for r in rs)
            tokens = [t for r in rs for t in r.tokens]
            new = sum(len(t) for t in tokens)
            steps = sum(f - 1 for r in rs for f in r.target_forwards)
            results.setdefault(m.name, {})[b] = {
                "seconds": [r.seconds for r in rs], "total_s": sec, "new_tokens": new, "tokens_per_s": new / sec,
                "speedup_vs_plain": (new / sec) / (sum(len(t) for t in plain_tokens) / plain_s),
                "tau": (new - len(tokens)) / steps if steps else 1.0, "identical_to_plain": tokens == plain_tokens}
        print(f"[{time.perf_counter() - t0:6.0f}s] batch {b}: " + ", ".join(
            f"{n} {results[n][b]['tokens_per_s']:.1f} tok/s ({results[n][b]['speedup_vs_plain']:.2f}x)"
            for n in results), flush=True)
    limits = {m.name: policy_limit({b: results[m.name][b]["speedup_vs_plain"] for b in sizes})
              for m in methods if m.kind != "plain"}
    out = {"benchmark": "batch_sweep", "started_utc": started.isoformat(), "total_wall_s": time.perf_counter() - t0,
           "command": bench_env.command(argv, __spec__.name),
           "machine": bench_env.machine_info(), "versions": bench_env.versions(), "backend": jax.default_backend(),
           "settings": {"model": args.model, "draft_model": args.draft_model, "batch_sizes": sizes,
                        "max_new_tokens": args.max_new_tokens, "n_questions": args.n_questions, "greedy": True,
                        "drafters": {m.name: repr(runner.drafter(m)) for m in methods if m.kind != "plain"},
                        "max_prompt_tokens": args.max_prompt_tokens, "questions": [q["id"] for q in questions]},
           "results": results, "policy_limit": limits,
           "definitions": {"speedup_vs_plain": "tok/s over the N questions / plain's tok/s over the same questions at "
                                               "the same batch size",
                           "policy_limit": "largest batch size up to which every measured one had speedup > 1"}}
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(out, f, indent=1)
    lines = [f"# Speedup vs batch size: {args.model} ({started:%Y-%m-%d})", "", f"`{out['command']}`", "",
             f"{out['machine']['cpu_model']}, {out['machine']['cores']} cores, backend {out['backend']}; "
             f"the same {args.n_questions} questions at every batch size, {args.max_new_tokens} new tokens, greedy, "
             f"batches interleaved over the methods.", "",
             "| method | " + " | ".join(f"batch {b}" for b in sizes) + " | policy limit |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for m in methods:
        cells = [f"{results[m.name][b]['tokens_per_s']:.1f} tok/s, {results[m.name][b]['speedup_vs_plain']:.2f}x"
                 + ("" if results[m.name][b]["identical_to_plain"] else " (differs!)") for b in sizes]
        lines.append(f"| {m.name} | " + " | ".join(cells) + f" | {limits.get(m.name, '-')} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods[1:]:
        ax.plot(sizes, [results[m.name][b]["speedup_vs_plain"] for b in sizes], marker="o", label=m.name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows)")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title(f"{args.model}, {out['backend']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
