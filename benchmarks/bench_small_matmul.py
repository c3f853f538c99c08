"""Why a T-token verify costs more than a 1-token pass on a CPU: the cost of one
``x [T, K] @ W [K, N]`` float32 product for T = 1, 2, 5, 9 with XLA (``jax.jit``) and with
numpy's BLAS, at the shape of Qwen2.5-Coder-1.5B's MLP (K 1536, N 8960). Column ``jax_nk``: the
same product with the weights stored ``[N, K]`` (PyTorch's ``nn.Linear`` layout, the one GGUF and
safetensors files hold) and contracted on their minor axis, as ``x @ W.T``.

Four distinct matrices (220 MB) are multiplied per call so that none stays in cache, as in a
forward pass; each figure is the median over ``--reps`` calls, per matrix, with the widths
interleaved round-robin so that machine load hits them alike (one library after the other). A memory-bound product costs
the same for every T (the weights are read once); the ratio to T = 1 is what to read.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_small_matmul.py [--reps 40] [--out PATH]

Set ``XLA_FLAGS`` to try an XLA:CPU option on the jax column (the flags are recorded).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_env import machine_info, versions  # noqa: E402

WIDTHS = (1, 2, 5, 9)


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=1536)
    p.add_argument("--n", type=int, default=8960)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default=f"benchmarks/results/small_matmul_cpu_{_dt.date.today()}.json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((args.k, args.n), dtype=np.float32) for _ in range(4)]
    dev = [jnp.asarray(m) for m in mats]
    dev_nk = [jnp.asarray(np.ascontiguousarray(m.T)) for m in mats]
    f = jax.jit(lambda x, ms: [x @ m for m in ms])
    f_nk = jax.jit(lambda x, ms: [jax.lax.dot_general(x, m, (((1,), (1,)), ((), ()))) for m in ms])
    runs = {"jax": lambda x: jax.block_until_ready(f(x, dev)),
            "jax_nk": lambda x: jax.block_until_ready(f_nk(x, dev_nk)),
            "numpy": lambda x: [x @ m for m in mats]}
    xs = {t: np.ones((t, args.k), np.float32) for t in WIDTHS}
    times = {(lib, t): [] for lib in runs for t in WIDTHS}
    for lib, run in runs.items():
        for t in WIDTHS:
            run(xs[t])  # compile / warm up
    for lib, run in runs.items():  # one library at a time: OpenBLAS's threads spin after a call and
        for _ in range(args.reps):  # would slow XLA's if the two were interleaved
            for t in WIDTHS:
                start = time.perf_counter()
                run(xs[t])
                times[(lib, t)].append((time.perf_counter() - start) / len(mats) * 1e3)
    results = {}
    for lib in runs:
        one = statistics.median(times[(lib, 1)])
        results[lib] = {f"T{t}": {"ms": round(statistics.median(times[(lib, t)]), 3),
                                  "vs_T1": round(statistics.median(times[(lib, t)]) / one, 2)} for t in WIDTHS}
        print(lib, "  ".join(f"T={t}: {v['ms']:.2f} ms ({v['vs_T1']:.2f}x)"
                             for t, v in zip(WIDTHS, results[lib].values())))
    record = {"command": "PYTHONPATH=. python benchmarks/bench_small_matmul.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "versions": versions(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "shape": {"k": args.k, "n": args.n, "matrices": len(mats)}, "reps": args.reps,
              "unit": "ms per product, median", "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
