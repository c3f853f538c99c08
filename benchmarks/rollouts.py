"""RL rollouts: plain sampling against speculative sampling with the rollout-history drafter.

An epoch samples ``--group`` G answers to each of ``--prompts`` arithmetic word problems
(``examples/grpo_rollouts.py``'s, seeded) at temperature 1, in calls of ``--rows`` rows (one
call: a prompt's G samples, or several prompts'; 1: each sample alone), for every method in
turn, call by call (interleaved, so each call's A/B runs on the same machine state). The
policy's weights stay fixed here: the epochs show what the history brings as it fills.

Methods:
- ``plain``: no drafter;
- ``ngram``: per-row prompt lookup (``NGramDrafter(gamma=4)``);
- ``own``: ``HistoryDrafter`` over the row's own text only (no siblings, no history);
- ``siblings``: own text and the call's sibling rows;
- ``history``: own text, siblings and every earlier rollout of the prompt (a ``RolloutHistory``
  per method, fed by that method's own rollouts; the current epoch's earlier calls included);
- ``draft``: the ``--draft`` model's sampled chain (``ModelDrafter(gamma=4)``);
- ``history+draft``: ``history`` where it finds a match, the ``--draft`` model's chain where it
  does not (``HybridDrafter``).

Per epoch and method: tau, target passes over all rows, the makespan in target passes (per
call its slowest row's, summed over the calls: what a synchronous step waits for), run
seconds (compiles excluded), tokens/s, and the speedup over plain (run seconds). The batch
policy is off (``disable_by_batch_size=None``) so every method speculates at every size.
Writes the JSON record and, beside it, a PNG of the rollout time by epoch (``plot``).

    python -m benchmarks.rollouts [--model qwen2.5-coder-0.5b] [--prompts 4] [--group 8]
        [--rows 8] [--epochs 3] [--max-new-tokens 128] [--methods plain,ngram,siblings,history]
        [--draft qwen2.5-coder-0.5b]  (for the draft and history+draft methods, e.g. with --model qwen2.5-coder-1.5b)
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench_env import command, machine_info, median, result_stem, versions, write_record

METHODS = ("plain", "ngram", "own", "siblings", "history", "draft", "history+draft")


def drafter_of(method: str, draft=None):
    """The method's drafter (None for plain); ``draft``: the draft ``Model`` of the draft methods."""
    import jaxspec

    if method in ("draft", "history+draft"):
        model = jaxspec.ModelDrafter(draft.config, gamma=4)
        return model if method == "draft" else jaxspec.HybridDrafter(jaxspec.HistoryDrafter(), model)
    return {"plain": None, "ngram": jaxspec.NGramDrafter(gamma=4), "own": jaxspec.HistoryDrafter(siblings=0),
            "siblings": jaxspec.HistoryDrafter(), "history": jaxspec.HistoryDrafter()}[method]


def plot(record: dict, path: str) -> None:
    """A PNG of each epoch's rollout time per method: run seconds (what a synchronous step
    waits for, summed over its calls) and the makespan in target passes, both over plain's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = list(range(len(record["per_epoch"])))
    fig, (secs, passes) = plt.subplots(1, 2, figsize=(9, 3.6))
    for m in record["methods"]:
        secs.plot(epochs, [e[m]["run_s"] for e in record["per_epoch"]], marker="o", label=m)
        passes.plot(epochs, [e[m]["makespan_ratio"] for e in record["per_epoch"]], marker="o", label=m)
    secs.set_ylabel("rollout seconds per epoch")
    passes.set_ylabel("makespan in target passes / plain's")
    for ax in (secs, passes):
        ax.set_xlabel("epoch")
        ax.set_xticks(epochs)
    secs.set_ylim(bottom=0)
    passes.set_ylim(0, 1.05)
    passes.legend(fontsize=8)
    draft = f", draft {record['draft']}" if record.get("draft") else ""
    fig.suptitle(f"{record['model']}{draft}: {record['prompts']} prompts x G = {record['group']}, "
                 f"{record['rows_per_call']} row(s) per call, {record['max_new_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rows", type=int, default=8, help="rows per generate call (a multiple or divisor of --group)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="plain,ngram,siblings,history")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model of the draft methods")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jaxspec
    from examples.grpo_rollouts import problems

    t_start = time.time()
    methods = args.methods.split(",")
    if methods[0] != "plain" or any(m not in METHODS for m in methods):
        raise SystemExit(f"--methods must start with plain and name some of {METHODS}")
    if args.rows % args.group and args.group % args.rows:
        raise SystemExit("--rows must be a multiple or a divisor of --group")
    model = jaxspec.load(args.model, dtype=args.dtype)
    draft = jaxspec.load(args.draft, dtype=args.dtype) if {"draft", "history+draft"} & set(methods) else None
    questions = [t["question"] for t in problems(args.prompts, args.seed)]
    # the rows in order, prompt-major; a call takes --rows of them (as prompts x n when it can)
    rows = [q for q in questions for _ in range(args.group)]
    calls = [rows[i : i + args.rows] for i in range(0, len(rows), args.rows)]
    histories = {m: jaxspec.RolloutHistory(vocab_size=model.config.vocab_size, capacity=max(16, args.group),
                                           max_tokens=args.max_new_tokens + jaxspec.rollouts.PROMPT_TAIL)
                 for m in methods}
    epochs = []
    for epoch in range(args.epochs):
        stats = {m: {"passes": 0, "makespan": 0, "run_s": 0.0, "tokens": 0, "steps": 0, "emitted": 0, "misses": 0}
                 for m in methods}
        for c, call in enumerate(calls):
            for m in methods:
                kw = dict(chat=True, temperature=1.0, max_new_tokens=args.max_new_tokens, disable_by_batch_size=None,
                          disable_by_acceptance=None, seed=(epoch * len(calls) + c) * 1000)
                d = drafter_of(m, draft)
                extra = {"drafter": d} if d is not None else {}
                extra["drafter_params"] = {"history": histories[m], "draft": draft,
                                           "history+draft": (histories[m], draft)}.get(m)
                res = jaxspec.generate(model, call, **kw, **extra)
                if res.metrics.compiled:  # time the program, not its compile: run the call again
                    res = jaxspec.generate(model, call, **kw, **extra)
                if res.history is not None:
                    histories[m] = res.history
                s, met = stats[m], res.metrics
                s["passes"] += int(met.target_forwards.sum())
                s["makespan"] += int(met.target_forwards.max())
                s["run_s"] += met.run_s
                s["tokens"] += int(met.new_tokens.sum())
                s["steps"] += int(met.verify_steps.sum())
                s["emitted"] += int((met.new_tokens - 1).clip(0).sum())
                s["misses"] += met.history_misses or 0
        plain = stats["plain"]
        for m, s in stats.items():
            s["tau"] = s["emitted"] / s["steps"] if s["steps"] else 1.0
            s["tokens_per_s"] = s["tokens"] / s["run_s"]
            s["speedup"] = plain["run_s"] / s["run_s"]
            s["passes_ratio"] = s["passes"] / plain["passes"]
            s["makespan_ratio"] = s["makespan"] / plain["makespan"]
        epochs.append(stats)
        print(f"epoch {epoch}: " + "; ".join(f"{m} tau {s['tau']:.2f} makespan {s['makespan_ratio']:.2f} "
                                             f"speedup {s['speedup']:.2f}" for m, s in stats.items()), flush=True)
    summary = {m: {"tau_last_epoch": epochs[-1][m]["tau"], "speedup_last_epoch": epochs[-1][m]["speedup"],
                   "makespan_ratio_last_epoch": epochs[-1][m]["makespan_ratio"],
                   "passes_ratio_last_epoch": epochs[-1][m]["passes_ratio"],
                   "median_speedup": median([e[m]["speedup"] for e in epochs])} for m in methods}
    record = {"benchmark": "rollouts", "model": args.model, "draft": draft and args.draft, "dtype": args.dtype,
              "prompts": args.prompts,
              "group": args.group, "rows_per_call": args.rows, "epochs": args.epochs, "temperature": 1.0,
              "max_new_tokens": args.max_new_tokens, "methods": methods, "summary": summary, "per_epoch": epochs,
              "machine": machine_info(), "versions": versions(), "command": command(argv),
              "elapsed_s": time.time() - t_start}
    variant = f"{args.model}-{args.dtype}-g{args.group}-rows{args.rows}" + (f"-draft-{args.draft}" if draft else "")
    path = args.out or result_stem("rollouts", variant) + ".json"
    write_record(record, path)
    plot(record, path.removesuffix(".json") + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
