"""The precision policy: the resolved description of a net's precision.

A :class:`PrecisionPolicy` is resolved from the net's ``amp_enabled``,
``amp_dtype``, ``amp_level`` and ``device`` when the precision component
(:class:`ampnet.precision.component.Precision`) is built; it is the
read-only ``precision_policy_``. The component acts on it.
"""

from __future__ import annotations

import difflib
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.utils.values import describe, is_bool

__all__ = [
    "PrecisionPolicy",
    "resolve_precision",
    "parse_amp_dtype",
    "cpu_has_native_bf16",
    "DTYPE_ALIASES",
    "check_bool",
    "dtype_name",
    "AMP_LEVELS",
]

#: Accepted spellings of ``amp_dtype``.
DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

#: Accepted values of ``amp_level``.
AMP_LEVELS = ("mixed", "pure")

_VALID_DTYPES_TEXT = (
    "'auto', 'float16' (or 'fp16', 'half'), 'bfloat16' (or 'bf16'), "
    "torch.float16 or torch.bfloat16"
)


def dtype_name(dtype: torch.dtype | None) -> str:
    """``'bfloat16'`` for ``torch.bfloat16``; ``'-'`` for None."""
    return "-" if dtype is None else str(dtype).replace("torch.", "")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX).

    Read from ``/proc/cpuinfo`` on Linux; on other systems only Apple
    silicon (arm64 macOS) is treated as native. Without native support CPU
    bf16 autocast is emulated and can be slower than float32.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def parse_amp_dtype(amp_dtype: Any) -> torch.dtype | None:
    """Return the torch dtype for ``amp_dtype``, or None for ``'auto'``.

    Raises
    ------
    ValueError
      For an unknown name or a dtype that is not a 16-bit float type.

    TypeError
      For a value that is neither a string nor a ``torch.dtype``.
    """
    if isinstance(amp_dtype, torch.dtype):
        if amp_dtype in LOW_PRECISION_DTYPES:
            return amp_dtype
        raise ValueError(
            f"amp_dtype must be one of {_VALID_DTYPES_TEXT}; got {describe(amp_dtype)}. "
            "Mixed precision computes in a 16-bit float type; to train in "
            f"{amp_dtype} set amp_enabled=False instead."
        )
    if isinstance(amp_dtype, str):
        key = str.lower(str.strip(amp_dtype))
        if key == "auto":
            return None
        if key in DTYPE_ALIASES:
            return DTYPE_ALIASES[key]
        hint = difflib.get_close_matches(key, ["auto", *DTYPE_ALIASES], n=1)
        fix = (f" Did you mean {hint[0]!r}?" if hint else
               " Fix: amp_dtype='auto' (the dtype that suits the device), 'bfloat16' or 'float16'; "
               "float8 training is not supported.")
        if key in ("float32", "fp32", "float", "float64", "double"):
            fix = " To train in full precision, set amp_enabled=False instead."
        raise ValueError(
            f"amp_dtype must be one of {_VALID_DTYPES_TEXT}; got {describe(amp_dtype)}.{fix}"
        )
    raise TypeError(
        f"amp_dtype must be a str or a torch.dtype, one of {_VALID_DTYPES_TEXT}; "
        f"got {describe(amp_dtype)}."
    )


def _parse_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be a torch device such as 'cpu', 'cuda', 'cuda:1' or 'mps'; "
            f"got {describe(device)}. Fix: pass device='cuda' for the GPU or device='cpu'."
        ) from exc


@dataclass(frozen=True)
class PrecisionPolicy:
    """Every precision decision of one net, resolved at ``initialize()``.

    Parameters
    ----------
    enabled : bool
      Whether autocast (or pure low-precision weights) is active.

    device_type : str
      ``'cpu'``, ``'cuda'``, ``'mps'``, ...: the device type autocast runs on.

    compute_dtype : torch.dtype or None
      The low-precision dtype, or None when AMP is off.

    uses_scaler : bool
      Whether loss scaling is needed by default (float16 only).

    level : str
      ``'mixed'`` (autocast, float32 weights) or ``'pure'`` (low-precision
      weights with float32 master copies).

    notices : tuple of str
      Reasons why the requested precision may bring no benefit on this
      device; the net emits each once per fit as an :class:`.AmpWarning`.
    """

    enabled: bool
    device_type: str
    compute_dtype: torch.dtype | None
    uses_scaler: bool
    level: str = "mixed"
    notices: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        """Short readable name: ``'float32'``, ``'bfloat16 (mixed)'``, ..."""
        if not self.enabled:
            return "float32"
        return f"{dtype_name(self.compute_dtype)} ({self.level})"


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool; Python and numpy booleans are accepted.

    Raises
    ------
    TypeError
      For anything else, naming ``name``.
    """
    if is_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be True or False; got {describe(value)}.")


def resolve_precision(
    amp_enabled: Any,
    amp_dtype: Any,
    device: Any,
    amp_level: Any = "mixed",
) -> PrecisionPolicy:
    """Resolve and validate the precision settings of a net.

    ``amp_dtype='auto'`` picks bfloat16 where the device computes it
    natively (a CPU with AVX512-BF16 or AMX, a CUDA device of compute
    capability 8.0 or newer) and float16 on other CUDA and MPS devices. On
    a CPU without native bf16, ``'auto'`` still picks bfloat16 (float16 on
    CPU is usually slower) and the policy carries a notice saying so.

    Raises
    ------
    TypeError
      ``amp_enabled`` is not a bool, or ``amp_dtype`` has a wrong type.

    ValueError
      An unknown ``amp_dtype`` or ``amp_level``, an invalid device, CUDA
      requested without CUDA (or any other backend, such as MPS or XLA,
      that is not available), or bfloat16 on a GPU without bf16 support.
    """
    enabled = check_bool("amp_enabled", amp_enabled)
    requested = parse_amp_dtype(amp_dtype)
    if amp_level not in AMP_LEVELS:
        raise ValueError(
            f"amp_level must be one of {', '.join(map(repr, AMP_LEVELS))}; got "
            f"{describe(amp_level)}. 'mixed' runs autocast over float32 weights; "
            "'pure' stores weights in the low-precision dtype with float32 master copies."
        )
    if not enabled:
        # AMP off: accept any device skorch accepts (skorch only passes it to
        # .to()); it is validated where autocast needs it.
        try:
            device_type = _parse_device(device).type
        except ValueError:
            device_type = str(device)
        return PrecisionPolicy(False, device_type, None, False, amp_level)
    dev = _parse_device(device)

    notices: list[str] = []
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"amp_enabled=True with device={describe(device)}, but CUDA is not "
                "available on this machine. ampnet never falls back to float32 "
                "silently. Fix: set device='cpu' (bfloat16 autocast runs on CPU) or "
                "run on a machine with a GPU."
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        bf16_ok = torch.cuda.get_device_capability(index) >= (8, 0)
        dtype = requested or (torch.bfloat16 if bf16_ok else torch.float16)
        if dtype == torch.bfloat16 and not bf16_ok:
            raise ValueError(
                f"amp_dtype={describe(amp_dtype)} needs a GPU of compute capability "
                f"8.0 or newer; {torch.cuda.get_device_name(index)} has "
                f"{torch.cuda.get_device_capability(index)}. Fix: amp_dtype='float16'."
            )
    elif dev.type == "cpu":
        native = cpu_has_native_bf16()
        dtype = requested or torch.bfloat16
        if dtype == torch.float16:
            notices.append(
                "float16 autocast on CPU is correct but often slower than float32, by a "
                "factor that depends on the model and the CPU (few CPUs compute float16 "
                "natively); it is useful to exercise loss scaling on a CPU. For speed on "
                "CPU use amp_dtype='bfloat16'."
            )
        elif not native:
            notices.append(
                "this CPU has no native bfloat16 (AVX512-BF16 or AMX): bf16 autocast "
                "is emulated and may be slower than float32."
            )
    else:
        dtype = requested or (torch.float16 if dev.type == "mps" else torch.bfloat16)
    if not torch.amp.is_autocast_available(dev.type):
        raise ValueError(
            f"amp_enabled=True, but torch has no autocast for device type "
            f"{dev.type!r} (device={describe(device)}). Fix: use 'cpu' or 'cuda', or "
            "set amp_enabled=False."
        )
    return PrecisionPolicy(
        True, dev.type, dtype, dtype == torch.float16, amp_level, tuple(notices)
    )
