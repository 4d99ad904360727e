"""Sphinx configuration of ampnet's documentation site.

Build it with ``python -m sphinx -W docs docs/_build/html`` (the ``docs`` extra installs what it
needs). Markdown pages are MyST; the example notebooks in ``notebooks/`` are executed at build time
by myst-nb. ``AMPNET_DOCS_EXECUTE=off`` skips their execution (the pages then show the outputs stored
in the notebooks); ``cache`` reuses results from ``docs/_build/.jupyter_cache`` while a notebook is
unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# document the ampnet of this checkout, also where another copy is installed
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(  # the notebook kernels import it too
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

import ampnet  # noqa: E402

project = "ampnet"
author = "the ampnet developers"
copyright = "the ampnet developers"  # noqa: A001
release = ampnet.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_nb",
]

exclude_patterns = ["_build", "_data", "jupyter_execute", "**.ipynb_checkpoints"]
templates_path: list[str] = []
html_static_path = ["_static"]
html_theme = "furo"
html_title = f"ampnet {release}"

# -- MyST (Markdown) and myst-nb (notebooks) --------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = {"on": "force", "off": "off", "cache": "cache"}[
    os.environ.get("AMPNET_DOCS_EXECUTE", "on")
]
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a notebook that fails fails the build
nb_execution_in_temp = True  # checkpoints the notebooks write go to a temporary folder
nb_execution_show_tb = True
nb_merge_streams = True

# -- API reference: autodoc + numpydoc ---------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc Parameters sections give the types
autodoc_inherit_docstrings = True
numpydoc_show_class_members = False  # members are listed by autodoc's :members:
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = False
numpydoc_xref_param_type = False

# -- references: a broken reference to an ampnet name fails the -W build --------------------------
# Other projects' inventories would need the network at build time, so their names are not linked;
# the skorch names are those of skorch's own docstrings, which the nets' docstrings include.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|skorch|sklearn|numpy|pickle|joblib|onnxruntime)(\..*)?"),
    (r"py:.*", r"(NeuralNet|NeuralNetClassifier|NeuralNetRegressor|NeuralNetBinaryClassifier"
               r"|BatchScoring|PrintLog|EpochTimer|EpochScoring|Callback)"),
]
