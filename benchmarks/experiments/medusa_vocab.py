"""Which output head should Medusa-1 heads train and draft through? The target's whole frozen
head, or only its rows of a reduced draft vocabulary (the Vd most frequent answer tokens), and
every position of a row or only its answer span: held-out top-1 agreement per head and median
seconds per optimizer step, on the same data, seed and steps (issue 11: "choose by measurement").

    python -m benchmarks.experiments.medusa_vocab [STEPS]      # default 40; quiet machine

Data: the shipped SmolLM2 answers (``checkpoints_tools/data/smollm2-135m-answers.json``), target
features built once into ``runs/medusa-data``. Writes
``benchmarks/results/medusa_vocab_smollm2-135m_<host kind>_<date>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from benchmarks import bench_env


def main(argv=None) -> int:
    import jaxspec
    from checkpoints_tools import drafter_data, head_dataset, trainer
    from checkpoints_tools.train_medusa import MedusaRecipe

    argv = sys.argv[1:] if argv is None else argv
    steps = int(argv[0]) if argv else 40
    model = jaxspec.load("smollm2-135m")
    seqs = drafter_data.load_sequences("checkpoints_tools/data/smollm2-135m-answers.json", model.params)
    cfg = trainer.TrainConfig(draft_vocab=8192, steps=steps, batch=8, lr=1e-3, warmup=5, eval_every=steps,
                              save_every=steps)
    if not os.path.exists("runs/medusa-data/data.npz"):  # the features, once (one step of training)
        trainer.run(model, [], dataclasses.replace(cfg, steps=1, warmup=0, eval_every=1, save_every=1),
                    "runs/medusa-data", sequences=seqs, medusa_heads=4)
    data = head_dataset.Dataset.load("runs/medusa-data/data.npz")
    answer = head_dataset.answer_span(data.loss_mask)
    step_times = []
    step = trainer._train_step

    def timed_step(*a, **k):
        t0 = time.time()
        r = step(*a, **k)
        r[2].block_until_ready()
        step_times.append(time.time() - t0)
        return r

    trainer._train_step = timed_step
    results = {}
    for name, vd, span, n in (("reduced_8192", 8192, answer, steps), ("full", 0, answer, steps),
                              ("reduced_8192_every_position", 8192, 0, 10)):  # the last: timing only
        d = data if vd else dataclasses.replace(data, d2t=np.zeros((0,), np.int32))
        step_times.clear()
        c = dataclasses.replace(cfg, draft_vocab=vd, steps=n, eval_every=n, save_every=n)
        r = trainer.train(model.params, model.config, d, c, f"runs/medusa-{name}",
                          recipe=MedusaRecipe(model.config, 4, vd, span=span), write_head=False)
        results[name] = {"steps": n, "median_step_s": float(np.median(step_times[1:])), "initial": r["initial"],
                         "final": r["final"]}
        print(name, results[name], flush=True)
    record = {"benchmark": "medusa_vocab", "command": bench_env.command(), "machine": bench_env.machine_info(),
              "versions": bench_env.versions(), "batch": cfg.batch, "span": answer, "results": results}
    out = bench_env.result_stem("medusa_vocab", "smollm2-135m") + ".json"
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
