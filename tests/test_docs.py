"""The documentation's checks that need no Sphinx: the README quotes its results table from the
results file (``docs/_ext/results_tables.py``), stays a front door, and cites only what exists."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import results_tables  # noqa: E402


def test_readme_results_table_is_the_results_file():
    """README.md's results table is ``readme_headline()`` exactly: regenerated, never hand-edited."""
    assert results_tables.readme_headline() in (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_results_files_exist():
    for path, kind in results_tables.RESULTS.values():
        assert (ROOT / path).is_file(), path
        assert kind in results_tables.KINDS


def test_no_citation_of_a_missing_design_file():
    """Code, tests and benchmarks cite the design as docs/design.md, which exists."""
    assert (ROOT / "docs" / "design.md").is_file()
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "grep", "-l", "DESIGN" + ".md"], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", out.stdout


def test_docs_links_in_readme_resolve():
    import re

    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert os.path.exists(ROOT / target), target
