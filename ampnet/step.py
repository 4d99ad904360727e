"""Moved to :mod:`ampnet.training.step` in 0.4.0; ``ampnet.step`` keeps working as an import path."""

from ampnet.training.step import *  # noqa: F401,F403
from ampnet.training.step import __all__  # noqa: F401
