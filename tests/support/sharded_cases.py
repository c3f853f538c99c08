"""Helper of ``test_sharding.py``: runs sharded generation on virtual CPU devices in its own
process (the device count must be fixed before JAX starts, so not inside pytest) and prints
one JSON object on its last stdout line.

    python tests/support/sharded_cases.py single CKPT [NAME ...]  # 8 devices: every case (or the named
                                                          # ones), its unsharded reference,
                                                          # placement and error checks; writes
                                                          # an orbax checkpoint to CKPT
    python tests/support/sharded_cases.py multi PORT RANK CKPT    # one of 2 processes x 4 devices
                                                          # (jax.distributed, loopback coordinator)

The tiny target has 8 query heads and 2 KV heads, so a ``model`` axis of 4 or 8 exercises
the repeated KV heads; its MLP width and vocabulary divide by 8.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

MODE = sys.argv[1] if __name__ == "__main__" else "import"  # imported by the test: constants only
if MODE == "single":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

if MODE == "multi":
    from jaxspec import launch

    launch.initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[3]), cpu_devices=4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec  # noqa: E402
import jaxspec.api  # noqa: E402
from jaxspec import policy  # noqa: E402

policy.MEASURED.clear()  # sharded == unsharded is checked on speculation itself (see conftest.py)
policy.BREAK_EVEN.clear()
# The acceptance gate's case gates after 2 verify steps (its 10 new tokens leave room for the
# gate to act); programs without a gate carry the ring but never read it.
policy.GATE_WINDOW = 2
from jaxspec import sharding  # noqa: E402
from jaxspec import models as decoder  # noqa: E402

TARGET = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=4, ffn_dim=64,
                             max_position=512, name="tp-target")
# The same shape with every family switch that touches sharded tensors or their outputs: q/k/v
# biases (repeated with their KV heads), q/k norms, sandwich norms, tied (vocab-split)
# embeddings, embedding scale, soft-capping, a sliding layer with its own RoPE base, GeGLU.
FAMILIES = dataclasses.replace(
    TARGET, name="tp-families", attn_bias=True, qk_norm=True, sandwich_norms=True, tie_embeddings=True,
    embed_scale=32**0.5, norm_offset=1.0, final_softcap=30.0, sliding_window=4,
    layer_types=("sliding", "full"), rope_theta=1e5, rope_local_theta=1e4, activation="gelu_tanh")
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9], [11, 12, 13, 14, 15, 11, 12, 13], [3, 4, 3, 4]]
# Per-row settings are arrays, so they cost no compile. Batch 4: rows 0-1 greedy (row 1 with
# a repetition penalty), rows 2-3 sampled with top-p, top-k and a penalty.
SETTINGS = {4: dict(temperature=[0.0, 0.0, 1.0, 0.7], top_p=[1.0, 1.0, 0.9, 1.0], top_k=[0, 0, 0, 20],
                    repetition_penalty=[1.0, 1.3, 1.0, 1.2]),
            1: dict(repetition_penalty=1.1, top_p=0.95)}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple  # (data, model)
    drafter: str  # plain, ngram, early_exit, model, the tree kinds, lookahead, history(_rollouts)
    batch: int  # 1 (run greedy, then sampled: one program) or 4 (greedy and sampled rows mixed)
    shard_drafter: bool = False
    config: jaxspec.ModelConfig = TARGET
    logprobs: int | None = None
    gate: float | None = None  # disable_by_acceptance (None: no acceptance gate)
    grammar: bool = False  # rows 0 and 2 under GRAMMAR (with TOKENIZER), the others free


MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
# Plain decoding on every mesh; each chain drafter at batch 4 on a mesh split over both axes
# (its state split over `data`, the target over `model`) and at batch 1 (padded to the data
# axis) on another; batch 4 padded onto batch 1's program, a draft model split over `model`
# and a target with every family switch. Measured on 2 cores: ~11 s a sharded program, ~6 s a
# reference; the full mesh x drafter cross product (38 cases) added no code path these miss.
CASES = [Case(f"{d}x{m}-plain-b{b}", (d, m), "plain", b) for (d, m), b in zip(MESHES, (1, 4, 1, 4))] + [
    Case("4x2-ngram-b4", (4, 2), "ngram", 4), Case("1x8-ngram-b1", (1, 8), "ngram", 1),
    Case("2x4-early_exit-b4", (2, 4), "early_exit", 4), Case("8x1-early_exit-b1", (8, 1), "early_exit", 1),
    Case("4x2-model-b4", (4, 2), "model", 4), Case("2x4-model-b1", (2, 4), "model", 1),
    Case("4x2-plain-b4", (4, 2), "plain", 4),  # pads to 4 rows: 4x2-plain-b1's program, reused
    Case("1x8-model_sharded-b4", (1, 8), "model", 4, shard_drafter=True),
    Case("2x4-families-logprobs-b4", (2, 4), "plain", 4, config=FAMILIES, logprobs=2),
] + [  # draft trees (issue 9): batch 4 on 2x4, batch 1 on 1x8, each tree drafter once
    Case("2x4-ngram_tree-b4", (2, 4), "ngram_tree", 4), Case("2x4-model_tree-b4", (2, 4), "model_tree", 4),
    Case("1x8-early_exit_tree-b1", (1, 8), "early_exit_tree", 1),
] + [Case("2x4-lookahead-b4", (2, 4), "lookahead", 4)  # issue 12: pool and window per row, over `data`
      ] + [Case("2x4-early_exit_gated-b4", (2, 4), "early_exit", 4, gate=2.5)
           ] + [Case("2x4-ngram_grammar-b4", (2, 4), "ngram", 4, grammar=True)  # structured output: tables
                ] + [Case("2x4-history-b4", (2, 4), "history", 4),  # rollout history: siblings per data shard
                     Case("2x4-history_rollouts-b4", (2, 4), "history_rollouts", 4),  # + a RolloutHistory per row
                     Case("2x4-hybrid-b4", (2, 4), "hybrid", 4)]  # history for rows 0-1, a draft model's chain elsewhere
# replicated, each row's start state over `data`  # the acceptance gate: rows gated per
# data shard, then a second (plain) while loop, with a drafter whose forward holds the target's collectives
MULTI_CASES = ("4x2-ngram-b4", "1x8-plain-b1")  # also run by two processes
EXPLICIT_CASE = "4x2-ngram-b4"  # rerun on jax.make_mesh's own mesh
ORBAX_CASE = next(c for c in CASES if c.name == "1x8-plain-b1")  # rerun on params restored from orbax


# Structured output's case: 64 one- or two-character tokens, and a pattern of letters and digits.
TOKENIZER_TOKENS = list("abcdefghijklmnopqrstuvwxyz0123456789") + [a + b for a in "aeiou" for b in "nrst"] + list(",.;:-+*/")
GRAMMAR = "[a-z]{2,5}(-[0-9]{1,3})*"


def tokenizer():
    from jaxspec.tokenizer import Tokenizer

    return Tokenizer(TOKENIZER_TOKENS[:64], merges=[], name="tp-bytes")


def models(config=TARGET):
    params = decoder.init_params(config, jax.random.key(0), scale=1.0)
    # draft model: the target plus 10% noise, so drafts are often (not always) accepted
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    noisy = [x + 0.1 * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return params, jax.tree_util.tree_unflatten(tree, noisy)


def drafter(kind, draft_params):
    return {"plain": (None, None), "ngram": (jaxspec.NGramDrafter(gamma=3, min_n=1), None),
            "early_exit": (jaxspec.EarlyExitDrafter(TARGET, n_layers=1, gamma=3), None),
            "model": (jaxspec.ModelDrafter(TARGET, gamma=3, confidence=0.0), draft_params),
            "ngram_tree": (jaxspec.NGramDrafter(gamma=2, min_n=1, branches=3, branch_min_n=1), None),
            "early_exit_tree": (jaxspec.EarlyExitDrafter(TARGET, n_layers=1, gamma=3, tree_nodes=6, branching=2), None),
            "model_tree": (jaxspec.ModelDrafter(TARGET, gamma=3, tree_nodes=8, branching=3), draft_params),
            "lookahead": (jaxspec.LookaheadDrafter(window=3, ngram=3, guesses=2, pool_size=32), None),
            "history": (jaxspec.HistoryDrafter(gamma=3, tree_nodes=6, min_n=1), None)}[kind]


def earlier_rollouts(params, batch: int):
    """A ``RolloutHistory`` holding one earlier rollout of each prompt: its unsharded greedy
    text (so the history's drafts are often accepted), made once per process."""
    if batch not in _EARLIER:
        plain = jaxspec.generate(params, PROMPTS[:batch], config=TARGET, max_new_tokens=10, ignore_eos=True)
        history = jaxspec.RolloutHistory(vocab_size=TARGET.vocab_size, capacity=2, max_tokens=32)
        _EARLIER[batch] = history.add(PROMPTS[:batch], plain.tokens)
    return _EARLIER[batch]


_EARLIER: dict = {}


def run(params, draft_params, case: Case, mesh=None):
    """Generate for ``case`` (batch 1: greedy, then sampled with the same program)."""
    if case.drafter == "history_rollouts":
        d, dp = drafter("history", None)[0], earlier_rollouts(params, case.batch)
    elif case.drafter == "hybrid":  # rows 0-1 have an earlier rollout, rows 2-3 take the draft model
        d = jaxspec.HybridDrafter(jaxspec.HistoryDrafter(gamma=3, tree_nodes=6, min_n=2),
                                  jaxspec.ModelDrafter(TARGET, gamma=3, confidence=0.0))
        dp = (earlier_rollouts(params, 2), draft_params)
    else:
        d, dp = drafter(case.drafter, draft_params)
    n_programs = len(jaxspec.api._COMPILED)
    result = {"tokens": [], "accepted": [], "drafted": [], "gated": []}
    for temperature in ((0.0, 1.0) if case.batch == 1 else (None,)):
        settings = dict(SETTINGS[case.batch], **({} if temperature is None else {"temperature": temperature}))
        grammar = dict(tokenizer=tokenizer(), regex=[GRAMMAR, None, GRAMMAR, None][: case.batch]) if case.grammar else {}
        out = jaxspec.generate(params, PROMPTS[: case.batch], config=case.config, drafter=d, drafter_params=dp, **grammar,
                               max_new_tokens=10, ignore_eos=True, seed=3, mesh=mesh, shard_drafter=case.shard_drafter,
                               logprobs=case.logprobs, disable_by_acceptance=case.gate, **settings)
        result["tokens"] += out.tokens
        result["accepted"] += out.metrics.accepted.tolist()
        result["drafted"] += out.metrics.drafted.tolist()
        result["gated"] += out.metrics.gated.tolist()
    result["new_programs"] = len(jaxspec.api._COMPILED) - n_programs
    if case.logprobs is not None:
        result["logprobs"] = out.logprobs
        result["top_ids"] = [[[i for i, _ in alts] for alts in row] for row in out.top_logprobs]
    if mesh is not None and result["new_programs"]:  # what the one program contains (optimized HLO)
        hlo = list(jaxspec.api._COMPILED.values())[-1].as_text()
        result["hlo"] = {op: hlo.count(op) for op in ("all-reduce(", "all-gather(", "while(")}
    return result


def placement(params):
    """Bytes per device after ``shard_params`` on two meshes, with the parts the test needs to
    predict them: all bytes, replicated norm bytes, wk/wv bytes (repeated when KV < model)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(x.nbytes for _, x in leaves)
    norms = sum(x.nbytes for p, x in leaves if "norm" in p[-1].key)
    kv = sum(x.nbytes for p, x in leaves if p[-1].key in ("wk", "wv"))
    out = {"total": total, "norms": norms, "kv": kv}
    for shape in [(1, 8), (4, 2)]:
        placed = sharding.shard_params(params, TARGET, sharding.make_mesh(*shape))
        out["x".join(map(str, shape))] = sorted(sharding.device_bytes(placed).values())
    return out


def errors(params):
    """Messages of bad meshes, and whether anything was compiled before they were raised."""
    mesh18 = sharding.make_mesh(1, 8)
    bad = {
        "heads": (dict(TARGET.__dict__, n_heads=4, n_kv_heads=2), mesh18),
        "kv_heads": (dict(TARGET.__dict__, n_heads=6, n_kv_heads=3, ffn_dim=64), sharding.make_mesh(4, 2)),
        "vocab": (dict(TARGET.__dict__, vocab_size=60), mesh18),
    }
    out = {}
    n_compiled = len(jaxspec.api._COMPILED)
    for name, (fields, mesh) in bad.items():
        cfg = jaxspec.ModelConfig(**fields)
        try:
            bad_params = decoder.init_params(cfg, jax.random.key(0))
            jaxspec.generate(bad_params, [[1, 2]], config=cfg, max_new_tokens=2, mesh=mesh)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    for name, call in {
        "axis_names": lambda: jaxspec.generate(params, [[1]], config=TARGET, mesh=jax.make_mesh((8,), ("x",))),
        "ngram_sharded": lambda: jaxspec.generate(params, [[1]], config=TARGET, mesh=mesh18, shard_drafter=True,
                                                  drafter=jaxspec.NGramDrafter(gamma=2)),
        "device_count": lambda: sharding.make_mesh(3, 3),
        "parse": lambda: sharding.parse_mesh("2x"),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    out["compiled_before_errors"] = len(jaxspec.api._COMPILED) - n_compiled
    return out


def from_orbax(params, draft_params, case: Case, ckpt: str):
    """``load(ckpt, mesh=)`` of an orbax checkpoint (written here in single mode), then the
    case's generation. Single process: per-leaf layout and values equal ``shard_params``'s.
    Multi-process: each process restores its own shards of the global arrays."""
    from jaxspec.checkpoints import orbax_io

    mesh = sharding.make_mesh(*case.mesh)
    if MODE == "single":
        orbax_io.save(ckpt, params, TARGET)
    model = jaxspec.load(ckpt, mesh=mesh)
    out = run(model.params, draft_params, case, mesh)
    if MODE == "single":
        want = sharding.shard_params(params, TARGET, mesh)
        out["same_layout"] = jax.tree_util.tree_all(jax.tree_util.tree_map(
            lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.shape == b.shape, model.params, want))
        out["same_values"] = jax.tree_util.tree_all(jax.tree_util.tree_map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), model.params, want))
    return out


def main():
    params, draft_params = models()
    if MODE == "multi":
        cases = [c for c in CASES if c.name in MULTI_CASES]
        result = {c.name: run(params, draft_params, c, sharding.make_mesh(*c.mesh)) for c in cases}
        result["process_count"] = jax.process_count()
        result["orbax"] = from_orbax(params, draft_params, ORBAX_CASE, sys.argv[4])
    else:
        result = {"placement": placement(params), "errors": errors(params), "cases": {}}
        chosen = set(sys.argv[3:])  # case names to run (the tests selected); none: every case
        for case in CASES:
            if chosen and case.name not in chosen:
                continue
            p, dp = (params, draft_params) if case.config is TARGET else models(case.config)
            result["cases"][case.name] = {"ref": run(p, dp, case),
                                          "sharded": run(p, dp, case, sharding.make_mesh(*case.mesh))}
        result["orbax"] = from_orbax(params, draft_params, ORBAX_CASE, sys.argv[2])
        # a mesh built by hand with jax.make_mesh (Explicit axis types by default): same
        # devices and axes as sharding.make_mesh's, so the same compiled program serves it
        case = next(c for c in CASES if c.name == EXPLICIT_CASE)
        result["explicit_mesh"] = run(params, draft_params, case, jax.make_mesh(case.mesh, sharding.AXES))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
