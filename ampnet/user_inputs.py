"""Moved to :mod:`ampnet.training.user_inputs` in 0.4.0; ``ampnet.user_inputs`` keeps working as an import path."""

from ampnet.training.user_inputs import *  # noqa: F401,F403
from ampnet.training.user_inputs import __all__  # noqa: F401
