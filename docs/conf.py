"""Sphinx configuration of the jaxspec documentation (MyST Markdown, myst-nb, sphinx-book-theme).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (``pip install -e '.[docs]'``).
"""

import os
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the jaxspec of this checkout, whatever is installed
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "jaxspec"
author = "the jaxspec authors"
copyright = "the jaxspec authors; Apache-2.0"

extensions = [
    "myst_nb",  # MyST Markdown pages and notebooks (registers myst_parser itself)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.viewcode",
    "sphinxarg.ext",  # the command-line reference, from jaxspec.cli's argparse parser
    "results_tables",  # benchmark tables generated from benchmarks/results/*.json
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_generated/results", "Thumbs.db", ".DS_Store"]  # results: pulled in by {include}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
myst_ref_domains = ["std", "py"]  # Markdown links resolve to pages and Python objects only

# colab/quickstart.ipynb is rendered from its stored outputs, never executed here.
nb_execution_mode = "off"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "jaxspec"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
}

# The notebook lives in colab/ (where Colab opens it); Sphinx reads only below docs/, so the
# build copies it in (docs/_generated is git-ignored).
_generated = os.path.join(os.path.dirname(__file__), "_generated")
os.makedirs(_generated, exist_ok=True)
shutil.copyfile(os.path.join(ROOT, "colab", "quickstart.ipynb"), os.path.join(_generated, "quickstart.ipynb"))


def _check_api_page(app):
    """Every name in ``jaxspec.__all__`` has an autodoc entry in api.md (a warning, so -W fails)."""
    import re

    import jaxspec
    from sphinx.util import logging

    with open(os.path.join(os.path.dirname(__file__), "api.md")) as f:
        listed = set(re.findall(r"^\.\. auto(?:class|function|data):: jaxspec\.(\w+)$", f.read(), re.M))
    for name in sorted(set(jaxspec.__all__) - listed):
        logging.getLogger(__name__).warning(f"api.md has no autodoc entry for jaxspec.{name}")


def setup(app):
    app.connect("builder-inited", _check_api_page)
