"""Greedy speculative decoding == plain decoding, token for token, on whatever device jax runs
on, in bfloat16 and float32: the check to run on every new accelerator.

The engine's invariant (docs/design.md, invariant 1) is proven on CPU in float32 by the test suite.
On an accelerator a verify pass of T tokens runs other kernels than plain decoding's 1-token
pass (another matmul tiling, split-K, TF32 for float32 by default on NVIDIA), so its logits
can differ in the last bits, and at a near-tie the greedy token flips: the output then
differs from plain decoding although every rule is exact. This script measures how often.

Random weights (``models.init_params``, scale ``--scale``: random models have flat
next-token distributions, hence many near-ties, so this is a hard case), prompts of random
tokens with a repeated span (so prompt lookup matches), batch 1 and 3, ``ignore_eos``, and
these drafters against plain decoding of the same params:

- ``ngram_chain``: ``NGramDrafter(gamma=4, min_n=1)``;
- ``ngram_tree``: ``NGramDrafter(gamma=4, min_n=1, branches=2, branch_min_n=1)``;
- ``self_draft``: ``ModelDrafter`` with the target's own weights (gamma 4): drafts are the
  target's 1-token greedy tokens, so nearly every one is accepted and a difference can only
  come from the verify pass's numerics;
- ``lookahead``: ``LookaheadDrafter(5, 4, 5)`` (31-token windows).

Per case: rows identical to plain, the first differing position of each other row, tau; the
same against "window plain", plain greedy decoding computed in a (gamma + 1)-token verify
window (``window_plain``), and window plain against plain: if speculative output equals
window plain where it differs from plain, the difference is the window's width alone (its
kernels), and plain decoding run in the verify's window would make the two agree.
Nothing is asserted: the JSON and the printed table are the record
(``benchmarks/results/greedy_exactness_<device kind>_<date>.json``).

Run from the repository root::

    python -m benchmarks.greedy_exactness              # default shapes
    python -m benchmarks.greedy_exactness --shapes tiny --max-new-tokens 16   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time

from benchmarks.bench_env import machine_info, result_stem, versions, write_record


def shapes() -> dict:
    """``{name: ModelConfig}``: the test suite's tiny target, and a small Llama-like shape (4
    layers, d 1024, GQA 16/4, vocab 32000) whose matmuls are large enough for an
    accelerator's GEMM library to pick shape-dependent kernels."""
    from jaxspec.config import ModelConfig

    return {
        "tiny": ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                            max_position=512, name="tiny"),
        "small": ModelConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=64,
                             ffn_dim=4096, rope_theta=500000.0, max_position=4096, name="small"),
    }


def prompts(vocab: int, seed: int) -> list[list[int]]:
    """Three prompts (21, 7 and 30 tokens) of random tokens, each with a span repeated."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for n, span in ((9, 6), (4, 3), (12, 9)):
        head = rng.integers(0, vocab, n).tolist()
        rep = rng.integers(0, vocab, span).tolist()
        out.append(head + rep + rep)
    return out


def drafters(config, gamma: int) -> dict:
    import jaxspec

    return {
        "ngram_chain": (jaxspec.NGramDrafter(gamma=gamma, min_n=1), None),
        "ngram_tree": (jaxspec.NGramDrafter(gamma=gamma, min_n=1, branches=2, branch_min_n=1), None),
        "self_draft": (jaxspec.ModelDrafter(config, gamma=gamma, confidence=0.0), "target"),
        "lookahead": (jaxspec.LookaheadDrafter(window=5, ngram=4, guesses=5), None),
    }


def first_differences(rows: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per row, the first token index where ``rows`` differs from ``reference`` (None: equal; a
    row that is a proper prefix of the other differs where the shorter one ends)."""
    def first(r, ref):
        i = next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), None)
        return min(len(r), len(ref)) if i is None and len(r) != len(ref) else i

    return [first(r, ref) for r, ref in zip(rows, reference, strict=True)]


def window_plain(params, rows, gamma: int, kw: dict) -> list[list[int]]:
    """Plain greedy decoding computed in a (gamma + 1)-token verify window: ``RepeatDrafter``
    with every draft rejected (synthetic acceptance at tau 1), so each step emits the root's
    argmax, as plain decoding does, from the same kernels a speculative verify runs. Equal to
    plain decoding where a window's logits equal a 1-token pass's; the reference that tells
    whether a difference comes from the window's width alone."""
    import warnings

    import jaxspec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxspec.synthetic.SyntheticAcceptanceWarning)
        return jaxspec.generate(params, rows, drafter=jaxspec.RepeatDrafter(gamma),
                                synthetic_acceptance=jaxspec.SyntheticAcceptance.from_tau(1, gamma),
                                allow_synthetic_acceptance=True, **kw).tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,small", help="comma-separated: tiny, small (default both)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="param dtypes (bfloat16,float32)")
    ap.add_argument("--seeds", type=int, default=2, help="weight/prompt seeds per shape and dtype (2)")
    ap.add_argument("--scale", type=float, default=1.0, help="init_params scale (1.0)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per row (64)")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--drafters", default="ngram_chain,ngram_tree,self_draft,lookahead", help="which drafters (all)")
    ap.add_argument("--min-pass-tokens", type=int, default=None, help="run every target pass with at least this "
                    "many tokens (jaxspec.engine.MIN_PASS_TOKENS for this backend; default: as set there)")
    ap.add_argument("--out", default=None, help="output JSON path")
    args = ap.parse_args(argv)
    known = ("ngram_chain", "ngram_tree", "self_draft", "lookahead")
    if args.min_pass_tokens is not None and args.min_pass_tokens < 1:
        ap.error(f"--min-pass-tokens must be >= 1, got {args.min_pass_tokens}")
    if not set(args.drafters.split(",")) <= set(known):
        ap.error(f"--drafters: a comma-separated subset of {', '.join(known)}, got {args.drafters!r}")
    if not set(args.shapes.split(",")) <= {"tiny", "small"}:
        ap.error(f"--shapes: a comma-separated subset of tiny, small, got {args.shapes!r}")

    from jaxspec import engine

    least = engine.min_pass_tokens() if args.min_pass_tokens is None else args.min_pass_tokens
    with engine.min_pass_tokens_set(least):  # for this run only (tests call main in-process)
        return _run(args, argv, least)


def _run(args, argv, least: int) -> int:
    """``main``'s body, with every target pass at least ``least`` tokens wide."""
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec import models, policy

    # exactness at every batch size: no policy turning speculation off (as tests/conftest.py)
    policy.MEASURED.clear()
    policy.BREAK_EVEN.clear()
    all_shapes = shapes()
    started = _dt.datetime.now(_dt.timezone.utc)
    t_start = time.perf_counter()
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()})", flush=True)
    cases, windows = [], []
    for name in args.shapes.split(","):
        config = all_shapes[name]
        for dtype in args.dtypes.split(","):
            for seed in range(args.seeds):
                params = models.init_params(config, jax.random.key(seed), dtype=jnp.dtype(dtype), scale=args.scale)
                batch = prompts(config.vocab_size, seed)
                kw = dict(config=config, ignore_eos=True, max_new_tokens=args.max_new_tokens)
                for rows in (batch[:1], batch):
                    plain = jaxspec.generate(params, rows, **kw).tokens
                    window = window_plain(params, rows, args.gamma, kw)
                    for dname, (drafter, dparams) in drafters(config, args.gamma).items():
                        if dname not in args.drafters.split(","):
                            continue
                        extra = {"drafter_params": params} if dparams == "target" else {}
                        out = jaxspec.generate(params, rows, drafter=drafter, **kw, **extra)
                        first, first_w = first_differences(out.tokens, plain), first_differences(out.tokens, window)
                        case = {"shape": name, "dtype": dtype, "seed": seed, "batch": len(rows), "drafter": dname,
                                "rows_identical": sum(f is None for f in first), "rows": len(rows),
                                "first_difference": first, "tau": out.metrics.tau,
                                "rows_identical_to_window_plain": sum(f is None for f in first_w),
                                "first_difference_window_plain": first_w}
                        cases.append(case)
                        print(f"{name:5s} {dtype:8s} seed {seed} B{len(rows)} {dname:11s} "
                              f"identical {case['rows_identical']}/{case['rows']} first diff {first} "
                              f"(to window plain: {case['rows_identical_to_window_plain']}/{case['rows']} {first_w}) "
                              f"tau {out.metrics.tau:.2f}", flush=True)
                    first = first_differences(window, plain)
                    windows.append({"shape": name, "dtype": dtype, "seed": seed, "batch": len(rows),
                                    "rows_identical": sum(f is None for f in first), "rows": len(rows),
                                    "first_difference": first})
                    print(f"{name:5s} {dtype:8s} seed {seed} B{len(rows)} window plain vs plain: identical "
                          f"{windows[-1]['rows_identical']}/{len(rows)} first diff {first}", flush=True)
            jaxspec.api._COMPILED.clear()  # this shape and dtype's programs are done with
    total = sum(c["rows"] for c in cases)
    same = sum(c["rows_identical"] for c in cases)
    print(f"rows identical to plain: {same}/{total}")
    stem = args.out or result_stem("greedy_exactness", "-".join(args.shapes.split(",") + args.dtypes.split(",")), started)
    path = stem if stem.endswith(".json") else stem + ".json"
    record = {"command": "python -m benchmarks.greedy_exactness " +
                         " ".join(sys.argv[1:] if argv is None else argv),
              "started": started.isoformat(),
              "machine": {**machine_info(), "backend": jax.default_backend(), "device_kind": device.device_kind,
                          "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
              "versions": versions(), "settings": vars(args), "min_pass_tokens": least,
              "rows_identical": same, "rows": total, "cases": cases,
              "window_plain_vs_plain": windows,
              "elapsed_s": time.perf_counter() - t_start}
    write_record(record, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
