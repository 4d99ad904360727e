"""ampnet: skorch nets with automatic mixed precision as a hyper-parameter.

>>> from ampnet import AmpNetClassifier
>>> net = AmpNetClassifier(MyModule, amp_enabled=True, amp_dtype="bfloat16")
"""

from ampnet.exceptions import AmpDivergenceError, AmpStateError, AmpWarning
from ampnet.net import AmpNet, AmpNetBinaryClassifier, AmpNetClassifier, AmpNetMixin, AmpNetRegressor
from ampnet.precision import PrecisionPolicy, resolve_precision
from ampnet.precision import GradScaler
from ampnet.diagnostics.plotting import plot_precision

#: The package version; pyproject.toml reads it from here.
__version__ = "0.4.0"

__all__ = [
    "AmpNet",
    "AmpNetClassifier",
    "AmpNetRegressor",
    "AmpNetBinaryClassifier",
    "AmpNetMixin",
    "GradScaler",
    "PrecisionPolicy",
    "resolve_precision",
    "AmpWarning",
    "AmpDivergenceError",
    "AmpStateError",
    "plot_precision",
    "__version__",
]
