"""Cost of one target verify pass for T = 1, 2, 5, 9, 17, 33, 65 new tokens (a chain or tree
window of T - 1 nodes), on the real models we ship: what chooses node budgets on a machine.

Each pass is the jitted ``jaxspec.models.forward`` exactly as the engine's verify step calls
it (a tree mask of the window at the committed length, the window's keys and values kept apart
from the cache, ``write=False``; 512-slot cache, 200 committed tokens; before 2026-12-07 the
window was written into the cache, and each pass also copied the whole cache), timed as the median of ``--reps`` calls after two warm-ups, with the
passes for the different T interleaved round-robin so machine load hits them alike. On a CPU
with jaxspec's small-T kernel built (``jaxspec.kernels.cpu_matmul``), each pass is also
compiled with XLA's dot (``cpu_matmul.disabled()``) and the two are interleaved too
(``--kernel both``, the default there): results ``<model>`` (kernel, over the weights as
``jaxspec.load`` lays them out there: projection matrices in panels, ``jaxspec.models.layout``),
``<model>/kn`` (the kernel over plain ``[K, N]`` matrices), ``<model>/plain_head`` (projections in
panels, the output head a plain matrix: a tied ``[V, D]`` table through the ``[N, K]`` kernel;
``--kernel layouts`` only), ``<model>/xla`` (XLA's dot over plain matrices) and ``<model>/avx2``
(the kernel's AVX2 path on a CPU with AVX-512; ``--kernel isas``).

Run from the repository root::

    python -m benchmarks.bench_pass_cost [--models smollm2-135m,gemma3-270m] [--reps 15]
        [--widths 1,2,5,9,17] [--dtype bfloat16] [--kernel both|layouts|isas|on|off]

Writes ``benchmarks/results/pass_cost_<models>[-<dtype>]_<host kind>_<date>.json`` (machine, versions, command) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import statistics
import sys
import time

from benchmarks.bench_env import machine_info, result_stem, versions

WIDTHS = (1, 2, 5, 9, 17, 33, 65)


def _switch_prefix() -> str:
    """``JAXSPEC_CPU_KERNEL=<v> `` when the kernel's switch is set in the environment."""
    v = os.environ.get("JAXSPEC_CPU_KERNEL")
    return "" if v is None else f"JAXSPEC_CPU_KERNEL={v} "


def verify_pass(cfg, params, tokens, positions, cache, start, visible):
    """The target's logits for a verify window, as the engine's verify step computes them: the
    window attends to the cache and to its own keys and values, which are not written
    (``write=False``; the engine writes the accepted path's afterwards). Writing here would
    time a copy of the whole cache per pass (a jit argument that is not donated cannot be
    updated in place), which the engine's loop, updating its cache in place, does not make."""
    from jaxspec import models

    mask = models.TreeMask(start, visible, positions)
    return models.forward(params, cfg, tokens, positions, cache, mask=mask, write=False).logits


def verify_args(cfg, dtype, t: int, slots: int, committed: int) -> tuple:
    """``verify_pass``'s arguments after ``params`` for a chain window of ``t`` tokens written at
    position ``committed`` of a ``slots``-slot cache (zeros) of ``dtype``, batch 1."""
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.cache import KVCache

    tokens = jnp.asarray(np.random.default_rng(t).integers(0, cfg.vocab_size, (1, t)), jnp.int32)
    start = jnp.full((1,), committed, jnp.int32)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    visible = jnp.tril(jnp.ones((t, t), bool))[None]
    return tokens, positions, KVCache.zeros(cfg, 1, slots, dtype), start, visible


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--committed", type=int, default=200)
    ap.add_argument("--out", default=None, help="JSON path (\".json\" added when missing; default: benchmarks/results/pass_cost_<models>[-<dtype>]_<host kind>_<date>.json)")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated T values")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="parameter dtype (jaxspec.load)")
    ap.add_argument("--kernel", default="both", choices=("both", "layouts", "isas", "on", "off"),
                    help="CPU kernel, XLA's dot, or both interleaved (default; 'on' where the kernel is absent); "
                         "'layouts': the kernel over panels and over plain matrices only (XLA's bfloat16 passes "
                         "take ~200 ms and slow whatever runs next); 'isas': the kernel's AVX-512 and AVX2 paths "
                         "(one program, cpu_matmul.limit_isa)")
    args = ap.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))

    import jax
    import jaxspec
    from jaxspec.kernels import cpu_matmul
    from jaxspec.models import layout

    # whether weight products take the kernel (JAXSPEC_CPU_KERNEL unset or 1; 0: XLA's dot)
    kernel = jax.default_backend() == "cpu" and cpu_matmul.active()
    variants = {"both": ("", "/kn", "/xla"), "layouts": ("", "/plain_head", "/kn"), "isas": ("", "/avx2"),
                "on": ("",), "off": ("/xla",)}[args.kernel if kernel else "on"]
    if "/avx2" in variants and cpu_matmul.isa() != "avx512":
        ap.error(f"--kernel isas compares the AVX-512 and AVX2 paths; this CPU runs {cpu_matmul.isa()}")
    load_before = os.getloadavg()
    results = {}
    for name in args.models.split(","):
        model = jaxspec.load(name, dtype=args.dtype)
        cfg, params = model.config, model.params
        arrays = layout.as_arrays(params)  # plain [K, N] matrices (the same tree where none are in panels)
        head = "lm_head" if "lm_head" in params else "embed"
        plain_head = {**params, head: arrays[head]}

        verify_fn = functools.partial(verify_pass, cfg)
        # two function objects: jax.jit caches traces per function, and `off` must trace apart;
        # `on` compiled with the options jaxspec compiles its programs with (cpu_matmul.compiler_options)
        on = jax.jit(verify_fn, compiler_options=cpu_matmul.compiler_options(jax.default_backend()))
        off = jax.jit(lambda *a: verify_fn(*a))

        def xla_verify(*a):  # traced (on the first call) with XLA's dot; compiled once, like `on`
            with cpu_matmul.disabled():
                return off(*a)

        # `on`'s program with the kernels capped at their AVX2 path, run to its end inside the cap
        avx2_verify = cpu_matmul.limit_isa("avx2")(lambda *a: on(*a).block_until_ready())

        kn = jax.jit(lambda *a: verify_fn(*a), compiler_options=cpu_matmul.compiler_options(jax.default_backend()))
        # plain_head and arrays are other pytrees than params: `kn` traces each apart
        passes = {name + v: {"": (on, params), "/plain_head": (kn, plain_head), "/kn": (kn, arrays),
                             "/xla": (xla_verify, arrays), "/avx2": (avx2_verify, params)}[v] for v in variants}
        calls = {}
        for t in widths:
            calls[t] = verify_args(cfg, params["embed"].dtype, t, args.slots, args.committed)
            for verify, p in passes.values():
                for _ in range(2):
                    verify(p, *calls[t]).block_until_ready()
        times = {(v, t): [] for v in passes for t in widths}
        order = list(passes.items())
        for rep in range(args.reps):
            for t in widths:
                # the variants in a rotating order: the pass right after XLA's dot runs while its
                # threads wind down (measured: a bfloat16 kernel pass 1.6x slower in that slot)
                for v, (verify, p) in order[rep % len(order):] + order[: rep % len(order)]:
                    t0 = time.perf_counter()
                    verify(p, *calls[t]).block_until_ready()
                    times[(v, t)].append(time.perf_counter() - t0)
        for v in passes:
            med = {t: statistics.median(times[(v, t)]) * 1e3 for t in widths}
            one = med[widths[0]]
            results[v] = {"ms": med, "ratio_to_T1": {t: med[t] / one for t in widths},
                          "all_ms": {t: [x * 1e3 for x in times[(v, t)]] for t in widths}}
            print(f"{v}: " + ", ".join(f"T={t} {med[t]:.1f} ms ({med[t] / one:.2f}x)" for t in widths), flush=True)
        del model, params, arrays, plain_head

    started = _dt.datetime.now(_dt.timezone.utc)
    stem = args.out.removesuffix(".json") if args.out else result_stem("pass_cost", args.models.replace(",", "-") + (f"-{args.dtype}" if args.dtype else ""), started)
    record = {"command": _switch_prefix() + "python -m benchmarks.bench_pass_cost " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "versions": versions(), "backend": jax.default_backend(),
              "settings": vars(args), "matmul": cpu_matmul.describe() if kernel else "XLA dot",
              "load_avg_before": load_before, "load_avg": os.getloadavg(), "results": results}
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", stem + ".json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
