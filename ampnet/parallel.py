"""Moved to :mod:`ampnet.training.parallel` in 0.4.0; ``ampnet.parallel`` keeps working as an import path
(nets pickled by ampnet 0.3 name their data-parallel component by it)."""

from ampnet.training.parallel import *  # noqa: F401,F403
from ampnet.training.parallel import DataParallel, Parallel, __all__  # noqa: F401
