"""Moved to :mod:`ampnet.diagnostics.report` in 0.4.0; ``ampnet.report`` keeps working as an import path."""

from ampnet.diagnostics.report import *  # noqa: F401,F403
from ampnet.diagnostics.report import __all__  # noqa: F401
