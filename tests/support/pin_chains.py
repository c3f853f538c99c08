"""Write ``tests/data/pinned_chains.json``: the tokens the chain engine gave BEFORE drafts
became trees (commit b0ce9ac), for fixed seeds, so ``test_trees.py`` can prove that a chain
through the tree code gives the same tokens (issue 9, point 4).

Run once from the repository root: ``PYTHONPATH=. python tests/support/pin_chains.py``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for conftest
import jax  # noqa: E402

from conftest import DRAFT, TARGET, Tiny, _noisy_copy  # noqa: E402
from jaxspec import models  # noqa: E402

CASES = [  # (drafter kind, gamma, settings)
    ("plain", 0, {}),
    ("ngram", 3, {}),
    ("model_noisy", 4, {}),
    ("early_exit", 2, {}),
    ("plain", 0, {"temperature": 1.0, "seed": 3}),
    ("ngram", 3, {"temperature": 1.0, "seed": 3}),
    ("model_noisy", 4, {"temperature": 1.0, "seed": 3}),
    ("model_small", 3, {"temperature": 0.7, "top_k": 5, "seed": 11}),
    ("early_exit", 2, {"temperature": 1.0, "top_p": 0.8, "seed": 5}),
    ("ngram", 4, {"temperature": 0.8, "repetition_penalty": 1.3, "seed": 7}),
    ("model_noisy", 3, {"temperature": 1.0, "presence_penalty": 0.5, "min_new_tokens": 5, "seed": 2}),
]


def tiny() -> Tiny:
    params = models.init_params(TARGET, jax.random.key(0), scale=1.0)
    return Tiny(cfg=TARGET, params=params, draft_cfg=DRAFT,
                draft_params=models.init_params(DRAFT, jax.random.key(1), scale=1.0),
                noisy_params=_noisy_copy(params, jax.random.key(2), 0.1))


def run(t: Tiny, kind, gamma, settings):
    out = t.generate(t.prompts, kind, gamma, **settings)
    return {"tokens": out.tokens, "accepted": out.metrics.accepted.tolist(), "drafted": out.metrics.drafted.tolist()}


if __name__ == "__main__":
    t = tiny()
    pinned = [{"kind": k, "gamma": g, "settings": s, **run(t, k, g, s)} for k, g, s in CASES]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "pinned_chains.json")
    with open(path, "w") as f:
        json.dump(pinned, f, indent=1)
    print("wrote", path, len(pinned), "cases")
