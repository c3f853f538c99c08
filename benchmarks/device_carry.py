"""Put a packaged model on an offline accelerator host that accepts at most 64 MiB per transfer,
the repository's files included (``LIMIT_MIB``): the model's GGUF is split into parts under
``.devcarry/`` (git-ignored), each transfer sends one part to the host, which keeps them between
transfers, and the last transfer's command joins them, checks the result against the packaged
model's size and sha256, and runs the benchmark (``benchmarks/device_smollm2.sh``).

Here, from the repository root::

    python -m benchmarks.device_carry prepare     # parts, gguf wheel; prints the transfers

prints, as JSON, the transfers to make in order: ``carry`` (the paths to send beside the
repository) and ``command`` (what to run on the host). Make them back to back: a host reset
between transfers loses the parts it had (the last command then says which parts are
missing). On the host (the last transfer's command runs it)::

    python3 -m benchmarks.device_carry assemble --site /tmp/site   # join, check sha256, place

writes the GGUF where ``jaxspec.load(name)`` finds it once ``/tmp/site`` is on ``PYTHONPATH``
(``<site>/<module>/<file>``, the path the model's wheel would have; a namespace package, no
code), after checking its size and sha256 against ``jaxspec.checkpoints.packaged.MODELS``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRY = ".devcarry"
LIMIT_MIB = 64  # the host's limit per transfer: working tree + carried paths


def tree_bytes() -> int:
    """Bytes of what every transfer sends: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    paths = [p for p in out.decode().split("\0") if p]
    return sum(os.path.getsize(os.path.join(ROOT, p)) for p in paths if os.path.isfile(os.path.join(ROOT, p)))


def _parts(carry: str, model_name: str) -> list[str]:
    """``<carry>/<name>.partNNN`` files in index order (numerically)."""
    found = glob.glob(os.path.join(carry, f"{model_name}.part*"))
    return sorted(found, key=lambda p: int(p.rsplit(".part", 1)[1]) if p.rsplit(".part", 1)[1].isdigit() else -1)


def prepare(model_name: str, margin_mib: float) -> dict:
    """Split ``model_name``'s GGUF into ``.devcarry/<name>.partNNN``, download the ``gguf`` wheel
    there; return the plan of transfers (the Spec-Bench questions travel with the repository,
    ``benchmarks/data/spec_bench/``).

    Raises ``SystemExit`` (with the message) when ``gguf`` is
    not installed here (its wheel is downloaded for the same version), or the working tree
    leaves no room for a part."""
    from importlib.metadata import PackageNotFoundError, version

    from jaxspec.checkpoints import packaged

    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        raise SystemExit("error: the gguf package is not installed here (pip install -e '.[models]'); its wheel "
                         "is sent to the host, which lacks it") from None

    model = packaged.MODELS[model_name]
    src = packaged.gguf_path(model_name)
    carry = os.path.join(ROOT, CARRY)
    os.makedirs(carry, exist_ok=True)
    for old in _parts(carry, model_name):
        os.remove(old)
    for old in glob.glob(os.path.join(carry, "gguf-*.whl")):
        os.remove(old)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", carry,
                    f"gguf=={gguf_version}"], check=True)
    extras = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(carry, "gguf-*.whl")))]
    extra_bytes = sum(os.path.getsize(os.path.join(ROOT, p)) for p in extras)
    room = int((LIMIT_MIB - margin_mib) * 2**20) - tree_bytes()
    part = room - extra_bytes  # the last transfer sends the extras too: every part fits beside them
    if part < 2**20:
        raise SystemExit(f"error: the repository's files ({tree_bytes() / 2**20:.1f} MiB) and the last transfer's extras "
                         f"({extra_bytes / 2**20:.1f} MiB) leave {part / 2**20:.1f} MiB for a part of the "
                         f"{LIMIT_MIB} MiB per transfer")
    parts = []
    with open(src, "rb") as f:
        while block := f.read(part):
            path = os.path.join(CARRY, f"{model_name}.part{len(parts):03d}")
            with open(os.path.join(ROOT, path), "wb") as out:
                out.write(block)
            parts.append(path)
    calls = [{"carry": [p], "command": f"ls -l {CARRY}"} for p in parts[:-1]]
    calls.append({"carry": [parts[-1], *extras], "command": "bash benchmarks/device_smollm2.sh"})
    return {"note": "make the transfers back to back; the repository must not grow by more than the margin "
                    f"({margin_mib} MiB) before them (rerun prepare if it did)",
            "model": model_name, "gguf": src, "bytes": model.chunks[0].size if len(model.chunks) == 1 else None,
            "part_bytes": part, "tree_bytes": tree_bytes(), "calls": calls}


def assemble(model_name: str, site: str, carry: str = os.path.join(ROOT, CARRY)) -> str:
    """Join ``<carry>/<name>.part*`` into ``<site>/<module>/<file>``; check size and sha256.

    Returns the path written. Raises ``SystemExit`` (with the message) for a multi-chunk model,
    parts that do not add up to the model's size (naming the parts found), or a wrong sha256
    (the joined file is removed)."""
    from jaxspec.checkpoints import packaged

    model = packaged.MODELS[model_name]
    if len(model.chunks) != 1:
        raise SystemExit(f"error: {model_name} ships in {len(model.chunks)} chunks; only single-file models "
                         "are placed by this script")
    chunk = model.chunks[0]
    parts = _parts(carry, model_name)
    indices = [p.rsplit(".part", 1)[1] for p in parts]
    if indices != [f"{i:03d}" for i in range(len(parts))]:
        raise SystemExit(f"error: the parts of {model_name} here are {[os.path.basename(p) for p in parts]}, not "
                         f"{model_name}.part000 .. part{len(parts) - 1:03d} in sequence (a transfer lost, or the "
                         "host reset between transfers?)")
    have = sum(os.path.getsize(p) for p in parts)
    if have != chunk.size:
        raise SystemExit(f"error: {len(parts)} part(s) of {model_name} here hold {have} bytes, expected {chunk.size}: "
                         f"{[os.path.basename(p) for p in parts]} (a transfer lost, or the host reset between transfers?)")
    dest = os.path.join(site, chunk.module, chunk.path)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out)
    digest = packaged.sha256_file(dest)
    if digest != model.sha256:
        os.remove(dest)
        raise SystemExit(f"error: the joined {model_name} has sha256 {digest}, expected {model.sha256}")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prepare", "assemble"))
    ap.add_argument("--model", default="smollm2-135m", help="a single-file packaged model (smollm2-135m)")
    ap.add_argument("--site", default="/tmp/site", help="assemble: the folder put on PYTHONPATH (/tmp/site)")
    ap.add_argument("--margin-mib", type=float, default=2.0, help="prepare: MiB left free per transfer (2)")
    args = ap.parse_args(argv)
    if args.action == "prepare":
        print(json.dumps(prepare(args.model, args.margin_mib), indent=1))
    else:
        print(f"placed {assemble(args.model, args.site)} (sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
