"""Sphinx extension: benchmark tables generated from ``benchmarks/results/*.json`` at build time.

Each entry of ``RESULTS`` names one results file and how to read it; on ``builder-inited`` the
extension writes ``docs/_generated/results/<name>.md`` (a Markdown table, the command that made
the file, its machine and versions), which the pages pull in with MyST's ``{include}``. The
numbers are never copied by hand: a results file that changes changes the page.
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "docs", "_generated", "results")

# name -> (results file, kind). The headline results the documentation quotes.
RESULTS = {
    "spec_bench_smollm2_quiet": ("benchmarks/results/spec_bench_smollm2-135m-quiet_cpu_2026-12-02.json", "spec_bench"),
    "spec_bench_smollm2_drafters": ("benchmarks/results/spec_bench_smollm2-135m-drafters_cpu_2026-12-03.json", "spec_bench"),
    "spec_bench_smollm2_gate": ("benchmarks/results/spec_bench_smollm2-135m-gate_cpu_2026-12-04.json", "spec_bench"),
    "spec_bench_smollm2_heads_kernels": ("benchmarks/results/spec_bench_smollm2-135m-heads_cpu_2026-12-07.json", "spec_bench"),
    "spec_bench_smollm2_gate_kernels": ("benchmarks/results/spec_bench_smollm2-135m-gate_cpu_2026-12-07.json", "spec_bench"),
    "spec_bench_qwen": ("benchmarks/results/spec_bench_qwen2.5-coder-1.5b_cpu_2026-12-02.json", "spec_bench"),
    "spec_bench_qwen_gate": ("benchmarks/results/spec_bench_qwen2.5-coder-1.5b-gate_cpu_2026-12-04.json", "spec_bench"),
    "pass_cost_cpu": ("benchmarks/results/pass_cost_smollm2-135m-gemma3-270m_cpu_2026-12-01.json", "pass_cost"),
    "small_matmul_cpu": ("benchmarks/results/small_matmul_1536x8960_cpu_2026-12-06.json", "small_matmul"),
    "pass_cost_kernel_cpu": ("benchmarks/results/pass_cost_smollm2-135m_cpu_2026-12-06.json", "pass_cost"),
    "spec_bench_smollm2_kernel": ("benchmarks/results/spec_bench_smollm2-135m_cpu_2026-12-06.json", "spec_bench"),
    "pass_cost_kernel_bf16_cpu": ("benchmarks/results/pass_cost_smollm2-135m-bfloat16_cpu_2026-12-06.json", "pass_cost"),
    "small_matmul_panels_cpu": ("benchmarks/results/small_matmul_1536x8960_cpu_2026-12-07.json", "small_matmul"),
    "pass_cost_panels_cpu": ("benchmarks/results/pass_cost_smollm2-135m-float32_cpu_2026-12-07.json", "pass_cost"),
    "pass_cost_qwen_panels_cpu": ("benchmarks/results/pass_cost_qwen2.5-coder-1.5b-float32_cpu_2026-12-07.json", "pass_cost"),
    "pass_cost_qwen_panels_bf16_cpu": ("benchmarks/results/pass_cost_qwen2.5-coder-1.5b-bfloat16_cpu_2026-12-07.json", "pass_cost"),
    "pass_profile_cpu": ("benchmarks/results/pass_profile_smollm2-135m_cpu_2026-12-07.json", "pass_profile"),
    "pass_profile_bf16_cpu": ("benchmarks/results/pass_profile_smollm2-135m-bfloat16_cpu_2026-12-07.json", "pass_profile"),
    "small_matmul_avx512_cpu": ("benchmarks/results/small_matmul_1536x8960-avx512_cpu_2026-12-07.json", "small_matmul"),
    "spec_bench_smollm2_heads_avx512": ("benchmarks/results/spec_bench_smollm2-135m-heads-avx512_cpu_2026-12-07.json",
                                        "spec_bench"),
    "pass_cost_qwen_isas_cpu": ("benchmarks/results/pass_cost_qwen2.5-coder-1.5b_isas_cpu_2026-12-07.json", "pass_cost"),
    "pass_cost_qwen_isas_bf16_cpu": ("benchmarks/results/pass_cost_qwen2.5-coder-1.5b_isas_bf16_cpu_2026-12-07.json",
                                     "pass_cost"),
    "pass_cost_isas_cpu": ("benchmarks/results/pass_cost_smollm2_isas_cpu_2026-12-07.json", "pass_cost"),
    "pass_cost_isas_bf16_cpu": ("benchmarks/results/pass_cost_smollm2_isas_bf16_cpu_2026-12-07.json", "pass_cost"),
    "spec_bench_smollm2_avx512": ("benchmarks/results/spec_bench_smollm2-135m-avx512_cpu_2026-12-07.json", "spec_bench"),
    "spec_bench_smollm2_avx512_bf16": ("benchmarks/results/spec_bench_smollm2-135m-avx512-bfloat16_cpu_2026-12-07.json",
                                       "spec_bench"),
    "pass_cost_panels_bf16_cpu": ("benchmarks/results/pass_cost_smollm2-135m-bfloat16_cpu_2026-12-07.json", "pass_cost"),
    "spec_bench_smollm2_panels": ("benchmarks/results/spec_bench_smollm2-135m-panels_cpu_2026-12-07.json", "spec_bench"),
    "spec_bench_smollm2_panels_bf16": ("benchmarks/results/spec_bench_smollm2-135m-panels-bfloat16_cpu_2026-12-07.json", "spec_bench"),
    "spec_bench_smollm2_attention": ("benchmarks/results/spec_bench_smollm2-135m-attention_cpu_2026-12-07.json", "spec_bench"),
    "exact_logprobs_smollm2": ("benchmarks/results/exact_logprobs_smollm2-135m_cpu_2026-12-07.json", "exact_logprobs"),
    "batch_sweep_smollm2": ("benchmarks/results/batch_sweep_smollm2-135m_cpu_2026-12-02.json", "batch_sweep"),
    "batch_sweep_qwen": ("benchmarks/results/batch_sweep_qwen2.5-coder-1.5b_cpu_2026-12-03.json", "batch_sweep"),
    "batch_sweep_qwen_b2_8_32": ("benchmarks/results/batch_sweep_qwen2.5-coder-1.5b-b2-8-32_cpu_2026-12-03.json", "batch_sweep"),
    "batch_sweep_smollm2_heads": ("benchmarks/results/batch_sweep_smollm2-135m-heads_cpu_2026-12-03.json", "batch_sweep"),
    "structured_output_smollm2": ("benchmarks/results/structured_output_smollm2-135m-float32_cpu_2026-12-07.json",
                                  "structured_output"),
    "structured_output_gemma3": ("benchmarks/results/structured_output_gemma3-270m-float32_cpu_2026-12-07.json",
                                 "structured_output"),
    "rollouts_qwen05_rows1": ("benchmarks/results/rollouts_qwen2.5-coder-0.5b-float32-g4-rows1_cpu_2026-12-07.json",
                              "rollouts"),
    "rollouts_qwen05_rows2": ("benchmarks/results/rollouts_qwen2.5-coder-0.5b-float32-g4-rows2_cpu_2026-12-07.json",
                              "rollouts"),
    "rollouts_qwen05_rows4": ("benchmarks/results/rollouts_qwen2.5-coder-0.5b-float32-g4-rows4_cpu_2026-12-07.json",
                              "rollouts"),
    "rollouts_qwen05_g8_e3": ("benchmarks/results/rollouts_qwen2.5-coder-0.5b-float32-g8-rows1-e3-avx512_cpu_2026-12-07.json",
                              "rollouts"),
    "rollouts_qwen15_draft": ("benchmarks/results/rollouts_qwen2.5-coder-1.5b-float32-g4-rows1-draft-"
                              "qwen2.5-coder-0.5b_cpu_2026-12-07.json", "rollouts"),
    "accelerator_h200_8b": ("benchmarks/results/accelerator_llama-3.1-8b_nvidia-h200_2026-12-04.json", "accelerator"),
    "accelerator_h200_1b": ("benchmarks/results/accelerator_llama-3.2-1b_nvidia-h200_2026-12-04.json", "accelerator"),
}


def _f(x, spec=".2f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _command(cmd: str) -> str:
    """The command as a reader would type it from the repository root (the interpreter's
    absolute path dropped). Runs recorded before ``benchmarks`` became a package name the
    script (``PYTHONPATH=. python benchmarks/spec_bench.py``): the same run is now
    ``python -m benchmarks.spec_bench`` (``benchmarks.experiments.<name>`` for a script moved there)."""
    words = [w for w in cmd.split() if w != "PYTHONPATH=."]
    i = next((i for i, w in enumerate(words) if w.endswith(("python", "python3"))), None)  # after VAR=value words
    if i is not None:
        if "/" in words[i]:
            words[i] = "python"
        m = re.fullmatch(r"benchmarks/(?:experiments/)?(\w+)\.py", words[i + 1]) if i + 1 < len(words) else None
        if m:
            sub = "experiments." if os.path.isfile(os.path.join(ROOT, "benchmarks", "experiments", m[1] + ".py")) else ""
            words[i + 1:i + 2] = ["-m", f"benchmarks.{sub}{m[1]}"]
    if "--out" in words:  # where that run wrote its file; the default is benchmarks/results/
        i = words.index("--out")
        del words[i:i + 2]
    return " ".join(words)


def _machine(d: dict) -> str:
    m, v = d.get("machine", {}), d.get("versions", {})
    where = m.get("device_kind") or m.get("cpu_model", "?")
    return (f"{where}, {m.get('cores', '?')} CPU cores; jax {v.get('jax', '?')}"
            + (f", jaxspec {v['jaxspec_git'][:7]}" if v.get("jaxspec_git") else ""))


def _source(path: str, d: dict, date: str) -> list[str]:
    return ["", f"From `{path}` ({date}; {_machine(d)}), made by:", "", "```bash", _command(d["command"]), "```", ""]


def spec_bench(path: str, d: dict) -> str:
    greedy = d["summary"]["greedy"]
    md = []
    for b, per in d["summary"]["by_batch_size"].items():
        md += [f"Batch size {b}, {d['settings']['questions']} prompts, up to {d['settings']['max_new_tokens']} new "
               f"tokens, {'greedy' if greedy else 'temperature ' + str(d['settings']['temperature'])}:", "",
               "| method | tok/s | median speedup vs plain (min-max) | mean accepted tokens | tau |"
               + (" identical to plain |" if greedy else ""),
               "|---|---|---|---|---|" + ("---|" if greedy else "")]
        for name, x in per.items():
            cells = [f"`{name}`", _f(x["median_tokens_per_s"], ".1f"),
                     f"{_f(x['median_speedup_vs_plain'], '.2f', 'x')} ({x['min_speedup_vs_plain']:.2f}-"
                     f"{x['max_speedup_vs_plain']:.2f})", _f(x["mean_accepted_tokens"]), _f(x.get("tau"))]
            if greedy:
                cells.append("-" if name.startswith("hf_") else f"{x['identical_to_plain']}/{x['questions']}")
            md.append("| " + " | ".join(cells) + " |")
        md.append("")
    return "\n".join(md + _source(path, d, d["started_utc"][:10]))


def batch_sweep(path: str, d: dict) -> str:
    res = d["results"]
    sizes = list(res["plain"])
    md = ["| batch size | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes),
          "| `plain`, tok/s (all rows) | " + " | ".join(_f(res["plain"][b]["tokens_per_s"], ".1f") for b in sizes) + " |"]
    for name, per in res.items():
        if name != "plain":
            md.append(f"| `{name}` vs plain | "
                      + " | ".join(_f(per[b]["speedup_vs_plain"], ".2f", "x") if b in per else "-" for b in sizes) + " |")
    ident = all(per[b].get("identical_to_plain", True) for per in res.values() for b in per)
    md += ["", f"Every output identical to plain decoding: {'yes' if ident else 'NO'}."]
    return "\n".join(md + _source(path, d, d["started_utc"][:10]))


def accelerator(path: str, d: dict) -> str:
    md = []
    for shape, s in d["shapes"].items():
        p, e = s["pass"]["ms"], s["e2e"]
        plain = e["plain"]["decode_tokens_per_s"]
        rows = [("weight-streaming floor (weights / measured copy bandwidth)", f"{s['floor_ms']:.2f} ms"),
                ("target pass, batch 1, T = 1 / 5 / 31 tokens",
                 " / ".join(_f(p.get(f"B1_T{t}")) for t in (1, 5, 31)) + " ms"),
                ("plain decoding, ms per token", f"{1e3 / plain:.2f} ms")]
        hf = s.get("transformers", {}).get("B1")
        if hf:
            rows.append(("transformers, static cache, ms per token", f"{hf['ms_per_step']:.2f} ms"))
        taus = [k for k in e if k.startswith("synthetic_tau")]
        if taus:
            rows.append(("synthetic tau " + " / ".join(k[len("synthetic_tau"):] for k in taus)
                         + " vs plain (NOT lossless)",
                         " / ".join(f"{e[k]['decode_tokens_per_s'] / plain:.2f}x" for k in taus)))
        md += [f"{shape} shape, {s['dtype']}, random weights:", "", "| measurement | value |", "|---|---|"]
        md += [f"| {a} | {b} |" for a, b in rows] + [""]
    goals = d.get("goals", [])
    if goals:
        md += ["| goal | value | limit | |", "|---|---|---|---|"]
        md += [f"| {g['goal']} ({g['shape']}) | {g['value']:.2f} | {g['limit']} | {'PASS' if g['pass'] else 'FAIL'} |"
               for g in goals] + [""]
    return "\n".join(md + _source(path, d, d["started"][:10]))


def pass_cost(path: str, d: dict) -> str:
    res = d["results"]
    ts = list(next(iter(res.values()))["ms"])
    md = ["| tokens in the pass (T) | " + " | ".join(ts) + " |", "|---|" + "---|" * len(ts)]
    for model, r in res.items():
        md.append(f"| {model}, ms (x T = 1) | "
                  + " | ".join(f"{r['ms'][t]:.1f} ({r['ratio_to_T1'][t]:.2f})" for t in ts) + " |")
    s = d["settings"]
    md += ["", f"One target pass over T new tokens, {s.get('dtype') or 'float32'} weights, {s['slots']}-slot cache, "
           f"medians of {s['reps']} interleaved calls; `/xla`: the same pass with XLA's dot for the weight products; "
           f"`/kn`: the kernel over plain `[K, N]` matrices (from 2026-12-07 the unmarked row runs them in panels); "
           f"`/plain_head`: projections in panels, the output head a plain matrix; `/avx2`: the same program with "
           f"the kernels capped at their AVX2 path (`cpu_matmul.limit_isa`)."]
    return "\n".join(md + _source(path, d, re.search(r"\d{4}-\d\d-\d\d", path).group()))


def small_matmul(path: str, d: dict) -> str:
    res = d["results"]
    ts = list(next(iter(res.values())))
    md = ["| library | " + " | ".join(f"T = {t[1:]}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
    for lib, r in res.items():
        one = r[ts[0]]
        md.append(f"| {lib} | {one['ms']:.2f} ms ({one['GB_s']:.1f} GB/s) | "
                  + " | ".join(f"{r[t]['vs_T1']:.2f}x" for t in ts[1:]) + " |")
    sh = d["shape"]
    md += ["", f"`x [T, {sh['k']}] @ W [{sh['k']}, {sh['n']}]`, {sh['matrices']} matrices per call, ms per product at "
           f"T = 1 (weight bytes per second) and the cost of T rows relative to one; medians of {d['reps']}. "
           f"Copy bandwidth {d['copy_GB_s']} GB/s. `_nk`: weights stored `[N, K]`; `_panels`: in panels of 16 columns; "
           f"`_bf16`: bfloat16 weights."]
    return "\n".join(md + _source(path, d, re.search(r"\d{4}-\d\d-\d\d", path).group()))


def exact_logprobs(path: str, d: dict) -> str:
    s = d["settings"]
    md = ["| dtype / drafter | prompts | text identical to plain | logprobs bitwise plain's | drafts accepted |",
          "|---|---|---|---|---|"]
    md += [f"| {key} | {x['prompts']} | {x['text_identical']} | {x['logprobs_bitwise']} | {x['accepted']} |"
           for key, x in d["summary"].items()]
    md += ["", f"Greedy, batch 1, {s['max_new_tokens']} new tokens, {s['per_category']} Spec-Bench question(s) per "
           f"category and {s['mixed']} mixed prompts; each emitted token's logprob and top alternative compared "
           f"with `==`."]
    return "\n".join(md + _source(path, d, d["started_utc"][:10]))


# the instruction kinds of a pass profile (benchmarks/profile_ops.py --pass-widths), grouped
_PASS_PARTS = (("weight products", lambda k: k.startswith("jaxspec_cpu_matmul") or k in ("dot", "fusion output:dot")),
               ("attention", lambda k: k == "jaxspec_cpu_attention"),
               ("RoPE", lambda k: k == "jaxspec_cpu_rope"),
               ("fusions ending in a convert (bfloat16: the norms)", lambda k: k.endswith(":convert")),
               ("other XLA ops (norms, residual adds, SiLU, masks, gathers)", lambda k: True))


def pass_profile(path: str, d: dict) -> str:
    widths = d["widths"]
    ts = list(widths)
    md = ["| ms per pass (share) | " + " | ".join(f"T = {t}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
    parts = {t: dict.fromkeys([name for name, _ in _PASS_PARTS], 0.0) for t in ts}
    for t in ts:
        for kind, ms in widths[t]["by_kind_ms"].items():
            name = next(name for name, match in _PASS_PARTS if match(kind))
            parts[t][name] += ms
    rows = [(name, {t: parts[t][name] for t in ts}) for name, _ in _PASS_PARTS]
    rows.append(("between ops (runtime: the wall time no op covers)",
                 {t: max(0.0, widths[t]["wall_ms"] - widths[t]["op_ms"]) for t in ts}))
    for name, ms in rows:
        md.append(f"| {name} | " + " | ".join(f"{ms[t]:.2f} ({100 * ms[t] / widths[t]['wall_ms']:.0f}%)" for t in ts) + " |")
    md.append("| **wall** | " + " | ".join(f"**{widths[t]['wall_ms']:.1f}**" for t in ts) + " |")
    st = d["settings"]
    md += ["", f"{st['model']}, {st.get('dtype') or 'float32'} weights, one verify pass of T tokens (200 committed, "
           f"512-slot cache), {st['reps']} profiled passes per width (`jax.profiler`); each instruction's time from "
           "the trace, grouped by kind."]
    return "\n".join(md + _source(path, d, re.search(r"\d{4}-\d\d-\d\d", path).group()))


def structured_output(path: str, d: dict) -> str:
    md = ["| method | tok/s | median speedup vs constrained plain (min) | tau | valid / finished | identical to plain |",
          "|---|---|---|---|---|---|"]
    for name, x in d["summary"].items():
        md.append(f"| `{name}` | {_f(x['tok_s_median'], '.1f')} | {_f(x['speedup_median'], '.2f', 'x')} "
                  f"({x['speedup_min']:.2f}) | {_f(x['tau_median'])} | {x['valid']}/{x['finished']} | "
                  f"{x['same_tokens']}/{x['prompts']} |")
    md += ["", f"{d['model']}, {d['dtype']} weights, {len(d['rows'])} JSON extraction prompts under their JSON "
           f"Schemas (`benchmarks/structured_output.py`), up to {d['max_new_tokens']} new tokens, greedy, batch 1; "
           "speedups are medians over prompts of tok/s over constrained plain decoding's on the same prompt."]
    return "\n".join(md + _source(path, d, re.search(r"\d{4}-\d\d-\d\d", path).group()))


def rollouts(path: str, d: dict) -> str:
    md = ["| epoch | method | tau | target passes / plain's | makespan / plain's | speedup vs plain (run s) |",
          "|---|---|---|---|---|---|"]
    for e, per in enumerate(d["per_epoch"]):
        for name in d["methods"][1:]:
            x = per[name]
            md.append(f"| {e} | `{name}` | {x['tau']:.2f} | {x['passes_ratio']:.2f} | {x['makespan_ratio']:.2f} | "
                      f"{x['speedup']:.2f}x |")
    draft = f" (draft model {d['draft']})" if d.get("draft") else ""
    md += ["", f"{d['model']}{draft}, {d['dtype']} weights, {d['prompts']} arithmetic word problems x G = {d['group']} "
           f"samples, {d['rows_per_call']} row(s) per call, up to {d['max_new_tokens']} new tokens, temperature 1, "
           "fixed weights; the makespan sums each call's slowest row's target passes."]
    return "\n".join(md + _source(path, d, re.search(r"\d{4}-\d\d-\d\d", path).group()))


KINDS = {"rollouts": rollouts, "structured_output": structured_output, "pass_profile": pass_profile, "exact_logprobs": exact_logprobs, "pass_cost": pass_cost, "small_matmul": small_matmul, "spec_bench": spec_bench, "batch_sweep": batch_sweep, "accelerator": accelerator}


def _write(out: str, text: str) -> None:
    if not os.path.exists(out) or open(out).read() != text:  # unchanged files keep Sphinx's cache
        with open(out, "w") as f:
            f.write(text)


def scaleout() -> str:
    """The per-chip cost of a verify step on TPU slices: arithmetic, ``benchmarks/experiments/scaleout_table.py``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scaleout_table", os.path.join(ROOT, "benchmarks", "experiments", "scaleout_table.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod.table() + "\n"


README_HEADLINE = "spec_bench_smollm2_drafters"


def readme_headline() -> str:
    """The README's one results table (median speedup and tau of every method, batch 1), with
    its file and command; ``tests/test_docs.py`` checks that README.md holds exactly this."""
    path = RESULTS[README_HEADLINE][0]
    with open(os.path.join(ROOT, path)) as f:
        d = json.load(f)
    s = d["settings"]
    per = d["summary"]["by_batch_size"]["1"]
    same = all(x["identical_to_plain"] == x["questions"] for x in per.values())
    md = [f"SmolLM2-135M-Instruct, {s['questions']} Spec-Bench questions (one per category), up to "
          f"{s['max_new_tokens']} new tokens, greedy, batch 1, {_machine(d)}; speedup over jaxspec's plain "
          "decoding (median over prompts)" + (", every output identical to plain decoding's:" if same else ":"), "",
          "| method | median speedup | tau | identical to plain |", "|---|---|---|---|"]
    md += [f"| `{name}` | {_f(x['median_speedup_vs_plain'], '.2f', 'x')} | {_f(x.get('tau'))} | "
           f"{x['identical_to_plain']}/{x['questions']} |" for name, x in per.items()]
    md += ["", "Method names: the drafter, then `_g` gamma, `_b` n-gram branches, `_n` tree nodes, `_k` branching, "
           "`_l` early-exit layers.", "", f"From [`{path}`]({path}), made by `{_command(d['command'])}`."]
    return "\n".join(md)


def generate() -> list[str]:
    """Write every table; returns the paths written."""
    os.makedirs(OUT, exist_ok=True)
    out = os.path.join(OUT, "scaleout_table.md")
    _write(out, scaleout())
    written = [out]
    for name, (path, kind) in RESULTS.items():
        with open(os.path.join(ROOT, path)) as f:
            d = json.load(f)
        out = os.path.join(OUT, name + ".md")
        _write(out, KINDS[kind](path, d))
        written.append(out)
    return written


def setup(app):
    app.connect("builder-inited", lambda app: generate())
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for p in generate():
        print(p)
