"""Cost of jaxspec's CPU attention kernel alone (``jaxspec/kernels/cpu_attention.cc``) at a
model's attention shape, for T = 1, 5, 9 new queries, and an A/B of kernel builds in one process.

One call of the timed program runs the kernel once per layer, each layer over its own cache (so
the cache comes from memory, as in a pass, where the weights stream between two reads of a
layer's cache): T queries of H heads over ``committed`` cached keys of K KV heads (a
``slots``-slot cache) plus the window's own T keys, causal among themselves, exactly the
operands a verify pass gives the kernel (``models.forward(write=False)``). Defaults: SmolLM2-135M
(30 layers, 9 heads, 3 KV heads, head dim 64), 200 committed keys in 512 slots.

``--builds a.so,b.so`` adds other builds of the kernel library (e.g. ``g++ -std=c++17 -O3
-ffp-contract=off -fPIC -shared -I<jax.ffi.include_dir()> -Ijaxspec/kernels
jaxspec/kernels/cpu_attention.cc -o b.so``), registered under their own names and interleaved
round-robin with the installed one, so machine load hits them alike; each build's outputs are
compared with the installed build's (bitwise, and the largest difference).

Run from the repository root::

    python -m benchmarks.bench_attention [--dtype bfloat16] [--widths 1,5,9] [--reps 15]
        [--builds /tmp/a.so,/tmp/b.so]

Writes ``benchmarks/results/attention_<dtype>_cpu_<date>.json`` (machine, versions, command)
and prints ms per T per build.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import os
import statistics
import time

from benchmarks.bench_env import command, machine_info, result_stem, versions, write_record


def _program(target: str, caches, scale: float):
    """A jitted ``f(q, k_new, v_new, seen_cache, seen_new)``: the kernel once per layer over that
    layer's cache; returns (a scalar that depends on every call, layer 0's output)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def f(q, kn, vn, sc, sn):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        ys = [jax.ffi.ffi_call(target, out, vmap_method="sequential")(q, k, v, sc, kn, vn, sn,
                                                                     scale=np.float32(scale))
              for k, v in caches]
        return sum(y[0, :, 0, :2].sum() for y in ys), ys[0]

    return jax.jit(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--committed", type=int, default=200)
    p.add_argument("--widths", default="1,5,9", help="comma-separated T values")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="q, cache and new keys")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--builds", default="", help="comma-separated paths of other builds of the kernel library")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/attention_<dtype>_cpu_<date>.json)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.kernels import cpu_matmul

    if not cpu_matmul.enabled():
        raise SystemExit(f"error: the CPU kernels are off: {cpu_matmul.describe()}")
    if args.committed + max(int(w) for w in args.widths.split(",")) > args.slots:
        raise SystemExit(f"error: --committed {args.committed} plus the widest window exceeds --slots {args.slots}")
    started = _dt.datetime.now(_dt.timezone.utc)
    load_before = os.getloadavg()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), np.float32).astype(dtype)

    b, s, kv, h = 1, args.slots, args.kv_heads, args.head_dim
    caches = [(arr(b, s, kv, h), arr(b, s, kv, h)) for _ in range(args.layers)]
    builds = {"installed": cpu_matmul.target("attention")}
    for i, path in enumerate(filter(None, args.builds.split(","))):
        lib = ctypes.cdll.LoadLibrary(os.path.abspath(path))
        name = f"jaxspec_bench_attention_{i}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.JaxspecAttention), platform="cpu")
        builds[path] = name
    scale = 1.0 / h**0.5
    programs = {name: _program(target, caches, scale) for name, target in builds.items()}
    widths = [int(w) for w in args.widths.split(",")]
    operands = {}
    for t in widths:
        seen_cache = jnp.broadcast_to(jnp.arange(s) < args.committed, (b, t, s))
        seen_new = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        operands[t] = (arr(b, t, args.heads, h), arr(b, t, kv, h), arr(b, t, kv, h), seen_cache, seen_new)
    outputs = {(name, t): np.asarray(f(*operands[t])[1]) for name, f in programs.items() for t in widths}
    times = {(name, t): [] for name in programs for t in widths}
    for _ in range(args.reps):
        for name, f in programs.items():
            for t in widths:
                start = time.perf_counter()
                f(*operands[t])[0].block_until_ready()
                times[(name, t)].append((time.perf_counter() - start) * 1e3)
    results = {}
    for name in programs:
        results[name] = {}
        for t in widths:
            ref, got = outputs[("installed", t)], outputs[(name, t)]
            results[name][f"T{t}"] = {"ms": round(statistics.median(times[(name, t)]), 3),
                                      "bitwise_equal_installed": bool(np.array_equal(ref, got)),
                                      "max_abs_diff_installed": float(np.max(np.abs(ref - got)))}
        print(f"{name}: " + "  ".join(f"T={t} {results[name][f'T{t}']['ms']:.3f} ms" for t in widths)
              + ("" if name == "installed" else "  (bitwise equal: "
                 + ", ".join(str(results[name][f"T{t}"]["bitwise_equal_installed"]) for t in widths) + ")"))
    record = {"command": command(argv, "benchmarks.bench_attention"), "started": started.isoformat(),
              "machine": machine_info(), "versions": versions(), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "settings": vars(args),
              "unit": f"ms per call of the program ({args.layers} kernel calls), median of --reps",
              "results": results,
              "elapsed_s": (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()}
    write_record(record, args.out or result_stem("attention", args.dtype, host="cpu") + ".json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
