"""The global random number generator states that exact resume needs:
torch (CPU, and CUDA where it was used), numpy's global ``RandomState``
and Python's ``random``.

The state is a flat ``dict[str, torch.Tensor]``, so that it is saved with
``torch.save`` and read back with ``torch.load(..., weights_only=True)``,
or saved with safetensors, and a malicious file cannot run code.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ampnet.exceptions import amp_warn

__all__ = [
    "get_rng_state", "set_rng_state", "prepare_rng_state",
    "PreparedRngState",
]

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
    kind = np.random.get_state(legacy=False).get("bit_generator")
    if kind != "MT19937":
        raise ValueError(
            f"numpy's global generator uses {kind!r} (np.random.set_bit_generator), and "
            "ampnet saves only numpy's default MT19937 state. Fix: pass f_rng_state=None, "
            "or np.random.set_bit_generator(np.random.MT19937(seed))."
        )
    name, keys, pos, has_gauss, cached = np.random.get_state()
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


_CUDA_KEY = re.compile(r"cuda\.(0|[1-9][0-9]{0,3})")

#: Bytes of a CUDA generator state: the seed (uint64) and the Philox offset (int64).
_CUDA_STATE_BYTES = 16


@dataclass(frozen=True)
class PreparedRngState:
    """A checked RNG state, converted to the forms the generators take."""

    torch_state: torch.Tensor
    numpy_state: tuple
    python_state: tuple
    cuda_states: tuple[tuple[int, torch.Tensor], ...]
    source: str

    def apply(self) -> None:
        """Restore every generator (CUDA: those of the devices present)."""
        torch.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)
        random.setstate(self.python_state)
        if not self.cuda_states:
            return
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for index, cuda_state in self.cuda_states:
            if index < available:
                torch.cuda.set_rng_state(cuda_state, index)
        if available < len(self.cuda_states):
            amp_warn(
                f"{self.source} holds CUDA RNG states for {len(self.cuda_states)} device(s), "
                f"but only {available} CUDA device(s) are available here; the other states "
                "were not restored, so CUDA random numbers (e.g. dropout on the GPU) will "
                "differ from the interrupted run.")


def _mt_problems(key: str, words: torch.Tensor) -> list[str]:
    """Problems of the 624 state words of an MT19937 generator."""
    problems = []
    if bool(((words < 0) | (words >= 2**32)).any()):
        problems.append(f"{key} holds values outside the 32-bit range [0, 2**32)")
    elif int(words[0]) & 0x80000000 == 0 and not bool(words[1:].any()):
        # the generator would return zeros forever; no seeding reaches this
        problems.append(f"{key} is the degenerate all-zero Mersenne Twister state")
    return problems


def _flag(state: dict, key: str, problems: list[str]) -> int:
    value = int(state[key])
    if value not in (0, 1):
        problems.append(f"{key}={value} must be 0 or 1")
    return value


def _finite(state: dict, key: str, problems: list[str]) -> float:
    value = float(state[key])
    if not math.isfinite(value):
        problems.append(f"{key}={value} must be a finite number")
    return value


def _check_tensor(key: str, value: Any, dtype: torch.dtype, shape: tuple[int, ...] | None,
                  problems: list[str]) -> bool:
    if not isinstance(value, torch.Tensor):
        problems.append(f"{key} must be a {dtype} tensor, got {type(value).__name__}")
        return False
    if value.layout != torch.strided or value.device.type != "cpu" or value.dtype != dtype:
        problems.append(
            f"{key} must be a dense CPU {dtype} tensor, got {value.dtype} ({value.layout}, "
            f"{value.device.type})"
        )
        return False
    if (value.dim() != 1) if shape is None else (tuple(value.shape) != shape):
        problems.append(f"{key} has shape {tuple(value.shape)}, expected {shape or '1-D'}")
        return False
    return True


def _numpy_problems(state: dict, problems: list[str]) -> tuple | None:
    keys = state["numpy.keys"]
    found = _mt_problems("numpy.keys", keys)
    pos = int(state["numpy.pos"])
    if not 0 <= pos <= _MT_WORDS:
        found.append(f"numpy.pos={pos} must lie in [0, {_MT_WORDS}]")
    has_gauss = _flag(state, "numpy.has_gauss", found)
    cached = _finite(state, "numpy.cached_gaussian", found)
    global_kind = np.random.get_state(legacy=False).get("bit_generator")
    if global_kind != "MT19937":
        found.append(
            f"numpy's global generator uses {global_kind!r} (np.random.set_bit_generator), "
            "which cannot take the saved MT19937 state"
        )
    problems.extend(found)
    if found:
        return None
    numpy_state = ("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    try:
        np.random.RandomState().set_state(numpy_state)  # a scratch generator
    except (ValueError, TypeError) as exc:  # pragma: no cover - the checks above are numpy's
        problems.append(f"numpy refuses the state ({exc})")
        return None
    return numpy_state


def _python_problems(state: dict, problems: list[str]) -> tuple | None:
    found = []
    version = int(state["python.version"])
    if version != random.Random.VERSION:
        found.append(f"python.version={version} must be {random.Random.VERSION}")
    internal = state["python.internal"]
    found += _mt_problems("python.internal", internal[:_MT_WORDS])
    pos = int(internal[_MT_WORDS])
    if not 0 <= pos <= _MT_WORDS:
        found.append(f"python.internal[{_MT_WORDS}] (the position) = {pos} must lie in [0, {_MT_WORDS}]")
    has_gauss = _flag(state, "python.has_gauss_next", found)
    gauss = _finite(state, "python.gauss_next", found)
    problems.extend(found)
    if found:
        return None
    python_state = (version, tuple(int(v) for v in internal), gauss if has_gauss else None)
    try:
        random.Random().setstate(python_state)  # a scratch generator
    except (ValueError, TypeError) as exc:  # pragma: no cover - the checks above are Python's
        problems.append(f"random refuses the state ({exc})")
        return None
    return python_state


def _torch_problems(state: dict, problems: list[str]) -> torch.Tensor | None:
    value = state["torch"]
    expected = torch.get_rng_state().numel()
    if value.numel() != expected:
        problems.append(f"torch has {value.numel()} bytes, this torch uses {expected}")
        return None
    value = value.clone()
    try:
        torch.Generator().set_state(value)  # a scratch generator checks it
    except RuntimeError as exc:
        problems.append(f"torch refuses the state ({str(exc).splitlines()[0]})")
        return None
    return value


def _cuda_problems(state: dict, problems: list[str]) -> list[tuple[int, torch.Tensor]]:
    states = []
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key in sorted(k for k in state if isinstance(k, str) and _CUDA_KEY.fullmatch(k)):
        value = state[key]
        if not _check_tensor(key, value, torch.uint8, None, problems):
            continue
        if value.numel() != _CUDA_STATE_BYTES:
            problems.append(f"{key} has {value.numel()} bytes, expected {_CUDA_STATE_BYTES}")
            continue
        offset = int(value.clone()[8:16].view(torch.int64))
        if offset < 0 or offset % 4:
            problems.append(f"{key} has the Philox offset {offset}; it must be a multiple of 4 >= 0")
            continue
        index = int(key.split(".", 1)[1])
        if index < available:
            try:
                torch.Generator(device=f"cuda:{index}").set_state(value.clone())
            except RuntimeError as exc:
                problems.append(f"{key}: torch refuses the state ({str(exc).splitlines()[0]})")
                continue
        states.append((index, value.clone()))
    return states


def prepare_rng_state(state: Any, source: str = "the RNG state") -> PreparedRngState:
    """Check an RNG state field by field, without changing any generator,
    and convert it for :meth:`PreparedRngState.apply`.

    Every field is checked against what its generator accepts: the torch
    state by a scratch ``torch.Generator``; numpy's MT19937 key (624 words
    of 32 bits, not all zero), position in [0, 624], gauss flag and cached
    value; Python's version 3 state (624 words, then a position in
    [0, 624]) by a scratch ``random.Random``; CUDA states by their size and
    offset (and a scratch CUDA generator where that device exists).

    Raises
    ------
    ValueError
      Naming ``source`` and each field in error: not a dict, missing or
      unknown keys (another file), another format version, wrong dtypes or
      shapes, or values the generators refuse or could never reach.
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
    unknown = sorted(
        str(k) for k in state
        if not (isinstance(k, str) and (k in _LAYOUT or _CUDA_KEY.fullmatch(k)))
    )
    if unknown:
        problems.append(
            f"unknown keys {unknown[:6]} (expected {list(_LAYOUT)} and 'cuda.<index>')"
        )
    typed = [
        _check_tensor(key, state[key], dtype, shape, problems)
        for key, (dtype, shape) in _LAYOUT.items()
    ]
    cuda_states = _cuda_problems(state, problems)
    if all(typed):
        version = int(state["ampnet_rng_version"])
        if version != _VERSION:
            problems.append(
                f"ampnet_rng_version={version}: this ampnet reads version {_VERSION}"
                + ("; upgrade ampnet" if version > _VERSION else "")
            )
        torch_state = _torch_problems(state, problems)
        numpy_state = _numpy_problems(state, problems)
        python_state = _python_problems(state, problems)
    if problems:
        raise ValueError(
            f"{source} holds an invalid RNG state: " + "; ".join(problems)
            + ". No generator was changed."
        )
    return PreparedRngState(torch_state, numpy_state, python_state, tuple(cuda_states), source)


def set_rng_state(state: dict[str, torch.Tensor], source: str = "the RNG state") -> None:
    """Validate ``state``, then restore every generator from it.

    CUDA states are restored for the devices present; an :class:`.AmpWarning`
    says when saved CUDA states cannot all be restored (no CUDA here, or
    fewer devices).

    Raises
    ------
    ValueError
      See :func:`prepare_rng_state`; no generator is changed then.
    """
    prepare_rng_state(state, source).apply()
