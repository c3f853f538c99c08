"""What every benchmark records about where and with what it ran, shared by the scripts here.

``machine_info`` (CPU model, cores, memory), ``versions`` (jax, torch, transformers, ...,
and the jaxspec git commit), ``command`` (the exact command line), ``result_stem`` (the
default results path, ``benchmarks/README.md``'s naming scheme), ``median``, a logging
handler that collects warnings into the result JSON, and ``set_omp_wait_policy`` (torch's
OpenMP threads on a shared CPU; see its docstring).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")  # every script's default output folder


def machine_info() -> dict:
    """CPU model (``/proc/cpuinfo``), logical cores (all, and usable by this process), total
    memory in GiB, platform string and host name."""
    cpu = mem_gib = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("MemTotal")), None)
            mem_gib = None if kib is None else round(kib / 2**20, 1)
    except OSError:
        pass
    return {"platform": platform.platform(), "processor": platform.processor() or None, "cpu_model": cpu,
            "cores": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)), "mem_total_gib": mem_gib,
            "hostname": platform.node()}


def versions() -> dict:
    """Installed versions of python, jax, jaxlib, torch, transformers and the other packages a
    benchmark touches (None when absent), ``jaxspec`` (package version) and ``jaxspec_git``
    (HEAD of this checkout, ``+dirty(jaxspec/)`` when the library has uncommitted changes)."""
    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "torch", "transformers", "numpy", "gguf", "tokenizers", "accelerate", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    import jaxspec

    out["jaxspec"] = jaxspec.__version__
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "jaxspec"],
                               capture_output=True, text=True, check=True)
        out["jaxspec_git"] = head.stdout.strip() + ("+dirty(jaxspec/)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        out["jaxspec_git"] = None
    return out


def command(argv=None, module: str | None = None) -> str:
    """The command line as a shell re-runs it from the repository root: the interpreter,
    ``-m module`` and the arguments (``argv``, default ``sys.argv[1:]``), quoted. ``module``
    defaults to the module run as ``__main__`` (``python -m benchmarks.spec_bench``); a script run
    by its path (no module) is recorded as ``sys.argv``."""
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None and spec.name.startswith("benchmarks.") else None
    args = list(sys.argv[1:] if argv is None else argv)
    words = ["-m", module] + args if module else (list(sys.argv) if argv is None else args)
    return " ".join(shlex.quote(a) for a in [sys.executable] + words)


def host_kind() -> str:
    """The host kind of a results file name: ``cpu`` on jax's CPU backend, else the device kind,
    lower case, spaces as hyphens (``nvidia-h200``, ``tpu-v5-lite``)."""
    import jax

    if jax.default_backend() == "cpu":
        return "cpu"
    return jax.devices()[0].device_kind.lower().replace(" ", "-")


def result_stem(benchmark: str, variant: str, date=None, host: str | None = None) -> str:
    """``benchmarks/results/<benchmark>_<variant>_<host kind>_<date>`` (no extension): the
    naming scheme of ``benchmarks/README.md``. ``variant`` is what tells the run apart (model,
    then settings), its words joined by hyphens, never underscores; ``date`` a ``datetime``/``date``
    (default today, UTC)."""
    import datetime as _dt

    date = date or _dt.datetime.now(_dt.timezone.utc)
    variant = re.sub(r"[^A-Za-z0-9.]+", "-", variant).strip("-").lower()
    return os.path.join(RESULTS, f"{benchmark}_{variant}_{host or host_kind()}_{date:%Y-%m-%d}")


def write_record(record: dict, path: str) -> None:
    """Write a benchmark's JSON record (parent folders made) and say where, with its
    ``elapsed_s``."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path} ({record['elapsed_s']:.0f} s)")


def median(xs):
    """Median of the values that are neither None nor NaN; None when there are none."""
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


class CollectWarnings(logging.Handler):
    """A logging handler that keeps ``"logger: message"`` of every WARNING and above (attach it
    to transformers' logger and to ``py.warnings`` to record what the peers complained about)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def set_omp_wait_policy(choice: str | None) -> str | None:
    """Set ``OMP_WAIT_POLICY`` for torch's OpenMP; must run before torch is first imported.

    ``None``: keep the environment's value, else PASSIVE; ``"unset"``: remove it (libgomp's
    default, active spinning); ``"PASSIVE"``/``"ACTIVE"``: set it. Reason: on a 2-core
    machine shared with other processes, torch's libgomp with 2 spin-waiting threads ran
    SmolLM2 decoding 5-10x slower than with 1 thread (32 tokens in 8-15 s vs 1.4 s), while
    with passive waiting 2 threads took 1.4-1.6 s, with or without the other load (measured
    2026-11-30). XLA's thread pool does not spin this way. Returns the value now in effect.
    """
    if choice == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    elif choice is not None:
        os.environ["OMP_WAIT_POLICY"] = choice
    else:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        print("warning: torch was imported before OMP_WAIT_POLICY was set; it has no effect", file=sys.stderr)
    return os.environ.get("OMP_WAIT_POLICY")
