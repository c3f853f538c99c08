"""Why an EAGLE head's acceptance drops from its own data to Spec-Bench: is the head worse on
the new prompts, or are the target's answers to them less certain? Per set of prompts (the
first ``--n`` prompts of each ``--set`` file of answered sequences, e.g. the head's training
data and files it never saw; and Spec-Bench's first turns, ``--per-category`` per category),
the target answers greedily (plain decoding); one teacher-forced target pass over each
prompt + answer gives, at every answer position, the target's top-1 probability p_max (full
vocabulary) and its argmax, and one head pass over the same text (the target's fused
features, as the head's first draft step sees them: EAGLE-3, Li et al. 2025, Sec. 3) gives
the head's first draft. Positions are binned by p_max; per bin: the share of positions, the
head's top-1 agreement with the target (the chance its first greedy draft is accepted) and
top-k coverage (a tree's first level with k branches).

If the head's agreement within each bin is about the same on every set, the drop comes from
how the positions fall into the bins (the answers are less certain), not from the head
failing to generalise; more training data of the same kind then cannot close it. For the
SmolLM2 head that ships it is the other way round (docs/training.md, "What limits a
head's acceptance"): the same p_max on every set, half the agreement on prompts of an unseen kind.

    python -m benchmarks.experiments.head_confidence \
        --training-files checkpoints_tools/data/smollm2-135m-answers.json,checkpoints_tools/data/smollm2-135m-instruct-answers.json \
        --set trained=checkpoints_tools/data/smollm2-135m-instruct-answers.json \
        --set unseen=checkpoints_tools/data/smollm2-135m-instruct2-answers.json \
        --set magpie=checkpoints_tools/data/smollm2-135m-magpie-answers.json

(the shipped SmolLM2 head's training files, in their order: a ``--set`` file among them keeps
only the rows that the training run's seeded split trained on, ``head_dataset.split_indices``).

Writes ``--out``.json (machine, versions, command, per set: positions, mean p_max, per bin
share / agreement / top-k coverage). Counts only: the machine's load does not move them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks import bench_env
from benchmarks.spec_bench import QUESTIONS, load_questions

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-6)  # p_max bin edges, the last closed


def position_stats(model, drafter, head_params, seq: list[int], n_prompt: int, topk: int):
    """Per answer position of ``seq`` (prompt + the target's greedy answer): the target's
    p_max and whether the head's first draft (top-1, top-``topk``) is its argmax.

    Returns four numpy arrays over the entries t = n_prompt - 1 .. len - 3, each scoring the
    token at t + 2 from the target feature of t and the token at t + 1 (``jaxspec.drafters.
    eagle``): p_max float32, top1 bool, topk bool, and the target's argmax int (the token at
    t + 2 where ``seq`` is the target's greedy text)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec import models
    from jaxspec.cache import KVCache
    from jaxspec.models import eagle3

    cfg, hcfg = model.config, drafter.config
    t = len(seq)
    tokens = jnp.asarray([seq], jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    out = models.forward(model.params, cfg, tokens, positions, KVCache.zeros(cfg, 1, t, model.params["embed"].dtype),
                         capture=hcfg.capture)
    probs = jax.nn.softmax(out.logits[0].astype(jnp.float32), axis=-1)
    p_max, target_top = np.asarray(probs.max(-1)), np.asarray(probs.argmax(-1))
    feats = eagle3.fuse(head_params["head"], out.captured)
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    h = eagle3.forward(head_params["head"], hcfg, model.params["embed"], nxt, feats, positions,
                       eagle3.empty_cache(hcfg, 1, t, feats.dtype))
    _, ids = jax.lax.top_k(h.logits[0], topk)
    drafted = np.asarray(head_params["d2t"])[np.asarray(ids)]  # [T, topk] target ids
    entries = np.arange(max(n_prompt - 1, 0), t - 2)
    want = target_top[entries + 1]
    return p_max[entries + 1], drafted[entries, 0] == want, (drafted[entries] == want[:, None]).any(-1), want


def summarize(p_max, top1, topk) -> dict:
    """Positions, mean p_max, agreement and top-k coverage overall and per ``BINS`` bin of p_max
    (share of positions, agreement, coverage; None for an empty bin) of ``position_stats``'
    arrays, concatenated over a set."""
    import numpy as np

    bins = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (p_max >= lo) & (p_max < hi)
        n = int(sel.sum())
        label = f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}"
        bins.append({"p_max": label, "share": round(n / len(p_max), 3),
                     "agreement": round(float(top1[sel].mean()), 3) if n else None,
                     "topk_coverage": round(float(topk[sel].mean()), 3) if n else None})
    return {"positions": int(len(p_max)), "mean_p_max": round(float(np.mean(p_max)), 3),
            "agreement": round(float(np.mean(top1)), 3), "topk_coverage": round(float(np.mean(topk)), 3), "bins": bins}


def training_rows(files: list[str], target_params, seed: int, holdout: float) -> dict:
    """``{absolute path: sorted row indices}``: the rows of each training file that a training
    run over ``files`` concatenated in this order, with ``seed`` and ``holdout``, trained on
    (its held-out rows left out: ``checkpoints_tools.head_dataset.split_indices``)."""
    from checkpoints_tools import drafter_data, head_dataset, trainer

    sizes = [len(drafter_data.load_sequences(f, target_params)) for f in files]
    train, _ = head_dataset.split_indices(sum(sizes), trainer.TrainConfig(seed=seed, holdout=holdout))
    out, start = {}, 0
    for f, n in zip(files, sizes):
        out[os.path.abspath(f)] = [int(i) - start for i in train if start <= i < start + n]
        start += n
    return out


def main(argv=None) -> int:
    import numpy as np

    import jaxspec
    from checkpoints_tools import drafter_data, trainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="EAGLE-3 head directory (default: the one shipped for --model)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=FILE",
                    help="a set of prompts: the first --n of FILE (answered sequences, train-eagle's "
                         "OUT/sequences.json form); repeatable; Spec-Bench is always the last set")
    ap.add_argument("--training-files", default="", help="comma-separated: the head's training --sequences "
                    "files in their order; rows of them that the training split held out are left out of --set files")
    ap.add_argument("--seed", type=int, default=trainer.TrainConfig.seed, help="the training run's --seed")
    ap.add_argument("--holdout", type=float, default=trainer.TrainConfig.holdout,
                    help="the training run's --holdout")
    ap.add_argument("--n", type=int, default=26, help="prompts per --set")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category")
    ap.add_argument("--topk", type=int, default=4, help="k of the top-k coverage")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out = args.out or bench_env.result_stem("head_confidence", args.model)

    model = jaxspec.load(args.model)
    head = args.head or jaxspec.shipped_head(args.model, "eagle3")
    drafter, head_params = jaxspec.load_eagle_head(head, model)
    trained_rows = training_rows([f for f in args.training_files.split(",") if f], model.params, args.seed,
                                 args.holdout)
    sets = {}
    for item in args.set:
        name, sep, path = item.partition("=")
        if not sep or not name or name == "spec_bench":
            raise SystemExit(f"error: --set {item!r}: expected NAME=FILE with a NAME other than spec_bench")
        seqs = drafter_data.load_sequences(path, model.params)
        rows = trained_rows.get(os.path.abspath(path), range(len(seqs)))
        sets[name] = [seqs[i][0][: seqs[i][1]] for i in list(rows)[: args.n]]
    tok = model.tokenizer
    sets["spec_bench"] = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q["text"]}]), add_bos=False)
                          for q in load_questions(QUESTIONS, args.per_category)]
    results = {}
    for name, prompts in sets.items():
        answers = jaxspec.generate(model, prompts, max_new_tokens=args.max_new_tokens).tokens
        parts = [position_stats(model, drafter, head_params, p + a, len(p), args.topk)
                 for p, a in zip(prompts, answers)]
        results[name] = summarize(*(np.concatenate(x) for x in list(zip(*parts))[:3]))
        print(name, json.dumps(results[name]), flush=True)
    bench_env.write_record({"benchmark": "head_confidence", "command": bench_env.command(),
                            "machine": bench_env.machine_info(), "versions": bench_env.versions(),
                            "head": os.path.relpath(head), "settings": vars(args),
                            "elapsed_s": time.perf_counter() - start, "results": results}, out + ".json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
