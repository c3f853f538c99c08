"""Where a generate call's device time goes, by XLA op kind: one profiled call
(``jax.profiler`` with a Perfetto trace) after a warm-up call, the trace's per-thunk events
summed by op name with its numeric suffix dropped (``dot.4064`` -> ``dot``), as a table of
ms, share and count per step.

XLA:CPU records one event per executed thunk (a fusion, a dot, a copy, ...); on GPU the
trace holds the kernels' events likewise. Use it to find what a step spends on besides the
weights' matrix products, e.g. copies or transposes of the KV cache (``copy``,
``copy_bitcast_fusion`` of cache-shaped buffers: see the optimized HLO,
``jaxspec.api._COMPILED[key].as_text()``).

Run from the repository root::

    python -m benchmarks.profile_ops --model smollm2-135m --prompt-tokens 800 --max-new-tokens 64
    python -m benchmarks.profile_ops --drafter ngram --gamma 4      # a speculative call
    python -m benchmarks.profile_ops --drafter ngram --chat --prompt-text "Compose an engaging travel blog post..."
        # a prompt where prompt lookup rarely matches: what a step without drafts costs
    python -m benchmarks.profile_ops --pass-widths 1,9 [--dtype bfloat16]  # one verify pass

``--pass-widths`` profiles the verify pass of ``benchmarks.bench_pass_cost`` alone (``--reps``
calls per width after two warm-ups) and reports ms per pass by instruction, each named with
its kind: a custom call by its target (``jaxspec_cpu_matmul_panels``, the attention kernel),
a fusion by its root op's kind, so the weight products can be told from the rest of the pass.

Writes ``--out`` (JSON: command, machine, versions, settings, per-kind ms and counts) when given.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

from benchmarks.bench_env import machine_info, versions, write_record

# trace events that are not ops: the runtime's own spans, Python frames, thread-pool waits
# (a loop's or a conditional's span, "while.N" / "cond.N", wraps its body's ops, which are counted)
NOT_OPS = ("ThunkExecutor", "$", "np.", "SlinkyThreadPool", "end: ", "while", "cond", "call")


def op_times(trace_file: str, keep_suffix: bool = False) -> dict[str, tuple[float, int]]:
    """``{op kind: (total ms, events)}`` of a Perfetto ``*.trace.json.gz``: complete events
    ("ph" X) whose names are ops, summed by name without its numeric suffix (with it, by
    instruction, when ``keep_suffix``)."""
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ms, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["name"].startswith(NOT_OPS):
            continue
        kind = e["name"] if keep_suffix else re.sub(r"\.\d+$", "", e["name"])
        ms[kind] += e.get("dur", 0) / 1e3
        count[kind] += 1
    return {k: (ms[k], count[k]) for k in sorted(ms, key=ms.get, reverse=True)}


def instruction_kinds(hlo_text: str) -> dict[str, str]:
    """``{instruction name: kind}`` from an optimized HLO module's text: a custom call's target,
    a fusion's kind and its fused computation's root op (``loop:add``), else the opcode."""
    roots = {}
    comp = None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            comp = m.group(1)
        m = re.match(r"^\s+ROOT %?[\w.\-]+ = \S+ ([\w\-]+)\(", line)
        if m and comp:
            roots[comp] = m.group(1)
    kinds = {}
    for m in re.finditer(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\((.*)$", hlo_text, re.M):
        name, op, rest = m.groups()
        if op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', rest)
            kinds[name] = t.group(1) if t else op
        elif op == "fusion":
            k = re.search(r"kind=k(\w+)", rest)
            c = re.search(r"calls=%?([\w.\-]+)", rest)
            kinds[name] = f"fusion {k.group(1).lower() if k else ''}:{roots.get(c.group(1), '?') if c else '?'}"
        else:
            kinds[name] = op
    return kinds


def profile_passes(args, argv) -> int:
    """``--pass-widths``: ms per verify pass by instruction kind, for each width."""
    import jax

    import jaxspec
    from benchmarks.bench_pass_cost import verify_args, verify_pass
    from jaxspec.kernels import cpu_matmul

    started = _dt.datetime.now(_dt.timezone.utc)
    model = jaxspec.load(args.model, dtype=args.dtype)
    cfg, params = model.config, model.params
    fn = jax.jit(lambda *a: verify_pass(cfg, *a), compiler_options=cpu_matmul.compiler_options(jax.default_backend()))
    record = {"command": "python -m benchmarks.profile_ops " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": started.isoformat(), "machine": {**machine_info(), "backend": jax.default_backend()},
              "versions": versions(), "settings": vars(args), "widths": {}}
    for t in (int(w) for w in args.pass_widths.split(",")):
        call = verify_args(cfg, params["embed"].dtype, t, 512, 200)
        kinds = instruction_kinds(fn.lower(params, *call).compile().as_text())
        for _ in range(2):
            fn(params, *call).block_until_ready()
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp, create_perfetto_trace=True)
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn(params, *call).block_until_ready()
            wall = (time.perf_counter() - t0) / args.reps * 1e3
            jax.profiler.stop_trace()
            traces = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
            if not traces:
                raise SystemExit(f"error: jax.profiler wrote no Perfetto trace under {tmp}")
            ops = op_times(traces[0], keep_suffix=True)
        by_kind = collections.Counter()
        for name, (ms, _) in ops.items():
            if name in kinds:  # the program's instructions, not the runtime's host spans
                by_kind[kinds[name]] += ms / args.reps
        total = sum(by_kind.values())
        print(f"{args.model} {args.dtype or 'float32'} T={t}: {wall:.1f} ms per pass (wall, profiled), "
              f"op time {total:.1f} ms (ops on all threads add up)")
        for kind, ms in by_kind.most_common(args.top):
            print(f"  {ms:7.2f} ms {100 * ms / total:5.1f}%  {kind}")
        record["widths"][t] = {"wall_ms": wall, "op_ms": total, "by_kind_ms": dict(by_kind.most_common())}
    record["elapsed_s"] = (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()
    if args.out:
        write_record(record, args.out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="packaged name, .gguf or HF directory (smollm2-135m)")
    ap.add_argument("--drafter", choices=("none", "ngram"), default="none", help="none: plain decoding (default)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prompt length in tokens (random text ids)")
    ap.add_argument("--prompt-text", default=None,
                    help="a text prompt instead of random ids (e.g. a Spec-Bench question: where n-gram finds no match)")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt-text in the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15, help="rows printed (15)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--pass-widths", default=None, help="comma-separated T: profile one verify pass of T tokens instead")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="parameter dtype (jaxspec.load)")
    ap.add_argument("--reps", type=int, default=20, help="profiled passes per width (--pass-widths)")
    args = ap.parse_args(argv)
    if args.pass_widths:
        return profile_passes(args, argv)
    if args.prompt_tokens < 1 or args.max_new_tokens < 2 or args.gamma < 1:
        ap.error("--prompt-tokens >= 1, --max-new-tokens >= 2 and --gamma >= 1 are required")

    import jax
    import numpy as np

    import jaxspec

    started = _dt.datetime.now(_dt.timezone.utc)
    model = jaxspec.load(args.model)
    if args.prompt_text is not None:
        prompt = args.prompt_text
    else:  # a repeated span, so that prompt lookup finds matches
        rng = np.random.default_rng(0)
        span = rng.integers(100, model.config.vocab_size - 100, max(1, args.prompt_tokens // 4)).tolist()
        prompt = (span * 4 + span)[: args.prompt_tokens]
    drafter = None if args.drafter == "none" else jaxspec.NGramDrafter(gamma=args.gamma)
    kw = dict(drafter=drafter, max_new_tokens=args.max_new_tokens, ignore_eos=True, chat=args.chat)
    jaxspec.generate(model, [prompt], **kw)  # compile and warm up
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        t0 = time.perf_counter()
        out = jaxspec.generate(model, [prompt], **kw)
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        traces = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not traces:
            raise SystemExit(f"error: jax.profiler wrote no Perfetto trace under {tmp}")
        ops = op_times(traces[0])
    steps = int(np.sum(out.metrics.verify_steps))  # target forwards after the prefill
    total = sum(ms for ms, _ in ops.values())
    drafted = int(np.sum(out.metrics.drafted))
    print(f"{args.model}, drafter {args.drafter}, prompt {len(prompt)} {'chars' if isinstance(prompt, str) else 'tokens'}, "
          f"{args.max_new_tokens} new: {steps} verify steps ({drafted} draft nodes), wall {wall:.2f} s (profiled), "
          f"op time {total / 1e3:.2f} s (ops on all threads add up)")
    for kind, (ms, n) in list(ops.items())[: args.top]:
        print(f"  {ms:9.1f} ms {100 * ms / total:5.1f}%  {n:7d}  {kind}")
    if args.out:
        record = {"command": "python -m benchmarks.profile_ops " +
                             " ".join(sys.argv[1:] if argv is None else argv),
                  "started": started.isoformat(), "machine": {**machine_info(), "backend": jax.default_backend()},
                  "versions": versions(), "settings": vars(args), "prompt_length": len(prompt), "drafted": drafted, "wall_s": wall,
                  "steps": steps, "op_ms_total": total,
                  "ops": {k: {"ms": ms, "events": n} for k, (ms, n) in ops.items()},
                  "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()}
        write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
