"""Moved to :mod:`ampnet.utils.random_state` in 0.4.0; ``ampnet.random_state`` keeps working as an import path."""

from ampnet.utils.random_state import *  # noqa: F401,F403
from ampnet.utils.random_state import __all__  # noqa: F401
