"""The global random number generator states that exact resume needs:
torch (CPU, and CUDA where it was used), numpy's global ``RandomState``
and Python's ``random``.

The state is a flat ``dict[str, torch.Tensor]``, so that it is saved with
``torch.save`` and read back with ``torch.load(..., weights_only=True)``,
or saved with safetensors, and a malicious file cannot run code.
"""

from __future__ import annotations

import random
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ampnet.exceptions import amp_warn

__all__ = ["get_rng_state", "set_rng_state", "validate_rng_state"]

_VERSION = 1
_MT_WORDS = 624

# key -> (dtype, shape or None for "1-D of any length")
_LAYOUT: "MappingProxyType[str, tuple[torch.dtype, tuple[int, ...] | None]]" = MappingProxyType({
    "ampnet_rng_version": (torch.int64, ()),
    "torch": (torch.uint8, None),
    "numpy.keys": (torch.int64, (_MT_WORDS,)),
    "numpy.pos": (torch.int64, ()),
    "numpy.has_gauss": (torch.int64, ()),
    "numpy.cached_gaussian": (torch.float64, ()),
    "python.version": (torch.int64, ()),
    "python.internal": (torch.int64, (_MT_WORDS + 1,)),
    "python.has_gauss_next": (torch.int64, ()),
    "python.gauss_next": (torch.float64, ()),
})


def get_rng_state() -> dict[str, torch.Tensor]:
    """The current global RNG states as a flat dict of CPU tensors.

    CUDA generators are included only where CUDA was initialized in this
    process (reading them would otherwise start CUDA).
    """
    name, keys, pos, has_gauss, cached = np.random.get_state()
    if name != "MT19937":  # pragma: no cover - numpy's only legacy generator
        raise ValueError(f"Unsupported numpy global generator {name!r}.")
    version, internal, gauss_next = random.getstate()
    state = {
        "ampnet_rng_version": torch.tensor(_VERSION),
        "torch": torch.get_rng_state(),
        "numpy.keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy.pos": torch.tensor(int(pos)),
        "numpy.has_gauss": torch.tensor(int(has_gauss)),
        "numpy.cached_gaussian": torch.tensor(float(cached), dtype=torch.float64),
        "python.version": torch.tensor(int(version)),
        "python.internal": torch.tensor(internal, dtype=torch.int64),
        "python.has_gauss_next": torch.tensor(int(gauss_next is not None)),
        "python.gauss_next": torch.tensor(
            0.0 if gauss_next is None else float(gauss_next), dtype=torch.float64
        ),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda.{index}"] = cuda_state.cpu()
    return state


def validate_rng_state(state: Any, source: str = "the RNG state") -> None:
    """Check an RNG state before any generator is changed.

    Raises
    ------
    ValueError
      Naming ``source`` and the problem: not a dict, missing keys (another
      file), a newer format, wrong dtypes or shapes.
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"{source} does not hold an RNG state: expected a dict, got {type(state).__name__}."
        )
    missing = [key for key in _LAYOUT if key not in state]
    if missing:
        raise ValueError(
            f"{source} is not an ampnet RNG state: keys {missing} are missing (found "
            f"{sorted(map(str, state))[:8]}). Was another file (parameters, optimizer, "
            "scaler) passed as f_rng_state?"
        )
    problems = []
    for key, (dtype, shape) in _LAYOUT.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            problems.append(f"{key} must be a {dtype} tensor, got {got}")
        elif value.dim() != 1 if shape is None else tuple(value.shape) != shape:
            problems.append(f"{key} has shape {tuple(value.shape)}, expected {shape or '1-D'}")
    for key, value in state.items():
        if str(key).startswith("cuda.") and not (
            isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
        ):
            problems.append(f"{key} must be a 1-D torch.uint8 tensor")
    if not problems:
        version = int(state["ampnet_rng_version"])
        if version > _VERSION:
            problems.append(
                f"format version {version} is newer than this ampnet ({_VERSION}); upgrade ampnet"
            )
        if state["torch"].numel() != torch.get_rng_state().numel():
            problems.append(
                f"torch has {state['torch'].numel()} bytes, this torch uses "
                f"{torch.get_rng_state().numel()}"
            )
        for key in ("numpy.keys", "python.internal"):
            words = state[key][:_MT_WORDS]
            if bool(((words < 0) | (words >= 2**32)).any()):
                problems.append(f"{key} holds values outside the 32-bit range")
    if problems:
        raise ValueError(f"{source} holds an invalid RNG state: " + "; ".join(problems) + ".")


def set_rng_state(state: dict[str, torch.Tensor], source: str = "the RNG state") -> None:
    """Validate ``state``, then restore every generator from it.

    CUDA states are restored for the devices present; an :class:`.AmpWarning`
    says when saved CUDA states cannot all be restored (no CUDA here, or
    fewer devices).

    Raises
    ------
    ValueError
      See :func:`validate_rng_state`; no generator is changed then.
    """
    validate_rng_state(state, source)
    cuda = sorted(
        (int(k.split(".", 1)[1]), v) for k, v in state.items() if k.startswith("cuda.")
    )
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(
        (
            "MT19937",
            state["numpy.keys"].numpy().astype(np.uint32),
            int(state["numpy.pos"]),
            int(state["numpy.has_gauss"]),
            float(state["numpy.cached_gaussian"]),
        )
    )
    gauss_next = float(state["python.gauss_next"]) if int(state["python.has_gauss_next"]) else None
    random.setstate(
        (int(state["python.version"]), tuple(int(v) for v in state["python.internal"]), gauss_next)
    )
    if not cuda:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, cuda_state in cuda:
        if index < available:
            torch.cuda.set_rng_state(cuda_state.cpu(), index)
    if available < len(cuda):
        amp_warn(
            f"{source} holds CUDA RNG states for {len(cuda)} device(s), but only "
            f"{available} CUDA device(s) are available here; the other states were not "
            "restored, so CUDA random numbers (e.g. dropout on the GPU) will differ from "
            "the interrupted run.",
        )
