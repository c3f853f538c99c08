"""Sharded generation (docs/design.md, invariant 6): on 8 virtual CPU devices, meshes 1x8, 2x4, 4x2
and 8x1 give the tokens of the unsharded run, greedy and seeded sampling (with penalties and
truncation), batch 1 and 4 (batch 1 padded to the data axis), plain decoding on every mesh
and every drafter kind on two (``sharded_cases.CASES``), a sharded draft model, a target with
every family switch, logprobs; each device holds its share of the target's bytes; an orbax
checkpoint restores onto the mesh; two processes joined by ``jax.distributed`` give the
tokens of one; bad meshes fail before any compile.

The device count is fixed when JAX starts, so the runs happen in subprocesses
(``tests/support/sharded_cases.py``, which prints JSON); tests here assert on that JSON. Tokens must
be equal, not close: the sharded target sums partial matmuls in another order, which moves
float32 logits by ulps, and an argmax or a sampled token flips only at a near tie, which these
fixed seeds and models do not hit (the unsharded run is the reference, as for invariant 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support.ci import core  # tests/support/ci.py: the cases CI runs
from support.sharded_cases import CASES, EXPLICIT_CASE, MULTI_CASES, ORBAX_CASE

import jaxspec
from jaxspec import launch, sharding
from jaxspec.checkpoints import names, orbax_io
from jaxspec.models import axes

HERE = os.path.dirname(os.path.abspath(__file__))

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
       "JAX_PLATFORMS": "cpu"}


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Where the single-process run writes the tiny target as an orbax checkpoint."""
    return str(tmp_path_factory.mktemp("sharded") / "ckpt")


# CI's cases: plain decoding on 1x8, the n-gram chain and the draft model (a chain split over
# `model`, a tree on 2x4) at batch 4, every family switch with logprobs, lookahead and early exit
# with the gate; the rest (~20-35 s each on 2 cores) are slow (tests/support/ci.py).
CI_CASES = ["1x8-plain-b1", "4x2-ngram-b4", "1x8-model_sharded-b4",
            "2x4-families-logprobs-b4", "2x4-model_tree-b4", "2x4-lookahead-b4", "2x4-early_exit_gated-b4",
            "2x4-ngram_grammar-b4", "2x4-history_rollouts-b4", "2x4-hybrid-b4"]


@pytest.fixture(scope="module")
def single(checkpoint, request) -> dict:
    """``CI_CASES`` and the other cases of ``sharded_cases.CASES`` that the session selected
    (``-m slow``) on one 8-device process (~390 s on 2 CPU cores for all of them)."""
    names = sorted(set(CI_CASES) | {item.callspec.params["name"] for item in request.session.items
                                    if item.originalname in ("test_mesh_gives_unsharded_tokens",
                                                             "test_one_program_per_generate")})
    cmd = [sys.executable, os.path.join(HERE, "support", "sharded_cases.py"), "single", checkpoint, *names]
    return _json(subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800))


@pytest.mark.parametrize("name", core([c.name for c in CASES], CI_CASES))
def test_mesh_gives_unsharded_tokens(single, name):
    """Tokens and per-row accepted/drafted counts equal the unsharded run's, row by row."""
    case = single["cases"][name]
    assert case["sharded"]["tokens"] == case["ref"]["tokens"]
    assert case["sharded"]["accepted"] == case["ref"]["accepted"]
    assert case["sharded"]["drafted"] == case["ref"]["drafted"]
    assert case["sharded"]["gated"] == case["ref"]["gated"]
    assert all(len(t) == 10 for t in case["sharded"]["tokens"])  # max_new_tokens, EOS ignored
    if "logprobs" in case["ref"]:
        # float32 logits from psum'd partial matmuls move by ulps: 1e-4 is the CLI's
        # tolerance for logprobs of one model run two ways (cli.LOGPROB_TOLERANCE)
        gap = max(abs(a - b) for ra, rb in zip(case["ref"]["logprobs"], case["sharded"]["logprobs"])
                  for a, b in zip(ra, rb))
        assert gap <= 1e-4, gap
        assert case["sharded"]["top_ids"] == case["ref"]["top_ids"]


def _reuses_an_earlier_program(case, ran) -> bool:
    """An earlier case has the same program: same mesh, drafter and settings shapes, and the
    same batch once padded to a multiple of ``data``."""

    def key(c):
        return (c.mesh, c.drafter, c.shard_drafter, c.config, c.logprobs, c.gate is None, c.grammar,
                -(-c.batch // c.mesh[0]))

    earlier = [c for c in CASES[: CASES.index(case)] if c.name in ran]
    return any(key(c) == key(case) for c in earlier)


@pytest.mark.parametrize("name", core([c.name for c in CASES], CI_CASES))
def test_one_program_per_generate(single, name):
    """Prefill and the whole draft-verify loop are one compiled program under the mesh: each
    sharded call compiles exactly one executable (or reuses the one an earlier case compiled
    for the same padded shapes), with the while loop inside it and, when the model axis is
    > 1, the tensor-parallel all-reduces and the logits all-gather."""
    case = next(c for c in CASES if c.name == name)
    sharded = single["cases"][name]["sharded"]
    if _reuses_an_earlier_program(case, single["cases"]):  # batch 4 pads to batch 1's rows on a 4x2 or 8x1 mesh
        assert sharded["new_programs"] == 0
        return
    assert sharded["new_programs"] == 1
    assert sharded["hlo"]["while("] >= 1
    if case.mesh[1] > 1:
        assert sharded["hlo"]["all-reduce("] >= 1 and sharded["hlo"]["all-gather("] >= 1, sharded["hlo"]


def test_sharded_cases_accept_drafts(single):
    """The comparison covers multi-token commits: with the noisy-target drafter and early exit
    (``-m slow``), every batch-4 row accepts drafts (seen: 3-7 of 10 tokens per row); the tree
    of the noisy-target drafter and the gated early exit accept some (seen: 6, 6, 0, 1 and 3, 0, 7, 3)."""
    for name in ("1x8-model_sharded-b4", "4x2-model-b4", "2x4-early_exit-b4", "2x4-hybrid-b4"):
        if name in single["cases"]:
            assert min(single["cases"][name]["sharded"]["accepted"]) > 0, name
    for name in ("2x4-model_tree-b4", "2x4-early_exit_gated-b4", "2x4-history_rollouts-b4"):
        assert sum(single["cases"][name]["sharded"]["accepted"]) > 0, name


def test_the_gated_case_gates_some_rows_and_not_others(single):
    """The acceptance gate's case covers both kinds of row in one sharded program."""
    gated = single["cases"]["2x4-early_exit_gated-b4"]["ref"]["gated"]
    assert any(gated) and not all(gated), gated


def test_each_device_holds_its_share(single):
    """Per-device bytes from the arrays' shardings: on 4x2 every device holds exactly half of
    the target's sharded bytes plus the replicated norms; on 1x8 an eighth, except that wk/wv
    (2 KV heads < 8 shards) are repeated 4x, so each device holds 4/8 of their bytes."""
    p = single["placement"]
    sharded = p["total"] - p["norms"]
    assert p["4x2"] == [sharded // 2 + p["norms"]] * 8
    assert p["1x8"] == [(sharded - p["kv"]) // 8 + p["kv"] * 4 // 8 + p["norms"]] * 8
    # "about 1/N": within 1/N + 4% of the whole model for this tiny model (norms and the
    # repeated KV heads are 3% of it; on Llama-3-8B over 16 chips they are 0.1%)
    assert max(p["1x8"]) <= p["total"] * (1 / 8 + 0.04)


def test_orbax_restores_onto_mesh(single):
    """``load(orbax_dir, mesh=)`` gives the layout and values of ``shard_params`` (KV heads
    repeated after the restore) and the same tokens."""
    o = single["orbax"]
    assert o["same_layout"] and o["same_values"]
    assert o["new_programs"] == 0  # the program compiled for shard_params' layout serves it
    assert o["tokens"] == single["cases"][ORBAX_CASE.name]["ref"]["tokens"]


def test_hand_built_mesh(single):
    """A ``jax.make_mesh((2, 4), ("data", "model"))`` mesh (Explicit axis types) runs the
    program compiled for ``jaxspec.make_mesh(2, 4)`` and gives the same tokens."""
    e = single["explicit_mesh"]
    assert e["new_programs"] == 0
    assert e["tokens"] == single["cases"][EXPLICIT_CASE]["sharded"]["tokens"]


def test_bad_mesh_errors(single):
    """Clear errors naming the axis and the sizes, raised before anything is compiled."""
    e = single["errors"]
    assert e["heads"] == "mesh axis 'model' (size 8) must divide the target's n_heads (4) of tp-target"
    assert "'model' (size 2)" in e["kv_heads"] and "n_kv_heads (3)" in e["kv_heads"]
    assert "'model' (size 8)" in e["vocab"] and "vocab_size (60)" in e["vocab"]
    assert "('data', 'model')" in e["axis_names"] and "('x',)" in e["axis_names"]
    assert "NGramDrafter" in e["ngram_sharded"]
    assert e["device_count"] == "mesh 3x3 (data x model) needs 9 devices, there are 8"
    assert "'2x'" in e["parse"]
    assert e["compiled_before_errors"] == 0


def test_two_processes_match_one(single, checkpoint):
    """Two processes (``jax.distributed`` with a loopback coordinator, gloo CPU collectives,
    4 devices each) give the single-process tokens on a 2x4 mesh (data split across the
    processes) and a 1x8 mesh (every all-reduce crosses processes), also with the target
    restored from orbax straight onto the 1x8 mesh (each process reads its own shards)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.join(HERE, "support", "sharded_cases.py"), "multi", str(port)]
    procs = [subprocess.Popen(cmd + [str(rank), checkpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=ENV) for rank in range(2)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(_json(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)))
    for out in outs:
        assert out["process_count"] == 2
        for name in MULTI_CASES:
            assert out[name]["tokens"] == single["cases"][name]["sharded"]["tokens"], name
            assert out[name]["accepted"] == single["cases"][name]["sharded"]["accepted"], name
        assert out["orbax"]["tokens"] == single["cases"][ORBAX_CASE.name]["ref"]["tokens"]


def test_local_config_llama3_8b_on_16_chips():
    """Llama-3-8B (32 heads, 8 KV heads, F 14336) on a 16-way model axis: 2 query heads and
    one KV head per shard, each KV head stored twice (kv_repeats 2), F / 16 = 896."""
    cfg = jaxspec.ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                              ffn_dim=14336, name="llama3-8b")
    local = sharding.local_config(cfg, 16)
    assert (local.n_heads, local.n_kv_heads, local.ffn_dim, local.vocab_size) == (2, 1, 896, 128256)
    assert local.tp_axis == "model" and sharding.kv_repeats(cfg, 16) == 2
    assert "tp_axis" not in local.to_dict()  # runtime only: never written to a checkpoint manifest
    with pytest.raises(ValueError, match=r"'model' \(size 3\) must divide the target's n_heads \(32\)"):
        sharding.local_config(cfg, 3)


FAMILY_SWITCHES = [dict(), dict(attn_bias=True), dict(qk_norm=True), dict(sandwich_norms=True),
                   dict(tie_embeddings=True), dict(attn_bias=True, qk_norm=True, sandwich_norms=True, tie_embeddings=True)]


def _sizes_only_mesh(data: int, model: int):
    """A ``(data, model)`` Mesh for deriving specs only: they depend on the axis sizes alone,
    so this 1-device process repeats its device to stand for ``data * model`` of them."""
    return jax.sharding.Mesh(np.array([jax.devices()[0]] * (data * model)).reshape(data, model), sharding.AXES)


@pytest.mark.parametrize("switches", FAMILY_SWITCHES, ids=lambda s: "+".join(s) or "llama")
def test_one_table_gives_every_user_the_same_specs(switches):
    """``generate(mesh=)``'s placement (``param_specs``), ``load(mesh=)``'s restore
    (``checkpoint_specs``) and ``orbax_io.default_specs`` all derive from the one table of
    logical axes: identical specs for every tensor of every family switch when the model axis
    divides the KV heads (2 of 8 query heads, model axis 2). With 8 shards the KV heads (2)
    are repeated: the two restore paths keep wk/wv/bk/bv whole (replicated) and
    ``param_specs`` splits the repeated copies, as ``shard_params`` places them."""
    cfg = dataclasses.replace(jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=8, n_kv_heads=2,
                                                  head_dim=4, ffn_dim=64, name="specs"), **switches)
    abstract = names.empty_params(cfg)
    for spec in names.tensor_specs(cfg):
        names.set_leaf(abstract, spec.path, jax.ShapeDtypeStruct(spec.shape, "float32"))
    placed = sharding.param_specs(abstract)
    kv = axes.leaves_along("kv_heads")
    for model in (2, 8):
        mesh = _sizes_only_mesh(8 // model, model)
        restore, default = sharding.checkpoint_specs(cfg, mesh), orbax_io.default_specs(cfg, mesh)
        for spec in names.tensor_specs(cfg):
            want = names.get_leaf(placed, spec.path)
            if model == 8 and spec.key in kv:
                want = P()  # repeated by shard_params after the restore
            assert restore(spec) == default(spec) == want, (model, spec.path)
    expected = {("embed",): P("model", None), ("final_norm",): P(), ("layers", 0, "wq"): P(None, "model"),
                ("layers", 0, "wo"): P("model", None), ("layers", 1, "w_down"): P("model", None),
                ("layers", 1, "w_up"): P(None, "model"), ("layers", 0, "attn_norm"): P()}
    expected.update({("layers", 0, "bk"): P("model"), ("layers", 0, "bq"): P("model")} if cfg.attn_bias else {})
    expected.update({("layers", 0, "k_norm"): P()} if cfg.qk_norm else {})
    expected.update({("layers", 1, "post_mlp_norm"): P()} if cfg.sandwich_norms else {})
    expected.update({} if cfg.tie_embeddings else {("lm_head",): P(None, "model")})
    assert {path: names.get_leaf(placed, path) for path in expected} == expected
    assert ("lm_head" in placed) == (not cfg.tie_embeddings)


def test_a_param_without_logical_axes_is_an_error():
    """A leaf missing from ``jaxspec.models.axes`` fails, naming it, in every user (no silent
    replication); so does a leaf whose rank differs from its declared axes."""
    cfg = jaxspec.ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=8, n_kv_heads=2, head_dim=4, ffn_dim=64)
    leaf = jax.ShapeDtypeStruct((32, 8), "float32")
    with pytest.raises(ValueError, match="param 'layers/0/w_new' has no logical axes"):
        sharding.param_specs({"embed": leaf, "layers": [{"w_new": leaf}]})
    with pytest.raises(ValueError, match="param 'medusa_head' has no logical axes"):
        sharding.param_specs({"medusa_head": leaf})
    assert sharding.param_specs({"medusa_head": leaf}, sharded=False) == {"medusa_head": P()}
    unknown = names.TensorSpec(("layers", 0, "w_new"), "", "", (32, 8), False)
    for fn in (orbax_io.default_specs(cfg, _sizes_only_mesh(1, 2)),
               sharding.checkpoint_specs(cfg, _sizes_only_mesh(1, 2))):
        with pytest.raises(ValueError, match="param 'layers/0/w_new' has no logical axes"):
            fn(unknown)
    with pytest.raises(ValueError, match="param 'layers/0/bq' has 2 dimensions, .* declares 1"):
        sharding.param_specs({"layers": [{"bq": leaf}]})


def test_cli_mesh_flag_and_launch_errors():
    """``--mesh`` parses DATAxMODEL and fails clearly on bad values or too few devices (this
    pytest process has 1 CPU device); ``launch.initialize`` needs all three addresses or none."""
    from jaxspec import cli

    def parse(*a):
        return cli._parser().parse_args(["generate", "hi", *a])

    assert parse("--mesh", "2x4").mesh == "2x4"
    with pytest.raises(SystemExit, match="--mesh: mesh 2x4 .* needs 8 devices, there are 1"):
        cli._mesh(parse("--mesh", "2x4"))
    with pytest.raises(SystemExit, match="--mesh: mesh must be DATAxMODEL"):
        cli._mesh(parse("--mesh", "8"))
    with pytest.raises(SystemExit, match="--shard-drafter needs --mesh"):
        cli._mesh(parse("--shard-drafter"))
    assert cli._mesh(parse("--mesh", "1x1")).shape == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="all of coordinator, num_processes and process_id"):
        launch.initialize("localhost:1234", None, 0)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes=2\), got 2"):
        launch.initialize("localhost:1234", 2, 2)


def test_scaleout_table_arithmetic():
    """docs/scale_out.md's worked example (Llama-3-8B on v5e-8) from ``benchmarks/experiments/scaleout_table.py``:
    7.50 B params read per step / 8 chips x 2 bytes + 32 x 2 x 2048 x 128 x 2 bytes of KV,
    at 819 GB/s; Llama-3-70B in bfloat16 does not fit v5e-8's 16 GiB per chip but fits v6e-8."""
    from benchmarks.experiments import scaleout_table as t

    l8, l70 = t.MODELS
    v5e, v5p, v6e = t.CHIPS
    r = t.step_cost(l8, v5e)
    head = 128256 * 4096
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    read = (32 * layer + head) / 8 * 2 + 32 * 2 * 2048 * 1 * 128 * 2
    assert r["params_b"] == pytest.approx(8.03, abs=0.005)  # Llama-3-8B's published size
    assert r["read_per_step_gb"] == pytest.approx(read / 1e9, rel=1e-12)
    assert r["floor_ms"] == pytest.approx(read / 819e9 * 1e3, rel=1e-12)
    assert t.step_cost(l70, v5e)["params_b"] == pytest.approx(70.55, abs=0.01)
    assert not t.step_cost(l70, v5e)["fits"] and t.step_cost(l70, v6e)["fits"] and t.step_cost(l70, v5p)["fits"]
    assert v5p.chips == 4  # v5p-8 names 8 TensorCores, 2 per chip
