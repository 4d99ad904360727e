"""Precision: policy, per-module plan, regions, master weights, loss scaler and report.

This package's front door: modules outside :mod:`ampnet.precision` import
only the names listed in ``__all__`` here, never a submodule
(``tests/test_architecture.py`` checks it). The first group is the public
API; the second is what the rest of ampnet (the net, persistence, export,
diagnosis) uses of the precision component.
"""

from ampnet.precision.auto import METADATA_KEY as AUTO_METADATA_KEY
from ampnet.precision.auto import choice_problem, find_auto_hooks, remove_auto_hooks
from ampnet.precision.auto_probe import resolve_auto_fp32
from ampnet.precision.autotune import (
    AutotuneResult, add_saved_choice, autotune_settings, effective_params, is_auto, plan_saved_choice,
    read_saved_choice,
)
from ampnet.precision.autotune_probe import run_probe
from ampnet.precision.compensated import KEY as COMPENSATION_KEY
from ampnet.precision.compensated import compensation_of, drop_compensation
from ampnet.precision.checks import grads_by_device_dtype
from ampnet.precision.component import Precision, build_scaler, module_root
from ampnet.precision.devices import check_device
from ampnet.precision.inputs import autocast_dtype_error
from ampnet.precision.kernels import ampnet_kernels, keep_kernels, kernel_defaults, kernels_differ
from ampnet.precision.masters import remove_state_hooks
from ampnet.precision.memory import MemoryReport, measure_memory
from ampnet.precision.no_effect import is_default, warn_ineffective_settings
from ampnet.precision.plan import PrecisionLayout
from ampnet.precision.policy import (
    DTYPE_ALIASES, PrecisionPolicy, cpu_has_native_bf16, dtype_name, parse_amp_dtype, resolve_precision,
)
from ampnet.precision.regions import remove_regions
from ampnet.precision.report import PrecisionReport, build_report
from ampnet.precision.scaler import LIVE_SETTINGS, GradScaler
from ampnet.precision.scaler_checks import validate_scaler_state
from ampnet.precision.settings import PRECISION_PARAMS, read_settings

__all__ = [
    # public API
    "GradScaler",
    "MemoryReport",
    "PrecisionLayout",
    "PrecisionPolicy",
    "PrecisionReport",
    "AutotuneResult",
    "cpu_has_native_bf16",
    "measure_memory",
    "parse_amp_dtype",
    "resolve_precision",
    # used by the rest of ampnet
    "AUTO_METADATA_KEY",
    "COMPENSATION_KEY",
    "DTYPE_ALIASES",
    "LIVE_SETTINGS",
    "PRECISION_PARAMS",
    "Precision",
    "add_saved_choice",
    "ampnet_kernels",
    "autocast_dtype_error",
    "autotune_settings",
    "build_report",
    "build_scaler",
    "check_device",
    "choice_problem",
    "compensation_of",
    "grads_by_device_dtype",
    "drop_compensation",
    "dtype_name",
    "effective_params",
    "find_auto_hooks",
    "is_auto",
    "is_default",
    "keep_kernels",
    "kernel_defaults",
    "kernels_differ",
    "module_root",
    "plan_saved_choice",
    "read_saved_choice",
    "read_settings",
    "remove_auto_hooks",
    "remove_regions",
    "remove_state_hooks",
    "resolve_auto_fp32",
    "run_probe",
    "validate_scaler_state",
    "warn_ineffective_settings",
]
