"""Sphinx configuration for the attnfast documentation.

Build: ``pip install ".[docs]" && python -m sphinx -W docs docs/_build/html``.
The gallery (docs/examples/plot_*.py) runs every example while the site is built; the same
scripts run in the test suite on small sizes (tests/test_docs.py).
"""
from pathlib import Path

import attnfast

HERE = Path(__file__).resolve().parent

project = "attnfast"
copyright = "the attnfast developers"
author = "the attnfast developers"
release = attnfast.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py",
                    "auto_examples/*.zip", "auto_examples/*.json", "auto_examples/*.md5",
                    "examples/README.rst", "sg_execution_times.rst"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True, "inherited-members": False}
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    "matplotlib_animations": False,
    "show_signature": False,
}

html_theme = "pydata_sphinx_theme"
html_title = f"attnfast {release}"
html_static_path = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
}
html_context = {"default_mode": "light"}
