"""Replay n-gram drafting policies over recorded greedy outputs: what chose the adaptive depth.

Greedy speculative decoding emits exactly the target's greedy text, so how many drafts a
prompt-lookup policy gets accepted at each step is a function of that text alone. This
script records the target's greedy answers to Spec-Bench questions once (``--record``,
jaxspec plain decoding), then replays ``jaxspec.drafters.NGramDrafter``'s lookup over them
in plain Python for any (gamma, short_gamma, long_match, branches, branch_min_n): matches ranked by n-gram
length then recency, continuations cycled with the match's period, the best match's extent
choosing the depth, branches merged into a trie, the verify width the engine would pick
(``Capabilities.verify_widths``). Each step's cost is a measured target pass of that width
(``benchmarks/bench_pass_cost.py``'s JSON, interpolated) plus ``--step-overhead-ms``; plain
decoding costs one 1-token pass a token (``--loop-overhead-ms`` adds the loop's own work to
every step of both). It prints, per policy, the estimated speedup
(median over prompts, min over category medians, the code rewrite) and tau, and a table of
how many tokens the best match gets accepted by its extent, and what a second branch adds by its
match's n-gram size.

It is a model, not a measurement: it ignores the drafting cost and the longer attention of
long prompts, so it ranks policies (on questions apart from the evaluation subset) and
``benchmarks/spec_bench.py`` measures the chosen one. Example (the run that chose
``short_gamma=4, long_match=16``):

    python -m benchmarks.experiments.ngram_replay --record /tmp/tune.json --skip-first 2 --per-category 5
    python -m benchmarks.experiments.ngram_replay --replay /tmp/tune.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PASS_COST = os.path.join(os.path.dirname(HERE), "results", "pass_cost_smollm2-135m-gemma3-270m_cpu_2026-12-01.json")
POLICIES = ("g4", "g8", "g4_b2", "g16_s4", "g16_s3", "g16_s5", "g16_s4_m8", "g16_s4_m12", "g16_s4_m24", "g8_s4",
            "g24_s4", "g32_s4", "g16_s4_b2_n2", "g16_s4_b2", "g16_s3_b2", "g16_s2_b2")


def lookup(ctx: list[int], k: int, max_n: int = 3, min_n: int = 2, sizes: bool = False) -> list:
    """Continuation starts of the k best earlier matches of ctx's tail (``ngram.match_starts``);
    with ``sizes``, (start, n-gram size) pairs."""
    n, best = len(ctx), {}
    for size in range(min_n, max_n + 1):
        if size >= n:
            continue
        pattern = ctx[n - size :]
        for j in range(n - size):
            if ctx[j : j + size] == pattern:
                best[j + size] = max(best.get(j + size, 0), size)
    top = sorted(best, key=lambda c: (best[c], c), reverse=True)[:k]
    return [(c, best[c]) for c in top] if sizes else top


def extent(ctx: list[int], start: int, limit: int) -> int:
    """``ngram.match_extent``: tokens before ``start`` equal to the tokens before the present."""
    n, m = len(ctx), 0
    while m < limit and start - m - 1 >= 0 and ctx[start - m - 1] == ctx[n - m - 1]:
        m += 1
    return m


def continuation(ctx: list[int], start: int, gamma: int) -> list[int]:
    period = max(len(ctx) - start, 1)
    return [ctx[start + i % period] for i in range(gamma)]


def parse_policy(name: str) -> dict:
    """``g16_s4_m16_b2_n3`` -> gamma 16, short_gamma 4, long_match 16, branches 2, branch_min_n 3
    (the drafter's default: max_n = 3; ``_n2``: every match drafts a branch)."""
    keys = {"g": "gamma", "s": "short_gamma", "m": "long_match", "b": "branches", "n": "branch_min_n"}
    p = {"gamma": 4, "short_gamma": 0, "long_match": 16, "branches": 1, "branch_min_n": 3}
    p.update({keys[part[0]]: int(part[1:]) for part in name.split("_")})
    return p


def replay(prompt: list[int], output: list[int], policy: dict, cost, overhead: float) -> tuple[float, float]:
    """(estimated speedup over plain decoding, tau) of one recorded answer."""
    g, s, k = policy["gamma"], policy["short_gamma"], policy["branches"]
    widths = sorted({s, s * k, g} if s else {g, g * k})
    ctx, p, spent, steps = list(prompt), 0, 0.0, 0
    while p < len(output):
        found = lookup(ctx, k, sizes=True)
        starts = [c for i, (c, size) in enumerate(found) if i == 0 or size >= policy["branch_min_n"]]
        width, accepted = 0, 0
        if starts:
            copying = extent(ctx, starts[0], policy["long_match"]) >= policy["long_match"]
            depth = g if not s or copying else s
            if s and copying:  # adaptive depth: the copying match alone, as a chain
                starts = starts[:1]
            branches = [continuation(ctx, c, depth) for c in starts]
            distinct = [b for i, b in enumerate(branches) if b not in branches[:i]]
            width = min(w for w in widths if w >= depth * len(distinct)) if len(distinct) > 1 else depth
            for b in distinct:
                m = 0
                while m < depth and p + m < len(output) and b[m] == output[p + m]:
                    m += 1
                accepted = max(accepted, m)
        emitted = min(accepted + 1, len(output) - p)
        ctx += output[p : p + emitted]
        p, steps = p + emitted, steps + 1
        spent += cost(width + 1) + (overhead if width else 0.0)
    return len(output) * cost(1) / spent, len(output) / steps


def record(path: str, per_category: int, skip_first: int, max_new_tokens: int, model_name: str) -> None:
    """Greedy answers (jaxspec plain decoding) to Spec-Bench questions ``skip_first`` ..
    ``per_category - 1`` of each category, plus the code rewrite when ``skip_first`` is 0."""
    import jaxspec
    from benchmarks.spec_bench import QUESTIONS, load_questions

    skip = {q["id"] for q in load_questions(QUESTIONS, skip_first)} if skip_first else set()
    questions = [q for q in load_questions(QUESTIONS, per_category, code_prompt=not skip_first)
                 if q["id"] not in skip]
    model = jaxspec.load(model_name)
    tok, out = model.tokenizer, []
    for q in questions:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q["text"]}]), add_bos=False)
        res = jaxspec.generate(model, [ids], max_new_tokens=max_new_tokens)
        out.append({"id": q["id"], "category": q["category"], "prompt": ids, "output": res.tokens[0]})
        print(f"{q['id']}: {len(res.tokens[0])} tokens", flush=True)
    with open(path, "w") as f:
        json.dump({"model": model_name, "max_new_tokens": max_new_tokens, "answers": out}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", metavar="OUT.json", help="record greedy answers to this file, then stop")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--skip-first", type=int, default=2, help="leave out the first N of each category (default 2: "
                                                               "spec_bench's evaluation subset)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replay", metavar="ANSWERS.json", help="replay the policies over recorded answers")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, e.g. g4,g16_s4_m16,g4_b2")
    ap.add_argument("--pass-cost", default=PASS_COST, help="bench_pass_cost.py JSON (default: the 2026-12-01 run)")
    ap.add_argument("--step-overhead-ms", type=float, default=2.0,
                    help="added to every drafted step (default 2: brings g4's estimate near its measured speedup)")
    ap.add_argument("--loop-overhead-ms", type=float, default=0.0,
                    help="added to every step, plain decoding's included (the loop's own work beyond the pass)")
    args = ap.parse_args(argv)
    if args.record:
        record(args.record, args.per_category, args.skip_first, args.max_new_tokens, args.model)
        return 0
    if not args.replay:
        ap.error("give --record or --replay")
    with open(args.replay) as f:
        recorded = json.load(f)
    answers = recorded["answers"]
    with open(args.pass_cost) as f:
        ms = json.load(f)["results"][recorded["model"]]["ms"]
    xs = np.array(sorted(int(t) for t in ms))
    ys = np.array([ms[str(t)] for t in xs])

    def cost(t):
        return float(np.interp(t, xs, ys)) + args.loop_overhead_ms

    print(f"{len(answers)} answers; estimated speedup over plain (median over prompts / min over category medians / "
          f"code rewrite) and tau")
    for name in args.policies.split(","):
        runs = [(a["category"], *replay(a["prompt"], a["output"], parse_policy(name), cost, args.step_overhead_ms))
                for a in answers]
        cats = {}
        for c, sp, _ in runs:
            cats.setdefault(c, []).append(sp)
        med = {c: float(np.median(v)) for c, v in cats.items()}
        rewrite = f"{med['code_rewrite']:.2f}x" if "code_rewrite" in med else "-"
        print(f"  {name:12s} {np.median([r[1] for r in runs]):.3f}x / {min(med.values()):.3f}x / {rewrite}   "
              f"tau {np.mean([r[2] for r in runs]):.2f}")

    print("\nthe best match, by its extent: mean accepted of 16 drafted, P(accepted >= 1, 4, 16)")
    rows = []
    for a in answers:
        ctx, out = list(a["prompt"]), a["output"]
        for p in range(len(out)):
            starts = lookup(ctx + out[:p], 1)
            if starts:
                c = ctx + out[:p]
                draft = continuation(c, starts[0], 16)
                m = 0
                while m < 16 and p + m < len(out) and draft[m] == out[p + m]:
                    m += 1
                rows.append((extent(c, starts[0], 64), m))
    rows = np.array(rows)
    for lo, hi in ((2, 2), (3, 3), (4, 4), (5, 6), (7, 9), (10, 15), (16, 31), (32, 64)):
        sel = rows[(rows[:, 0] >= lo) & (rows[:, 0] <= hi), 1] if len(rows) else []
        if len(sel):
            print(f"  extent {lo:2d}-{hi:2d}: {len(sel):4d} steps, mean {sel.mean():5.2f}, "
                  f"P(>=1) {np.mean(sel >= 1):.2f}, P(>=4) {np.mean(sel >= 4):.2f}, P(>=16) {np.mean(sel >= 16):.2f}")
    second_branch_gain(answers)
    return 0


def accepted_length(draft: list[int], output: list[int], p: int) -> int:
    m = 0
    while m < len(draft) and p + m < len(output) and draft[m] == output[p + m]:
        m += 1
    return m


def second_branch_gain(answers, short_gamma: int = 4, long_match: int = 16) -> None:
    """What chose ``branch_min_n``: along g16_s4's path, at each step where the best match is not
    copying, how many more tokens a second branch of ``short_gamma`` (the second-best match)
    gets accepted than the best match's alone, by the second match's n-gram size."""
    gain = {}
    for a in answers:
        out, p = a["output"], 0
        while p < len(out):
            ctx = a["prompt"] + out[:p]
            found = lookup(ctx, 2, sizes=True)
            if not found:
                p += 1
                continue
            copying = extent(ctx, found[0][0], long_match) >= long_match
            first = continuation(ctx, found[0][0], 16 if copying else short_gamma)
            m = accepted_length(first, out, p)
            if not copying and len(found) > 1:
                second = continuation(ctx, found[1][0], short_gamma)
                extra = accepted_length(second, out, p) if second != first else 0
                gain.setdefault(found[1][1], []).append(max(m, extra) - m)
            p += m + 1
    print(f"\na second branch of {short_gamma} where the best match is not copying: mean tokens it adds to the "
          f"accepted length, by the second match's n-gram size")
    for size in sorted(gain):
        print(f"  {size}-gram: {len(gain[size]):4d} steps, {np.mean(gain[size]):.2f} tokens")


if __name__ == "__main__":
    sys.exit(main())
