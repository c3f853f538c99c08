"""Top-k/top-p truncation: bisection thresholds (``jaxspec.sampling.truncate``) vs a full
vocabulary sort, side by side on this machine, and the cost of each sampling setting inside
SmolLM2 generation (plain and n-gram speculative), as ratios to greedy decoding of the same
drafter (different settings emit different text, so the n-gram rows differ in tau too).

    python -m benchmarks.experiments.bench_truncation    # benchmarks/results/truncation_smollm2-135m_<host kind>_<date>

Writes ``OUT.json`` (machine, versions, command, medians) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.sampling import truncate


def sort_truncate(probs, top_k, top_p, min_p):
    """The same truncation by sorting the vocabulary (Hugging Face / vLLM GPU style)."""
    order = jnp.argsort(-probs, axis=-1)
    srt = jnp.take_along_axis(probs, order, axis=-1)
    k = top_k[:, None, None]
    rank = jnp.arange(probs.shape[-1])
    srt = jnp.where((k > 0) & (rank >= k), 0.0, srt)
    srt = srt / srt.sum(-1, keepdims=True)
    above = jnp.cumsum(srt, axis=-1) - srt
    srt = jnp.where(above >= top_p[:, None, None], 0.0, srt)
    srt = jnp.where(srt < min_p[:, None, None] * srt[..., :1], 0.0, srt)
    out = jnp.zeros_like(probs).at[jnp.arange(probs.shape[0])[:, None, None], jnp.arange(probs.shape[1])[None, :, None],
                                   order].set(srt)
    return out / out.sum(-1, keepdims=True)


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def truncation_table(reps: int) -> list[dict]:
    rows = []
    for v in (49152, 262144):
        for t in (1, 5, 11):
            logits = jax.random.normal(jax.random.key(0), (1, t, v)) * 3
            probs = jax.nn.softmax(logits, -1)
            k, p, m = jnp.array([50]), jnp.array([0.9]), jnp.array([0.0])
            a = np.asarray(jax.jit(truncate)(probs, k, p, m))
            b = np.asarray(jax.jit(sort_truncate)(probs, k, p, m))
            # Tied probabilities at the threshold: bisection keeps all of them, a sort an arbitrary
            # subset; count only differences that are not such ties.
            pr = np.asarray(probs)
            differ = (a > 0) != (b > 0)
            kept_values = [set(pr[0, i][b[0, i] > 0].tolist()) for i in range(t)]
            untied = sum(1 for i, j in zip(*np.nonzero(differ[0])) if pr[0, i, j] not in kept_values[i])
            same_support = untied == 0
            bis = _time(jax.jit(truncate), probs, k, p, m, reps=reps)
            srt = _time(jax.jit(sort_truncate), probs, k, p, m, reps=reps)
            rows.append({"vocab": v, "positions": t, "bisection_ms": bis * 1e3, "sort_ms": srt * 1e3,
                         "sort_over_bisection": srt / bis, "same_support_up_to_ties": same_support,
                         "tied_tokens_differing": int(differ.sum())})
            print(f"V={v:6d} T={t:2d}: bisection {bis * 1e3:7.2f} ms, sort {srt * 1e3:7.2f} ms, "
                  f"sort/bisection {srt / bis:5.2f}, same support (up to ties) {same_support}", flush=True)
    return rows


SETTINGS = {
    "greedy": {},
    "greedy+penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.1},
    "T=0.7": {"temperature": 0.7},
    "T=0.7+top_k+top_p": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
    "T=0.7+min_p": {"temperature": 0.7, "min_p": 0.05},
    "greedy+stop strings": {"stop": ["\n\n\n", "The End"]},
    "greedy+logprobs 5": {"logprobs": 5},
}


def generation_table(new_tokens: int, reps: int) -> list[dict]:
    """Per-token time of SmolLM2 generation under each setting, runs interleaved round-robin
    (other tenants' load hits every setting alike); ratios to greedy of the same drafter."""
    model = jaxspec.load("smollm2-135m")
    prompt = "Write a short story about a robot who learns to paint. Use simple words."
    rows = []
    for drafter in (None, jaxspec.NGramDrafter(gamma=4)):
        name = "plain" if drafter is None else "ngram g4"

        def run(kw):
            return jaxspec.generate(model, prompt, chat=True, drafter=drafter, max_new_tokens=new_tokens,
                                    ignore_eos=True, seed=0, **kw)

        times = {label: [] for label in SETTINGS}
        taus = {label: run(kw).metrics.tau for label, kw in SETTINGS.items()}  # compiles
        for _ in range(reps):
            for label, kw in SETTINGS.items():
                times[label].append(run(kw).metrics.run_s / new_tokens * 1e3)
        base = statistics.median(times["greedy"])
        for label in SETTINGS:
            ms = statistics.median(times[label])
            rows.append({"drafter": name, "setting": label, "ms_per_token": ms, "relative_to_greedy": ms / base,
                         "tau": taus[label]})
            print(f"{name:9s} {label:22s} {ms:6.2f} ms/token ({ms / base:.3f}x greedy's), tau {taus[label]:.2f}",
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="path without .json (default: benchmarks/results/truncation_smollm2-135m_<host>_<date>)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gen-reps", type=int, default=4)
    ap.add_argument("--skip-generation", action="store_true")
    args = ap.parse_args()
    from benchmarks.bench_env import command, result_stem

    args.out = args.out or result_stem("truncation", "smollm2-135m")
    result = {
        "command": command(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "backend": jax.default_backend(),
                    "devices": [str(d) for d in jax.devices()]},
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "truncation": truncation_table(args.reps),
    }
    if not args.skip_generation:
        result["generation"] = generation_table(args.new_tokens, args.gen_reps)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
