"""The documentation site (Sphinx + MyST Markdown + Furo): ``make docs`` builds it into
``site/`` with every warning an error (a broken link, a page in no table of contents, a bad
reference or docstring fails the build); ``make docs-serve`` serves it on 127.0.0.1:8000.

Sources are ``docs/*.md``. The configuration and command-line references are generated from
the code as the pages are read (``_ext/otbrl_docs.py``), the Python API from the docstrings
(autodoc), math is rendered to MathML at build time: the site needs no network to read.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent / "src"))

project = "otbrl"
author = "the otbrl authors"
copyright = "2026, the otbrl authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "otbrl_docs"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "img/README*"]

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist", "html_image"]
myst_heading_anchors = 4  # `page.md#a-heading` links resolve, and are checked
# `$` in prose (shell variables, prices) is not math unless it encloses a formula
myst_dmath_allow_space = False

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
# Types from other packages (torch, transformers) have no pages here to link to
nitpicky = False

html_theme = "furo"
html_title = "otbrl"
html_static_path = ["_static"]
html_css_files = ["otbrl.css"]
html_math_renderer = "mathml"
html_show_sourcelink = False
html_copy_source = False
html_favicon = "img/favicon.svg"

# autodoc imports the TRL plug-in, whose trl warns about the CPU vLLM build's version: not
# the site's business
import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
