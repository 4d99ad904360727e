"""The dtypes ampnet treats as low precision, defined once for the package.

This module imports nothing of ampnet, so any module can use it.
"""

from __future__ import annotations

import torch

__all__ = ["LOW_PRECISION_DTYPES"]

#: The low-precision floating dtypes: what ``amp_dtype`` may name, what pure
#: low precision narrows parameters to, what compensated updates apply to.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
