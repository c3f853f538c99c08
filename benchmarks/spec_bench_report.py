"""Metrics, summaries, Markdown and plots of ``spec_bench.py`` (kept apart so both read in one sitting).

Definitions (``DEFINITIONS`` goes into every result JSON)
---------------------------------------------------------
*Mean accepted tokens* is Spec-Bench's "#Mean accepted tokens" (Xia et al. 2024, repository
hemingkx/Spec-Bench): each method's ``forward_func`` returns ``accept_length_list``, one entry
per target forward pass holding the tokens that pass added to the output
(``evaluation/inference_pld.py`` + ``model/pld/pld.py`` at bc8a422e: ``new_cur_len - cur_len``
after every forward, the first forward being the prefill, which also verifies drafts;
``evaluation/inference_baseline.py`` at 9262209f: ``[1] * new_token`` for plain decoding);
``evaluation/eval.py`` extends one list over all questions, and ``evaluation/speed.py`` (at
132ba4cf) prints ``np.mean`` of the list for a category. The mean of per-forward token counts
pooled over a category is  sum(new tokens) / sum(target forwards), prefill included,  which is
what we compute, from our engine's counts (``Metrics.target_forwards`` = verify steps + 1) and,
for transformers, from a forward pre-hook on its target model. Plain decoding scores 1.00.
(Spec-Bench's EAGLE scripts append only the draft-verify loop's steps, not the prefill's one
token: that is jaxspec's *tau* = sum(new tokens - 1) / sum(verify steps), reported too, for
our methods.)

*Speedup* is over our plain decoding of the same batch in the same run: per batch, tokens/s
of the method / tokens/s of ``plain``, i.e. the wall-time ratio whenever both emit the same
number of tokens (always under greedy decoding, whose outputs are identical); we quote the
median over a category's batches. Spec-Bench's own ``speed.py`` divides the *means* of
per-question tokens/s; that ratio is recorded as ``specbench_speedup``.

*Acceptance per draft position* i: verify steps that accepted draft depth i / verify steps,
pooled (``Metrics.acceptance_rate_per_position``); *acceptance rate*: accepted / drafted.
"""

from __future__ import annotations

import statistics

from benchmarks.bench_env import median

SPEC_BENCH_SOURCE = ("hemingkx/Spec-Bench: evaluation/speed.py (132ba4cf), evaluation/eval.py, "
                     "evaluation/inference_pld.py + model/pld/pld.py (bc8a422e), evaluation/inference_baseline.py "
                     "(9262209f)")
DEFINITIONS = {
    "mean_accepted_tokens": "Spec-Bench's '#Mean accepted tokens': sum(new tokens) / sum(target forward passes, "
                            "prefill included), pooled over the questions of a category; plain decoding = 1. "
                            "Source: " + SPEC_BENCH_SOURCE,
    "tau": "jaxspec's mean accepted length: sum(new tokens - 1) / sum(verify steps) (prefill and its token excluded); "
           "jaxspec methods only",
    "speedup_vs_plain": "per batch: (new tokens / wall s of the method) / (the same for jaxspec plain decoding of the "
                        "same batch in the same run); median over batches",
    "specbench_speedup": "Spec-Bench speed.py's ratio: mean over batches of the method's tokens/s / mean of plain's",
    "acceptance_per_position": "verify steps that accepted draft depth i / verify steps, pooled",
    "acceptance_rate": "accepted draft tokens / drafted tokens, pooled",
    "identical_to_plain": "questions whose tokens equal jaxspec plain decoding's (meaningful under greedy decoding)",
    "hf_token_agreement": "transformers' greedy tokens vs ours: common prefix length / the longer output's length",
}


# ----------------------------------------------------------------------------- per batch

def first_diff(a: list[int], b: list[int]):
    """Index of the first differing token (the shorter length when one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a: list[int], b: list[int]) -> dict:
    """Token agreement of two outputs: ``first_diff``, common prefix length and that length
    over the longer output's (1.0 when identical)."""
    d = first_diff(a, b)
    prefix = len(a) if d is None else d
    return {"identical": d is None, "first_diff": d, "common_prefix": prefix,
            "agreement": prefix / max(len(a), len(b), 1)}


def unit_row(unit: dict, order: list[str], runs: dict, loadavg_1m: float, tokenizer) -> dict:
    """JSON row of one batch: per method its wall seconds, per-row counts, tokens/s, speedup
    over ``plain`` and identity with ``plain``'s tokens (tokens kept for ``plain``,
    ``hf_plain`` and any method whose output differs), plus transformers' agreement with us."""
    base = runs["plain"]
    base_tps = sum(map(len, base.tokens)) / base.seconds
    row = {"batch_size": unit["batch_size"], "category": unit["category"],
           "question_ids": [q["id"] for q in unit["questions"]], "prompt_tokens": [len(q["ids"]) for q in unit["questions"]],
           "seeds": [q["seed"] for q in unit["questions"]], "loadavg_1m": loadavg_1m, "order": order, "methods": {}}
    for name, r in runs.items():
        new = [len(t) for t in r.tokens]
        equal = [a == b for a, b in zip(r.tokens, base.tokens)]
        x = {"seconds": r.seconds, "new_tokens": new, "tokens_per_s": sum(new) / r.seconds,
             "speedup_vs_plain": sum(new) / r.seconds / base_tps, "target_forwards": r.target_forwards,
             "drafted": r.drafted, "accepted": r.accepted, "accepted_at": r.accepted_at,
             "equals_plain": equal, "first_diff_vs_plain": [first_diff(a, b) for a, b in zip(r.tokens, base.tokens)]}
        x.update({k: v for k, v in r.extra.items() if v is not None})
        if name in ("plain", "hf_plain") or not all(equal):
            x["tokens"] = r.tokens
        row["methods"][name] = x
    row["text_plain"] = [tokenizer.decode(t) for t in base.tokens]
    if "hf_plain" in runs:
        row["hf_plain_vs_plain"] = [agreement(h, p) for h, p in zip(runs["hf_plain"].tokens, base.tokens)]
    return row


# ----------------------------------------------------------------------------- summaries

def _pooled(xs: list[dict], key: str):
    vals = [x[key] for x in xs]
    return None if any(v is None for v in vals) else [v for vs in vals for v in vs]


def stats(rows: list[dict], name: str) -> dict:
    """Summary of one method over ``rows`` (the batches that ran it): medians of per-batch
    tokens/s and speedup, Spec-Bench's mean accepted tokens, tau, acceptance (see
    ``DEFINITIONS``), identity with plain and, for ``hf_plain``, agreement with us."""
    xs = [r["methods"][name] for r in rows]
    new = _pooled(xs, "new_tokens")
    fwd = _pooled(xs, "target_forwards")
    out = {"batches": len(xs), "questions": len(new),
           "median_tokens_per_s": median([x["tokens_per_s"] for x in xs]),
           "median_speedup_vs_plain": median([x["speedup_vs_plain"] for x in xs]),
           "min_speedup_vs_plain": min(x["speedup_vs_plain"] for x in xs),
           "max_speedup_vs_plain": max(x["speedup_vs_plain"] for x in xs),
           "specbench_speedup": statistics.mean(x["tokens_per_s"] for x in xs)
           / statistics.mean(r["methods"]["plain"]["tokens_per_s"] for r in rows),
           "median_new_tokens": median(new),
           "mean_accepted_tokens": sum(new) / sum(fwd) if fwd else None,
           "identical_to_plain": sum(e for x in xs for e in x["equals_plain"])}
    if not name.startswith("hf_"):
        steps = sum(fwd) - len(fwd)
        out["tau"] = (sum(new) - len(new)) / steps if steps else None
        acc_at, drafted = _pooled(xs, "accepted_at"), _pooled(xs, "drafted")
        if acc_at:
            out["acceptance_rate"] = sum(_pooled(xs, "accepted")) / max(sum(drafted), 1)
            out["acceptance_per_position"] = [sum(col) / max(steps, 1) for col in zip(*acc_at)]
    if name == "hf_plain":
        agree = [a for r in rows for a in r.get("hf_plain_vs_plain", [])]
        out["hf_identical_to_plain"] = sum(a["identical"] for a in agree)
        out["hf_median_token_agreement"] = median([a["agreement"] for a in agree])
        out["hf_min_token_agreement"] = min((a["agreement"] for a in agree), default=None)
    return out


def summarize(rows: list[dict], names: list[str], batch_sizes: list[int], greedy: bool) -> dict:
    """``{batch size: {method: stats over all batches, with "per_category": {category: stats}}}``
    (keys are strings, for JSON), plus ``greedy`` (whether identity with plain is expected)."""
    out = {"greedy": greedy, "by_batch_size": {}}
    for b in batch_sizes:
        rb = [r for r in rows if r["batch_size"] == b]
        cats = list(dict.fromkeys(r["category"] for r in rb))
        per = {}
        for name in names:
            rs = [r for r in rb if name in r["methods"]]
            if rs:
                per[name] = stats(rs, name)
                per[name]["per_category"] = {c: stats([r for r in rs if r["category"] == c], name) for c in cats
                                             if any(r["category"] == c for r in rs)}
        out["by_batch_size"][str(b)] = per
    return out


# ----------------------------------------------------------------------------- markdown

def _f(x, spec=".2f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(result: dict) -> str:
    """The tables of a result: per batch size, every method overall, then per category
    (median speedup / mean accepted tokens), transformers' agreement, any identity failure."""
    s, m, v = result["settings"], result["machine"], result["versions"]
    greedy = result["summary"]["greedy"]
    md = [f"# Spec-Bench: {s['model']}" + (f" + draft {s['draft_model']}" if s["draft_model"] else "")
          + f", {s['dtype']}, {'greedy' if greedy else 'temperature ' + str(s['temperature'])} "
          f"({result['started_utc'][:10]})", "", f"`{result['command']}`", "",
          f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['mem_total_gib']} GiB; jax {v['jax']}, jaxspec "
          f"{v['jaxspec_git']}, torch {v['torch']}, transformers {v['transformers']}. {s['questions']} questions, "
          f"up to {s['max_new_tokens']} new tokens, batch sizes {s['batch_sizes']}. Wall time of each generate call, "
          f"compile excluded; medians over batches. Total {result['total_wall_s'] / 60:.1f} min; load average (1 min) "
          f"median {_f(median([r['loadavg_1m'] for r in result['rows']]), '.1f')}. Mean accepted tokens: Spec-Bench's "
          f"definition (new tokens / target forwards, prefill included); tau: ours (bonus included, prefill excluded).", ""]
    for b, per in result["summary"]["by_batch_size"].items():
        md += [f"## Batch size {b}", "",
               "| method | tok/s | speedup vs plain (min-max) | mean accepted tokens | tau | acceptance | "
               + ("identical to plain |" if greedy else "|"), "|---|---|---|---|---|---|" + ("---|" if greedy else "")]
        for name, x in per.items():
            cells = [name, _f(x["median_tokens_per_s"], ".1f"),
                     f"{_f(x['median_speedup_vs_plain'], '.2f', 'x')} ({x['min_speedup_vs_plain']:.2f}-"
                     f"{x['max_speedup_vs_plain']:.2f})", _f(x["mean_accepted_tokens"]), _f(x.get("tau")),
                     _f(x.get("acceptance_rate"))]
            cells += [f"{x['identical_to_plain']}/{x['questions']}"] if greedy else []
            md.append("| " + " | ".join(cells) + " |")
        cats = list(next(iter(per.values()))["per_category"])
        md += ["", f"Per category (batch size {b}): median speedup vs plain / mean accepted tokens", "",
               "| category | " + " | ".join(per) + " |", "|---|" + "---|" * len(per)]
        for c in cats:
            md.append(f"| {c} | " + " | ".join(
                f"{_f(x['per_category'][c]['median_speedup_vs_plain'], '.2f', 'x')} / "
                f"{_f(x['per_category'][c]['mean_accepted_tokens'])}" if c in x["per_category"] else "-"
                for x in per.values()) + " |")
        hf = per.get("hf_plain")
        if hf and greedy:
            md += ["", f"transformers' greedy output vs ours: identical on {hf['hf_identical_to_plain']}/{hf['questions']} "
                   f"questions; token agreement (common prefix / longer output) median "
                   f"{_f(hf['hf_median_token_agreement'])}, min {_f(hf['hf_min_token_agreement'])} "
                   f"(float32 op order differs: reported, not asserted)."]
            diffs = [(q, a) for r in result["rows"] if r["batch_size"] == int(b)
                     for q, a in zip(r["question_ids"], r.get("hf_plain_vs_plain", [])) if not a["identical"]]
            if diffs:
                md += ["", "| question | first differing token | agreement | transformers' top-2 logit gap there |",
                       "|---|---|---|---|"]
                md += [f"| {q} | {a['first_diff']} | {a['agreement']:.2f} | "
                       f"{_f(a.get('hf_logits_at_first_diff', {}).get('gap'), '.4f')} |" for q, a in diffs]
        md.append("")
    if greedy:
        bad = [(r["batch_size"], q, n, d) for r in result["rows"] for n, x in r["methods"].items() if not n.startswith("hf_")
               for q, e, d in zip(r["question_ids"], x["equals_plain"], x["first_diff_vs_plain"]) if not e]
        if bad:
            md += ["## jaxspec speculative output != jaxspec plain (must not happen under greedy)", ""]
            md += [f"- batch {b}, {q}, {n}: first differing token {d}" for b, q, n, d in bad] + [""]
    return "\n".join(md)


# ----------------------------------------------------------------------------- plots

def plots(result: dict, stem: str) -> list[str]:
    """Three PNGs (matplotlib, Agg): ``<stem>_tau.png`` mean accepted tokens per category and
    method (smallest batch size), ``<stem>_acceptance.png`` acceptance per draft position,
    ``<stem>_speedup_batch.png`` median speedup vs batch size. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_b = result["summary"]["by_batch_size"]
    b0 = min(by_b, key=int)
    per = by_b[b0]
    spec = [n for n in per if n != "plain"]
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, len(next(iter(per.values()))["per_category"]) * 0.9), 4))
    cats = list(per["plain"]["per_category"])
    width = 0.8 / max(len(per), 1)
    for i, (name, x) in enumerate(per.items()):
        vals = [x["per_category"].get(c, {}).get("mean_accepted_tokens") or 0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], vals, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=45, ha="right")
    ax.set_ylabel("mean accepted tokens (Spec-Bench)")
    ax.set_title(f"Mean accepted tokens per category, batch {b0}")
    ax.axhline(1.0, color="grey", lw=0.8)
    paths.append(_save(plt, fig, ax, stem + "_tau.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in spec:
        pos = per[name].get("acceptance_per_position")
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=name)
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("fraction of verify steps accepting it")
    ax.set_title(f"Acceptance per draft position, batch {b0}")
    ax.set_ylim(0, 1)
    paths.append(_save(plt, fig, ax, stem + "_acceptance.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(by_b, key=int)
    for name in [n for n in by_b[sizes[-1]] if n != "plain"] or spec:
        pts = [(int(b), by_b[b][name]["median_speedup_vs_plain"]) for b in sizes if name in by_b[b]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(b) for b in sizes], sizes)
    ax.set_xlabel("batch size")
    ax.set_ylabel("median speedup vs jaxspec plain")
    ax.set_title("Speedup vs batch size")
    paths.append(_save(plt, fig, ax, stem + "_speedup_batch.png"))
    return paths


def _save(plt, fig, ax, path: str) -> str:
    """Legend (when anything was drawn), tight layout, write ``path`` (110 dpi), close."""
    if ax.lines or ax.patches:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
