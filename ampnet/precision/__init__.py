"""Precision: policy, per-module plan, regions, master weights, loss scaler and report.

This package's front door: modules outside :mod:`ampnet.precision` import
only the names listed in ``__all__`` here, never a submodule
(``tests/ecosystem/test_architecture.py`` checks it). The first group is the public
API; the second is what the rest of ampnet (the net, persistence, export,
diagnosis) uses of the precision component.

The lowest layer of ampnet above its plain helpers: it knows tensors,
modules, optimizers and scalers, never a net. It imports nothing from the
net, :mod:`ampnet.io`, :mod:`ampnet.auto` or :mod:`ampnet.config.params` (whatever
needs the net lives above it), and reads or writes no net's ``__dict__``.
"""

from ampnet.precision.compensated import KEY as COMPENSATION_KEY
from ampnet.precision.compensated import compensation_of, drop_compensation
from ampnet.precision.compensated import FLOAT16_SAFE as FLOAT16_SAFE_COMPENSATED
from ampnet.precision.compensated import SUPPORTED as SUPPORTED_COMPENSATED
from ampnet.precision.checks import fused_check_fits, fused_nonfinite, grads_by_device_dtype, nonfinite_grads
from ampnet.precision.component import NO_CONTEXT, Precision, module_root
from ampnet.precision.scaler_build import build_scaler
from ampnet.precision.kinds import precision_class  # imports the kinds: Precision(settings, scaler) builds one
from ampnet.precision.kinds.float8 import FIX_INSTALL as FLOAT8_FIX_INSTALL
from ampnet.precision.devices import check_device
from ampnet.precision.inputs import autocast_dtype_error
from ampnet.precision.kernels import (
    KERNEL_KEYS, keep_kernels, kernel_defaults, kernels_differ, set_kernels, user_chose_kernel,
)
from ampnet.precision.masters import remove_state_hooks
from ampnet.precision.memory import MemoryReport, measure_memory
from ampnet.precision.plan import PrecisionLayout, is_inside
from ampnet.precision.policy import (
    AMP_LEVELS, DTYPE_ALIASES, PrecisionPolicy, cpu_has_native_bf16, dtype_name, parse_amp_dtype, resolve_precision,
)
from ampnet.precision.regions import remove_regions
from ampnet.precision.scaler import DEFAULTS as SCALER_DEFAULTS, LIVE_SETTINGS, GradScaler
from ampnet.precision.scaler_checks import validate_scaler_settings, validate_scaler_state
from ampnet.precision.selectors import parse_selectors
from ampnet.precision.settings import PrecisionSettings, build_settings, init_param_names

__all__ = [
    "NO_CONTEXT",
    # public API
    "GradScaler",
    "MemoryReport",
    "PrecisionLayout",
    "PrecisionPolicy",
    "cpu_has_native_bf16",
    "measure_memory",
    "parse_amp_dtype",
    "resolve_precision",
    # used by the rest of ampnet
    "AMP_LEVELS",
    "LIVE_SETTINGS",
    "SCALER_DEFAULTS",
    "COMPENSATION_KEY",
    "FLOAT16_SAFE_COMPENSATED",
    "SUPPORTED_COMPENSATED",
    "DTYPE_ALIASES",
    "Precision",
    "precision_class",
    "FLOAT8_FIX_INSTALL",
    "autocast_dtype_error",
    "build_scaler",
    "check_device",
    "compensation_of",
    "grads_by_device_dtype",
    "fused_check_fits",
    "fused_nonfinite",
    "nonfinite_grads",
    "drop_compensation",
    "dtype_name",
    "keep_kernels",
    "set_kernels",
    "kernel_defaults",
    "KERNEL_KEYS",
    "kernels_differ",
    "user_chose_kernel",
    "parse_selectors",
    "validate_scaler_settings",
    "PrecisionSettings",
    "build_settings",
    "init_param_names",
    "module_root",
    "is_inside",
    "remove_regions",
    "remove_state_hooks",
    "validate_scaler_state",
]
