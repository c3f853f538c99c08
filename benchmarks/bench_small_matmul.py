"""Why a T-token verify costs more than a 1-token pass on a CPU, and what jaxspec's CPU kernel
does about it: the cost of one ``x [T, K] @ W [K, N]`` product (float32 x) for T = 1..16 with
XLA (``jax.jit``), with jaxspec's small-T kernel (``jaxspec.kernels.cpu_matmul``, float32 and
bfloat16 weights) and with numpy's BLAS, at the shape of Qwen2.5-Coder-1.5B's MLP (K 1536,
N 8960). Column ``jax_nk`` / ``kernel_nk``: the same product with the weights stored ``[N, K]``
(PyTorch's ``nn.Linear`` layout, the one GGUF and safetensors files hold, and a tied embedding
table) and contracted on their minor axis, as ``x @ W.T``. Column ``kernel_panels``: the weights
in panels (``jaxspec.models.layout``), the layout jaxspec's decoder runs on CPU; on a CPU with
AVX-512, ``kernel_panels_avx2`` is the same program with the kernel capped at its AVX2 path.

Four distinct matrices (220 MB in float32) are multiplied per call so that none stays in cache,
as in a forward pass; each figure is the median over ``--reps`` calls, per matrix, with the
widths interleaved round-robin so that machine load hits them alike (one library after the
other). A memory-bound product costs the same for every T (the weights are read once); the
ratio to T = 1 is what to read, and ``GB_s`` (weight bytes per second) against the machine's
copy bandwidth (``copy_GB_s``: numpy copying a 256 MB array, bytes read + written per second,
median of 5). The load average before and after is recorded: other work on the machine shows.

Run from the repository root::

    python -m benchmarks.bench_small_matmul [--reps 40] [--widths 1,2,...] [--out PATH]

Set ``XLA_FLAGS`` to try an XLA:CPU option on the jax columns (the flags are recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.bench_env import machine_info, result_stem, versions

WIDTHS = (1, 2, 5, 9)


def copy_bandwidth(mbytes: int = 256, reps: int = 5) -> float:
    """GB/s of a numpy copy of a ``mbytes`` MB array (bytes read plus bytes written), median."""
    import numpy as np

    src = np.ones(mbytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return round(2 * src.nbytes / statistics.median(times[1:]) / 1e9, 2)


def _libraries(args, mats):
    """``{name: (run(x), weight bytes per matrix)}`` for the libraries measured."""
    import jax
    import jax.numpy as jnp

    from jaxspec.kernels import cpu_matmul

    def jitted(fn, ms):
        f = jax.jit(lambda x, ms: [fn(x, m) for m in ms])
        return lambda x: jax.block_until_ready(f(x, ms))

    kn = [jnp.asarray(m) for m in mats]
    nk = [jnp.asarray(m.T.copy()) for m in mats]

    def dot_nk(x, m):  # x @ m.T, m stored [N, K]
        return jax.lax.dot_general(x, m, (((1,), (1,)), ((), ())))

    runs = {"jax": (jitted(lambda x, m: x @ m, kn), 4), "jax_nk": (jitted(dot_nk, nk), 4),
            "numpy": ((lambda x: [x @ m for m in mats]), 4)}
    if cpu_matmul.enabled() and jax.default_backend() == "cpu":
        kn16, nk16 = [m.astype(jnp.bfloat16) for m in kn], [m.astype(jnp.bfloat16) for m in nk]
        pan, pan16 = [cpu_matmul.pack_panels(m) for m in kn], [cpu_matmul.pack_panels(m) for m in kn16]
        n = kn[0].shape[1]

        def panels(x, p):
            return cpu_matmul.matmul_panels(x, [p], [n])[0]

        runs.update({"kernel": (jitted(cpu_matmul.matmul_kn, kn), 4),
                     "kernel_nk": (jitted(cpu_matmul.matmul_nk, nk), 4),
                     "jax_bf16": (jitted(lambda x, m: jnp.matmul(x, m, preferred_element_type=jnp.float32), kn16), 2),
                     "kernel_bf16": (jitted(cpu_matmul.matmul_kn, kn16), 2),
                     "kernel_nk_bf16": (jitted(cpu_matmul.matmul_nk, nk16), 2),
                     "kernel_panels": (jitted(panels, pan), 4), "kernel_panels_bf16": (jitted(panels, pan16), 2)})
        if cpu_matmul.isa() == "avx512":  # the same programs on the kernel's AVX2 path (each run blocks inside it)
            runs.update({f"{name}_avx2": (cpu_matmul.limit_isa("avx2")(runs[name][0]), runs[name][1])
                         for name in ("kernel_panels", "kernel_panels_bf16")})
    return runs


def _switch_prefix() -> str:
    """``JAXSPEC_CPU_KERNEL=<v> `` when the kernel's switch is set in the environment."""
    v = os.environ.get("JAXSPEC_CPU_KERNEL")
    return "" if v is None else f"JAXSPEC_CPU_KERNEL={v} "


def main(argv=None) -> int:
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=1536)
    p.add_argument("--n", type=int, default=8960)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated T values")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/small_matmul_<k>x<n>[-kernel]_cpu_<date>.json)")
    args = p.parse_args(argv)
    args.out = args.out or result_stem("small_matmul", f"{args.k}x{args.n}" + ("-kernel" if _switch_prefix() else ""),
                                       host="cpu") + ".json"
    widths = tuple(int(w) for w in args.widths.split(","))
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((args.k, args.n), dtype=np.float32) for _ in range(4)]
    runs = _libraries(args, mats)
    xs = {t: np.ones((t, args.k), np.float32) for t in widths}
    times = {(lib, t): [] for lib in runs for t in widths}
    for lib, (run, _) in runs.items():
        for t in widths:
            run(xs[t])  # compile / warm up
    for lib, (run, _) in runs.items():  # one library at a time: OpenBLAS's threads spin after a call and
        for _ in range(args.reps):  # would slow XLA's if the two were interleaved
            for t in widths:
                start = time.perf_counter()
                run(xs[t])
                times[(lib, t)].append((time.perf_counter() - start) / len(mats) * 1e3)
    copy = copy_bandwidth()
    results = {}
    for lib, (_, itemsize) in runs.items():
        one = statistics.median(times[(lib, widths[0])])
        results[lib] = {}
        for t in widths:
            ms = statistics.median(times[(lib, t)])
            results[lib][f"T{t}"] = {"ms": round(ms, 3), "vs_T1": round(ms / one, 2),
                                     # 4 significant digits: a tiny shape's rate is far below 0.01 GB/s
                                     "GB_s": float(f"{args.k * args.n * itemsize / ms / 1e6:.4g}")}
        print(f"{lib:>14}", "  ".join(f"T={t}: {v['ms']:.2f} ms ({v['vs_T1']:.2f}x, {v['GB_s']:.1f} GB/s)"
                                      for t, v in zip(widths, results[lib].values())))
    print(f"copy bandwidth {copy} GB/s")
    record = {"command": _switch_prefix() + "python -m benchmarks.bench_small_matmul " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "versions": versions(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "copy_GB_s": copy,
              "shape": {"k": args.k, "n": args.n, "matrices": len(mats)}, "reps": args.reps,
              "unit": "ms per product, median; GB_s: weight bytes / time", "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
