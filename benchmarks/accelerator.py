"""Accelerator benchmark (one GPU or TPU): what a target pass costs against the hardware's
floor and against Hugging Face transformers, and end-to-end tok/s at a chosen tau.

For Llama-3.2-1B and Llama-3.1-8B shapes with random bfloat16 weights (no checkpoint), in one
process, in this order per shape:

1. floor: weight bytes streamed by one pass (every parameter but the embedding table, which
   only gathers the window's rows; a tied head reads it whole) / the device copy bandwidth
   measured here (a jitted ``x + 1`` over ``--copy-gib`` GiB: 2 bytes moved per byte);
2. target pass: the jitted ``jaxspec.models.forward`` as the engine's verify step calls it (a
   chain window's tree mask, the cache read and the window's keys and values written at the
   committed length after it, the cache donated and fed back), for T = 1 and gamma + 1 new
   tokens at batch 1 and 8, and at batch 1 for the wider windows of trees and lookahead
   (``--tree-widths``: an n-gram tree of 16 nodes verifies 17 tokens, lookahead W5 N4 G5 31),
   ``--slots`` cache slots with ``slots // 2`` committed; median of ``--reps`` samples after 2
   warm-ups, each sample a chain of ``PASS_CHAIN`` passes (each fed the cache the previous one
   returned) synchronised once, divided by the chain's length, so that host dispatch and
   synchronisation, which the engine's on-device loop does not pay, are not counted;
3. end to end: ``jaxspec.generate`` at batch 1, plain decoding and ``RepeatDrafter(gamma)``
   with synthetic acceptance at each ``--taus`` (NOT lossless: speed only; one compiled
   program serves every tau); prompts of ``slots - 256`` random tokens so the cache bucket is
   ``--slots``; decode tok/s = (long - short new tokens) / (median run time long - short),
   which cancels the prefill and the host round trip;
4. transformers: ``LlamaForCausalLM(config)`` with random bf16 weights on the same device,
   ``generate(do_sample=False, cache_implementation="static", max_cache_len=slots)``
   (transformers compiles the decode step itself on CUDA unless ``--hf-compile off``), the
   same prompt length, ms per decode step by the same long - short difference, at batch 1
   (``--hf-batches 1,8`` adds batch 8: one more torch.compile).
   Skipped (and said so in the JSON) when torch cannot reach the accelerator jax runs on.

Goals, printed PASS/FAIL (never asserted): target pass (B 1, T 1) <= 1.15x the floor; a
(gamma + 1)-token verify <= 1.05x a 1-token pass (B 1); jaxspec plain decoding >= 1.5x
transformers' static-cache tok/s (B 1). Reference, H200, bf16, B 1, 2048 slots, Llama-3-8B
shape: floor 4.0 ms, transformers static cache 7.9 ms/token, unrolled layers 9.2 ms, 8.6 ms
with donated caches (docs/design.md).

Budget: sized for ~5 minutes on an H200 (8B in bf16 is 16 GB; jax gets 60% of device memory,
``XLA_PYTHON_CLIENT_MEM_FRACTION``, so torch has room for its copy): 3 timed repeats, 128 new
tokens. Most of the time is compiling (per shape 4 + len(--tree-widths) pass programs, 2 generate programs and
transformers' compile), an estimate never measured here: if it runs long, ``--shapes
llama-3.1-8b`` or ``--hf-compile off`` cut it. Each phase prints as it ends; the JSON has
each shape's elapsed seconds. jax's persistent compilation cache is on, so a rerun on the
same machine skips jax's compiles.

Run from the repository root::

    python -m benchmarks.accelerator                # the real run (GPU/TPU)
    python -m benchmarks.accelerator --dry-run      # tiny shapes, CPU, < 1 minute

Writes ``benchmarks/results/accelerator_<shapes>[-dry-run]_<host kind>_<date>.json`` (or ``--out``):
machine (device kind, jax/torch versions), command, settings, medians and every sample.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import warnings

from benchmarks.bench_env import machine_info, result_stem, versions, write_record

GOALS = {"pass_vs_floor": 1.15, "verify_vs_decode": 1.05, "plain_vs_hf": 1.5}
PARTS = ("pass", "e2e")
PASS_CHAIN = 10  # passes per synchronisation in pass_costs


def shapes(dry_run: bool) -> dict:
    """``{name: jaxspec.ModelConfig}``: Meta's published shapes (config.json of
    meta-llama/Llama-3.2-1B and Llama-3.1-8B), or one tiny shape for the dry run."""
    from jaxspec.config import ModelConfig, RopeScaling

    if dry_run:
        return {"tiny": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                    ffn_dim=128, rope_theta=500000.0, max_position=4096, name="tiny")}
    llama3 = dict(vocab_size=128256, n_heads=32, n_kv_heads=8, rope_theta=500000.0, norm_eps=1e-5,
                  max_position=131072)
    return {
        "llama-3.2-1b": ModelConfig(dim=2048, n_layers=16, head_dim=64, ffn_dim=8192, tie_embeddings=True,
                                    rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), name="llama-3.2-1b",
                                    **llama3),
        "llama-3.1-8b": ModelConfig(dim=4096, n_layers=32, head_dim=128, ffn_dim=14336,
                                    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), name="llama-3.1-8b",
                                    **llama3),
    }


def timed(fn, reps: int, warmup: int = 2) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` (which must block until its work is done), after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(gib: float, reps: int, chain: int = 10) -> dict:
    """Device memory bandwidth in bytes/s: a jitted ``x + 1`` over ``gib`` GiB of bfloat16
    reads and writes every byte once; ``chain`` dependent calls are dispatched back to back
    and synchronised once, so dispatch latency does not count."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    add = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))

    def run():
        y = x
        for _ in range(chain):
            y = add(y)
        y.block_until_ready()

    times = timed(run, reps)
    del x
    return {"bytes_per_s": 2 * n * 2 * chain / statistics.median(times), "bytes": 2 * n, "chain": chain,
            "all_s": times}


def streamed_bytes(params: dict, config) -> int:
    """Bytes one pass reads of the weights: all of them, but the embedding table only when the
    head is tied to it (otherwise a lookup reads just the window's rows)."""
    import jax

    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return total if config.tie_embeddings else total - params["embed"].nbytes


def hlo_summary(text: str) -> dict:
    """What kernels an optimized HLO module runs: counts of custom-call targets (cuBLAS
    GEMMs, ...) and fusion kinds, and every Triton GEMM's tile config (block_m/n/k, split_k),
    so that two programs (a 1-token and a 2-token pass) can be told apart without a profiler."""
    import collections
    import re

    configs = collections.Counter()
    for m in re.finditer(r'"triton_gemm_config":(\{[^}]*\})', text):
        try:
            c = json.loads(m.group(1))
        except ValueError:
            continue
        configs[",".join(f"{k}={c.get(k)}" for k in ("block_m", "block_n", "block_k", "split_k"))] += 1
    return {"custom_calls": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
            "fusion_kinds": dict(collections.Counter(re.findall(r"\bkind=(k[A-Za-z]+)", text))),
            "triton_gemm_configs": dict(configs)}


def pass_costs(params, config, batches, widths, slots: int, reps: int, hlo: bool = False) -> dict:
    """Median ms of one target pass per (batch, T): ``{"B1_T1": ms, ...}`` and every sample;
    with ``hlo``, also each program's ``hlo_summary`` (one more compile per program)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec import models
    from jaxspec.cache import KVCache

    def step(params, cache, tokens, positions, start, visible):
        # As the engine's verify does it: the cache only read, the window's keys and values
        # returned apart and then written (engine._verify, LoopState.cache.write).
        mask = models.TreeMask(start, visible, positions)
        out = models.forward(params, config, tokens, positions, cache, mask=mask, write=False)
        return out.logits, cache.write(out.cache, start)

    run = jax.jit(step, donate_argnums=(1,))
    med, every, kernels = {}, {}, {}
    for b in batches:
        for t in widths:
            tokens = jnp.asarray(np.random.default_rng(t).integers(0, config.vocab_size, (b, t)), jnp.int32)
            start = jnp.full((b,), slots // 2, jnp.int32)
            positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
            visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
            state = {"cache": KVCache.zeros(config, b, slots, params["embed"].dtype)}

            def chain():
                for _ in range(PASS_CHAIN):
                    logits, state["cache"] = run(params, state["cache"], tokens, positions, start, visible)
                jax.block_until_ready((logits, state["cache"]))

            key = f"B{b}_T{t}"
            if hlo:
                kernels[key] = hlo_summary(run.lower(params, state["cache"], tokens, positions, start, visible)
                                           .compile().as_text())
                print(f"  hlo {key}: {kernels[key]}", flush=True)
            every[key] = [s * 1e3 / PASS_CHAIN for s in timed(chain, reps)]
            med[key] = statistics.median(every[key])
            print(f"  pass {key}: {med[key]:.3f} ms", flush=True)
            del state
    return {"ms": med, "all_ms": every, **({"hlo": kernels} if hlo else {})}


def end_to_end(params, config, gamma: int, taus, slots: int, new_tokens: tuple[int, int], reps: int,
               padded=()) -> dict:
    """Batch-1 decode tok/s of plain decoding (``jaxspec.engine.MIN_PASS_TOKENS`` as set, and
    with every pass padded to each width in ``padded``) and of synthetic acceptance at each tau."""
    import numpy as np

    import jaxspec
    from jaxspec import engine

    prompt = np.random.default_rng(0).integers(0, config.vocab_size, slots - 256).tolist()
    short, long = new_tokens

    def measure(drafter, synth):
        runs = {n: [] for n in (short, long)}
        metrics = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxspec.synthetic.SyntheticAcceptanceWarning)
            for n in (short, long):  # compile and warm up
                jaxspec.generate(params, [prompt], config=config, drafter=drafter, max_new_tokens=n, ignore_eos=True,
                                 synthetic_acceptance=synth, allow_synthetic_acceptance=synth is not None)
            for _ in range(reps):
                for n in (short, long):
                    out = jaxspec.generate(params, [prompt], config=config, drafter=drafter, max_new_tokens=n,
                                           ignore_eos=True, synthetic_acceptance=synth,
                                           allow_synthetic_acceptance=synth is not None)
                    runs[n].append(out.metrics.run_s)
                    metrics[n] = out.metrics
        dt = statistics.median(runs[long]) - statistics.median(runs[short])
        m = metrics[long]
        return {"decode_tokens_per_s": (long - short) / dt if dt > 0 else None,
                "call_tokens_per_s": long / statistics.median(runs[long]), "tau": m.tau,
                "synthetic": m.synthetic, "synthetic_acceptance_rates": list(m.synthetic_rates) or None,
                "run_s": {str(n): runs[n] for n in runs}}

    out = {"plain": {**measure(None, None), "min_pass_tokens": engine.min_pass_tokens()}}
    print(f"  e2e plain: {_fmt(out['plain']['decode_tokens_per_s'])} tok/s", flush=True)
    for m in padded:  # the 1-token pass run as an m-token one (its copies' outputs dropped)
        with engine.min_pass_tokens_set(m):
            out[f"plain_min_pass_tokens{m}"] = rec = {**measure(None, None), "min_pass_tokens": m}
        print(f"  e2e plain, passes of >= {m} tokens: {_fmt(rec['decode_tokens_per_s'])} tok/s", flush=True)
    drafter = jaxspec.RepeatDrafter(gamma)
    for tau in taus:
        rec = measure(drafter, jaxspec.SyntheticAcceptance.from_tau(tau, gamma))
        out[f"synthetic_tau{tau:g}"] = rec
        print(f"  e2e SYNTHETIC tau {tau:g} (measured {rec['tau']:.2f}): {_fmt(rec['decode_tokens_per_s'])} tok/s",
              flush=True)
    return out


def _fmt(x, spec: str = ".1f") -> str:
    return "n/a (long run not slower than short: timing noise)" if x is None else format(x, spec)


def hf_device(backend: str):
    """The torch device matching jax's backend, or ``(None, reason)``."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if backend == "cpu":
        return "cpu", None
    if backend == "gpu" and torch.cuda.is_available():
        return "cuda", None
    return None, f"torch {torch.__version__} cannot reach the {backend} device (no CUDA build / TPU support)"


def hf_decode(config, device: str, batches, slots: int, new_tokens: tuple[int, int], reps: int, compile_mode: str):
    """transformers' static-cache greedy decoding of the same shape, random bf16 weights:
    ms per decode step per batch size (long - short new tokens)."""
    import torch
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rs = config.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position}
    hf_config = tf.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position, rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings, rope_parameters=rope, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    short, long = new_tokens
    out = {"attn_implementation": model.config._attn_implementation, "compile": compile_mode}
    for b in batches:
        ids = torch.randint(0, config.vocab_size, (b, slots - 256), device=device)

        def gen(n):
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                               cache_implementation="static", pad_token_id=0, disable_compile=compile_mode == "off",
                               **cache_len)
            sync()

        cache_len = {"max_cache_len": slots}
        try:
            gen(short)
        except ValueError as e:  # transformers before max_cache_len (#46424): the cache is prompt + new tokens
            if "max_cache_len" not in str(e):
                raise
            cache_len = {}
        out["max_cache_len"] = slots if cache_len else "transformers' default: prompt + new tokens"

        runs = {n: timed(lambda n=n: gen(n), reps, warmup=2) for n in (short, long)}
        dt = statistics.median(runs[long]) - statistics.median(runs[short])
        ms = dt / (long - short) * 1e3 if dt > 0 else None
        out[f"B{b}"] = {"ms_per_step": ms, "tokens_per_s": None if ms is None else b * 1e3 / ms,
                        "run_s": {str(n): runs[n] for n in runs}}
        print(f"  transformers static cache B{b}: {_fmt(ms, '.3f')} ms/step", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def goals(name: str, rec: dict, gamma: int) -> list[dict]:
    """The three goals of one shape: value, limit, PASS/FAIL (None where a part is missing)."""
    ms, rows = rec["pass"]["ms"], []

    def add(goal, value, ok):
        rows.append({"shape": name, "goal": goal, "value": value, "limit": GOALS[goal],
                     "pass": None if value is None else bool(ok(value))})

    add("pass_vs_floor", ms["B1_T1"] / rec["floor_ms"], lambda v: v <= GOALS["pass_vs_floor"])
    add("verify_vs_decode", ms[f"B1_T{gamma + 1}"] / ms["B1_T1"], lambda v: v <= GOALS["verify_vs_decode"])
    hf = rec.get("transformers", {}).get("B1", {}).get("tokens_per_s")
    plain = rec.get("e2e", {}).get("plain", {}).get("decode_tokens_per_s")  # None without --parts e2e
    add("plain_vs_hf", plain / hf if hf and plain else None, lambda v: v >= GOALS["plain_vs_hf"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, few repeats: runs on CPU in well under a minute")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shapes (default: all)")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per step: verify windows of gamma + 1 (4)")
    ap.add_argument("--tree-widths", default=None, help="more window widths timed at batch 1: trees and lookahead "
                                                         "(9,17,31; dry run 9; '' for none)")
    ap.add_argument("--batches", default="1,8", help="batch sizes of the target pass timings (1,8)")
    ap.add_argument("--hf-batches", default="1", help="batch sizes of transformers' decoding (1; each one more "
                                                       "torch.compile on CUDA, ~1 minute for 8B)")
    ap.add_argument("--taus", default="1,2,3,4", help="synthetic mean accepted lengths, each in [1, gamma + 1]")
    ap.add_argument("--slots", type=int, default=None, help="cache slots (2048; dry run 512)")
    ap.add_argument("--new-tokens", default=None, help="SHORT,LONG new tokens of the decode-rate difference "
                                                       "(32,128; dry run 8,24)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats (pass: 4x this) (3; dry run 2)")
    ap.add_argument("--copy-gib", type=float, default=None, help="GiB copied to measure bandwidth (2; dry run 0.004)")
    ap.add_argument("--parts", default="pass,e2e", help="what to time per shape: pass (target passes, always "
                                                      "timed: the goals need them), e2e (generate, plain and "
                                                      "synthetic); transformers per --hf")
    ap.add_argument("--hlo-summary", action="store_true", help="record which kernels each pass program runs "
                                                                "(custom calls, fusion kinds, Triton GEMM tiles)")
    ap.add_argument("--hf", choices=("on", "off"), default="on", help="run transformers' static-cache decoding")
    ap.add_argument("--hf-compile", choices=("auto", "off"), default="auto",
                    help="auto: transformers compiles the static-cache decode step where it does by default (CUDA)")
    ap.add_argument("--min-pass-tokens", default="2", help="e2e: plain decoding again with every target pass "
                    "padded to at least each of these widths (jaxspec.engine.MIN_PASS_TOKENS; '' for none) (2)")
    ap.add_argument("--out", default=None, help="output JSON path")
    args = ap.parse_args(argv)
    dry = args.dry_run
    padded = [int(m) for m in args.min_pass_tokens.split(",") if m]
    if any(m < 2 for m in padded):
        raise SystemExit(f"error: --min-pass-tokens: widths >= 2, got {args.min_pass_tokens!r}")
    slots = args.slots or (512 if dry else 2048)
    short, long = map(int, (args.new_tokens or ("8,24" if dry else "32,128")).split(","))
    reps = args.reps or (2 if dry else 3)
    copy_gib = args.copy_gib or (0.004 if dry else 2.0)
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = [int(b) for b in args.hf_batches.split(",")]
    taus = [float(t) for t in args.taus.split(",")]
    tree_widths = [int(t) for t in (args.tree_widths if args.tree_widths is not None else "9" if dry else "9,17,31")
                   .split(",") if t]
    parts = args.parts.split(",")
    if "pass" not in parts or not set(parts) <= set(PARTS):
        raise SystemExit(f"error: --parts: a comma-separated subset of {', '.join(PARTS)} that includes pass, "
                         f"got {args.parts!r}")
    if any(not 1 <= t <= 256 for t in tree_widths):
        raise SystemExit(f"error: --tree-widths: each width must be in [1, 256] (the cache's free slots), got {tree_widths}")
    if 1 not in batches or 1 not in hf_batches:
        raise SystemExit("error: --batches and --hf-batches must include 1 (the goals are at batch 1)")
    if slots < 512 or slots % 256:
        raise SystemExit(f"error: --slots must be a multiple of 256 and >= 512 (prompts are slots - 256), got {slots}")
    if not 0 < short < long <= 256 - (args.gamma + 1):
        # prompt (slots - 256) + LONG + the verify window must stay within the --slots cache bucket
        raise SystemExit(f"error: --new-tokens SHORT,LONG needs 0 < SHORT < LONG <= {256 - args.gamma - 1} "
                         f"(256 - gamma - 1), got {short},{long}")
    for tau in taus:
        if not 1 <= tau <= args.gamma + 1:
            raise SystemExit(f"error: --taus: each tau must be in [1, gamma + 1] = [1, {args.gamma + 1}], got {tau:g}")

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # room for torch's copy of the model
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch on a shared CPU (benchmarks/bench_env.py)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # CPU cannot donate
    import jax
    import jax.numpy as jnp

    import jaxspec.api
    from jaxspec import compile_cache, models

    all_shapes = shapes(dry)
    names = list(all_shapes) if args.shapes is None else args.shapes.split(",")
    unknown = [n for n in names if n not in all_shapes]
    if unknown:
        raise SystemExit(f"error: --shapes: unknown {unknown}; known: {', '.join(all_shapes)}")
    if not dry:
        compile_cache.enable()
    started = _dt.datetime.now(_dt.timezone.utc)
    t_start = time.perf_counter()
    device = jax.devices()[0]
    backend = jax.default_backend()
    if backend == "cpu" and not dry:
        print("WARNING: jax runs on the CPU: these are not accelerator numbers (use --dry-run for a smoke test)")
    torch_device, hf_skip = hf_device(backend) if args.hf == "on" else (None, "--hf off")
    if dry and torch_device == "cpu":
        import torch

        torch.set_num_threads(1)
    print(f"device: {device.device_kind} ({backend}), {jax.device_count()} device(s); transformers on "
          f"{torch_device or 'nothing: ' + hf_skip}", flush=True)

    bw = copy_bandwidth(copy_gib, reps * 4)
    print(f"copy bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    dtype = jnp.bfloat16
    results, goal_rows = {}, []
    for name in names:
        config = all_shapes[name]
        print(f"{name}:", flush=True)
        t0 = time.perf_counter()
        params = jax.block_until_ready(models.init_params(config, jax.random.key(0), dtype=dtype))
        weight_bytes = streamed_bytes(params, config)
        rec = {"config": {k: v for k, v in vars(config).items() if k != "rope_scaling"},
               "rope_scaling": None if config.rope_scaling is None else vars(config.rope_scaling),
               "dtype": "bfloat16", "params": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
               "weight_bytes_streamed": weight_bytes, "floor_ms": weight_bytes / bw["bytes_per_s"] * 1e3,
               # not in the floor, for reading it: a pass also reads the whole static cache
               "kv_cache_bytes_per_row": 2 * config.n_layers * slots * config.n_kv_heads * config.head_dim * 2}
        print(f"  floor: {weight_bytes / 1e9:.2f} GB streamed, {rec['floor_ms']:.3f} ms", flush=True)
        rec["pass"] = pass_costs(params, config, batches, (1, args.gamma + 1), slots, reps * 4, args.hlo_summary)
        more = [t for t in dict.fromkeys(tree_widths) if t not in (1, args.gamma + 1)]  # not timed above
        if more:
            wide = pass_costs(params, config, [1], more, slots, reps * 4, args.hlo_summary)
            for k in ("ms", "all_ms", "hlo"):
                rec["pass"].get(k, {}).update(wide.get(k, {}))
        t1 = rec["pass"]["ms"]["B1_T1"]
        rec["pass"]["vs_B1_T1"] = {k: v / t1 for k, v in rec["pass"]["ms"].items()}
        print("  pass / B1_T1: " + ", ".join(f"{k} {v:.2f}x" for k, v in rec["pass"]["vs_B1_T1"].items()), flush=True)
        if "e2e" in parts:
            rec["e2e"] = end_to_end(params, config, args.gamma, taus, slots, (short, long), reps, padded)
        del params
        jaxspec.api._COMPILED.clear()  # the compiled programs of this shape are done with
        jax.clear_caches()
        if torch_device is not None:
            try:
                rec["transformers"] = hf_decode(config, torch_device, hf_batches, slots, (short, long), reps,
                                                args.hf_compile)
            except Exception as e:  # keep the jax numbers whatever transformers does
                rec["transformers"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"  transformers failed: {rec['transformers']['error']}", flush=True)
        else:
            rec["transformers"] = {"skipped": hf_skip}
        rec["elapsed_s"] = time.perf_counter() - t0
        print(f"  {name} done in {rec['elapsed_s']:.0f} s", flush=True)
        results[name] = rec
        goal_rows += goals(name, rec, args.gamma)

    note = " (dry run on CPU: not meaningful)" if dry else ""
    print(f"goals{note}:")
    for g in goal_rows:
        verdict = "n/a " if g["pass"] is None else "PASS" if g["pass"] else "FAIL"
        value = "missing" if g["value"] is None else f"{g['value']:.3f}"
        cmp = ">=" if g["goal"] == "plain_vs_hf" else "<="
        print(f"  {verdict} {g['shape']} {g['goal']}: {value} (goal {cmp} {g['limit']})")

    stem = args.out or result_stem("accelerator", "-".join(names) + ("-dry-run" if dry else ""), started)
    path = stem if stem.endswith(".json") else stem + ".json"
    record = {
        "command": "python -m benchmarks.accelerator " + " ".join(sys.argv[1:] if argv is None else argv),
        "started": started.isoformat(), "dry_run": dry,
        "machine": {**machine_info(), "backend": backend, "device_kind": device.device_kind,
                    "device_count": jax.device_count(), "transformers_device": torch_device,
                    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
        "versions": versions(),
        "settings": {**vars(args), "slots": slots, "new_tokens": [short, long], "reps": reps, "copy_gib": copy_gib,
                     "batches": batches, "hf_batches": hf_batches, "taus": taus,
                     "tree_widths": tree_widths},
        "copy_bandwidth": bw, "shapes": results, "goals": goal_rows, "elapsed_s": time.perf_counter() - t_start,
    }
    write_record(record, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
