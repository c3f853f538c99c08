"""Which parametrized cases CI runs.

CI must stay under 30 minutes on a 2-core machine, so a test's full matrix (every drafter at
every gamma and setting, every mesh) runs in the ``slow`` set, and CI runs the cases in
``keep``: every drafter kind and every setting at least once. ``slow`` tests are deselected by
default (``pyproject.toml``); ``python -m pytest -q -n 2 --dist loadfile -m slow tests`` runs
them (docs/contributing.md, "The slow marker").
"""

from __future__ import annotations

import pytest


def core(cases, keep) -> list:
    """``cases`` (values of one argname, or tuples of several) for ``pytest.mark.parametrize``,
    every case not in ``keep`` marked ``slow``; ids are as for the bare values.

    Raises:
      ValueError: a ``keep`` entry that is not among ``cases`` (a renamed case would otherwise
        silently leave CI).
    """
    cases = list(cases)
    missing = [k for k in keep if k not in cases]
    if missing:
        raise ValueError(f"kept cases {missing} are not among the cases")
    return [c if c in keep else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
            for c in cases]
