"""The module path under which ampnet 0.3 pickled its state-dict hooks of
``amp_fp32_modules='auto'``; see :mod:`ampnet.precision.legacy`."""

from ampnet.precision.legacy import AutoChoiceHooks

__all__ = ["AutoChoiceHooks"]
