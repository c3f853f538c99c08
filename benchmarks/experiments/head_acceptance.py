"""Does a trained draft head draft as well at serving time as training said it would, and how
much of that carries over to other prompts? Greedy tau and acceptance per draft position of
an EAGLE-3 head (or Medusa-1 heads, ``--kind medusa1``: a chain of their argmaxes) on (a) prompts held out of its training (the trainer's own seeded split of
``--sequences``), (b) prompts it was trained on, (c) Spec-Bench questions (first turn, chat
template), each compared with plain decoding (outputs must be identical).

A head whose held-out serving acceptance matches training's held-out top-1 agreement but
drops on (c) has a data problem (distribution shift), not a drafting bug.

    python -m benchmarks.experiments.head_acceptance --sequences checkpoints_tools/data/smollm2-135m-answers.json

Writes ``--out``.json (machine, versions, command, per set and gamma: tau, acceptance per
position, identical). No timing: tau is a count, so the machine's load does not move it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import bench_env
from benchmarks.spec_bench import QUESTIONS, load_questions


def main(argv=None) -> int:
    import jaxspec
    from checkpoints_tools import drafter_data, head_dataset, trainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kind", default="eagle3", choices=["eagle3", "medusa1"])
    ap.add_argument("--head", "--eagle-head", default=None, help="default: the head of --kind shipped for --model")
    ap.add_argument("--sequences", required=True, help="the training answers (train-eagle's --sequences)")
    ap.add_argument("--seed", type=int, default=trainer.TrainConfig.seed, help="the training run's --seed")
    ap.add_argument("--holdout", type=float, default=trainer.TrainConfig.holdout)
    ap.add_argument("--n", type=int, default=8, help="prompts per set")
    ap.add_argument("--gammas", default="2,4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or bench_env.result_stem("head_acceptance", f"{args.model}-{args.kind}")

    model = jaxspec.load(args.model)
    head = args.head or jaxspec.shipped_head(args.model, args.kind)
    seqs = drafter_data.load_sequences(args.sequences, model.params)
    train, held_out = head_dataset.split_indices(len(seqs), trainer.TrainConfig(seed=args.seed,
                                                                                holdout=args.holdout))
    tok = model.tokenizer
    spec_bench = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q["text"]}]), add_bos=False)
                  for q in load_questions(QUESTIONS, 1)[: args.n]]
    sets = {"held_out": [seqs[i][0][: seqs[i][1]] for i in held_out[: args.n]],
            "trained_on": [seqs[i][0][: seqs[i][1]] for i in train[: args.n]],
            "spec_bench": spec_bench}
    results = {}
    for name, prompts in sets.items():
        plain = jaxspec.generate(model, prompts, max_new_tokens=args.max_new_tokens)
        for g in (int(x) for x in args.gammas.split(",")):
            drafter, params = (jaxspec.load_eagle_head(head, model, gamma=g) if args.kind == "eagle3"
                               else jaxspec.load_medusa_heads(head, model, topk=(1,) * g))
            res = jaxspec.generate(model, prompts, max_new_tokens=args.max_new_tokens, drafter=drafter,
                                   drafter_params=params)
            m = res.metrics
            row = {"tau": round(float(m.tau), 3), "identical": res.tokens == plain.tokens,
                   "acceptance_per_position": (m.accepted_at.sum(0) / m.verify_steps.sum()).round(3).tolist()}
            results[f"{name}_g{g}"] = row
            print(name, f"gamma {g}", row, flush=True)
    record = {"benchmark": "head_acceptance", "command": bench_env.command(), "machine": bench_env.machine_info(),
              "versions": bench_env.versions(), "head": os.path.relpath(head), "settings": vars(args),
              "results": results}
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
