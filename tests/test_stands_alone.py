"""The repository stands alone: nothing in the product, its tests, docs or CI reads a file
outside the repository root (a fresh clone in an empty folder has no sibling folders).

Two checks, both fast: no tracked text file names a path that climbs out of the repository
(``../<folder>``), and every module-level path constant of ``jaxspec`` and ``benchmarks``
(an absolute ``str`` after import) resolves inside the repository, or outside it only where
it names a per-user location (home, temp, cache) rather than a file the repository holds.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# how a path climbs above the repository root: "../shared", join(.., "..", "shared"), join(ROOT, "..")
_CLIMB = re.compile(r"""\.\./(?:shared|DESIGN)|["']\.\.["']\s*,\s*["']shared|\bROOT\s*,\s*["']\.\.["']""")
TEXT = (".py", ".sh", ".md", ".toml", ".ipynb", ".txt", ".cfg", ".json", ".yaml", ".yml")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _climbs(path: str) -> list[str]:
    """Lines of ``path`` that name a location above the repository root."""
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    hits = []
    for i, line in enumerate(lines, 1):
        for m in _CLIMB.finditer(line):
            hits.append(f"{path}:{i}: {line.strip()[:120]}")
    return hits


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs the git checkout")
def test_no_tracked_file_climbs_out_of_the_repository():
    files = [p for p in _tracked() if p.endswith(TEXT) or p == ".ci/run"]
    assert ".ci/run" in files and "benchmarks/spec_bench.py" in files  # the scan sees what matters
    hits = [h for p in files if p != "tests/test_stands_alone.py" for h in _climbs(p)]
    assert hits == []


def test_the_climb_pattern_catches_what_it_must():
    """The scan above can fail: the ways the repository once reached a sibling folder match."""
    assert _CLIMB.search('QUESTIONS = os.path.join(ROOT, "..", "shared", "question.jsonl")')
    assert _CLIMB.search("default <repo>/../shared/benchmarks/spec_bench/question.jsonl")
    assert _CLIMB.search("see ../" + "DESIGN" + ".md")  # split: tests/test_docs.py bans the name
    assert _CLIMB.search('os.path.join(ROOT, "..", "data")')
    assert not _CLIMB.search("pip install -e '.[test]' && python -m pytest tests")
    assert not _CLIMB.search('os.path.join(here, "..", "tests", "data")')  # from a subfolder to another


def _module_paths(module) -> list[tuple[str, str]]:
    out = []
    for name, value in vars(module).items():
        if isinstance(value, str) and os.path.isabs(value) and not name.startswith("__"):
            out.append((f"{module.__name__}.{name}", value))
    return out


def _allowed_outside(path: str) -> bool:
    """Per-user or per-run locations a constant may name (caches, temp), never repository data."""
    real = os.path.realpath(path)
    bases = [os.path.expanduser("~"), tempfile.gettempdir(), "/tmp"]
    return any(real == b or real.startswith(os.path.realpath(b) + os.sep) for b in bases)


def test_path_constants_resolve_inside_the_repository():
    """Import every module of ``jaxspec`` and ``benchmarks`` and check each absolute path it
    defines at module level (e.g. ``benchmarks.spec_bench.QUESTIONS``): inside the repository, and
    existing when it names a data file the repository ships."""
    import benchmarks
    import jaxspec

    names = [m.name for pkg in (jaxspec, benchmarks)
             for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".") if not m.name.endswith("__main__")]
    # Python sources only: the CPU kernel's shared library is found as a module but is loaded with ctypes
    names = [n for n in names if (importlib.util.find_spec(n).origin or "").endswith(".py")]
    # modules of an optional extra that lives in its own environment (pyproject.toml) import it
    # at module level; they are checked where it is installed
    extra = {"jaxspec.tunix_rollout": "tunix"}
    names = [n for n in names if n not in extra or importlib.util.find_spec(extra[n]) is not None]
    modules = [jaxspec, benchmarks] + [importlib.import_module(n) for n in names]
    assert "benchmarks.experiments.head_confidence" in {m.__name__ for m in modules}  # the walk reaches subpackages
    found = [c for m in modules for c in _module_paths(m)]
    names = {n for n, _ in found}
    assert "benchmarks.spec_bench.QUESTIONS" in names  # the constant issue-prone before: it is checked
    root = os.path.realpath(ROOT)
    not_paths = {"jaxspec.compile_cache.HIT_EVENT"}  # a jax.monitoring event name that starts with "/"
    outside = [(n, p) for n, p in found if n not in not_paths and not _allowed_outside(p)
               and not (os.path.realpath(p) + os.sep).startswith(root + os.sep)]
    assert outside == []
    from benchmarks import spec_bench

    assert os.path.isfile(spec_bench.QUESTIONS)
