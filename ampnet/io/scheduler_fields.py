"""Range checks of the saved state of torch's stock learning-rate schedulers
(``torch.optim.lr_scheduler``), beyond the type checks that every scheduler
state gets: a value that the scheduler's constructor refuses, that makes a
step fail (``step_size: 0``) or that turns the learning rate into NaN,
infinity or a negative number (``gamma: NaN``, ``gamma: -1e300``) is
refused before anything is loaded.

Each field has a rule (:data:`RULES`); any other number in a stock
scheduler's state must be finite. Then a scratch copy of the scheduler
(built on a scratch optimizer, see :mod:`ampnet.io.schedulers`) loads the
state and takes :data:`TRIAL_STEPS` steps; each must succeed and leave every
learning rate finite and >= 0.

JSON turns the integer keys of ``MultiStepLR.milestones`` (a ``Counter``)
into strings; :func:`decode_state` turns them back.
"""

from __future__ import annotations

import collections
import copy
import math
import warnings
from typing import Any, Callable

import torch

from ampnet.io.untrusted import brief as describe
from ampnet.utils.values import as_float, finite_number, is_bool, is_int, is_number

__all__ = ["is_stock", "decode_state", "field_problems", "trial_problem", "RULES", "TRIAL_STEPS"]

#: Steps a scratch copy takes with the loaded state.
TRIAL_STEPS = 2

#: Counters beyond this are not reached by any run (and lose float precision).
COUNT_MAX = 2**53

#: Largest decay/growth factor per step accepted (a larger one overflows the
#: learning rate within a few hundred steps).
FACTOR_MAX = 1e3

Rule = Callable[[Any], bool]


def _int(low: int, high: int = COUNT_MAX) -> tuple[Rule, str]:
    return (lambda v: is_int(v) and low <= v <= high,
            f"must be an int in [{low}, {'2**53' if high == COUNT_MAX else high}]")


def _number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> tuple[Rule, str]:
    def rule(v: Any) -> bool:
        if not finite_number(v):
            return False
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    left, right = "(" if low_open else "[", ")" if high_open else "]"
    shown = "inf" if high == math.inf else f"{high:g}"
    return rule, f"must be a finite number in {left}{low:g}, {shown}{right}"


def _lrs() -> tuple[Rule, str]:
    return (lambda v: isinstance(v, (list, tuple)) and all(
        finite_number(x) and x >= 0 for x in v),
        "must be a list of finite numbers >= 0")


def _choice(*choices: str) -> tuple[Rule, str]:
    return (lambda v: v in choices, f"must be one of {', '.join(map(repr, choices))}")


def _not_nan() -> tuple[Rule, str]:
    return (lambda v: as_float(v) is not None and not math.isnan(as_float(v)),
            "must be a number (not NaN)")


_GAMMA = _number(0, FACTOR_MAX, low_open=True)
_COMMON = {
    "last_epoch": _int(-1),
    "_step_count": _int(0),
    "base_lrs": _lrs(),
    "_last_lr": _lrs(),
}
_PHASE_VALUES = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")

#: Policy name -> field -> (rule, what the rule asks for).
RULES: dict[str, dict[str, tuple[Rule, str]]] = {
    "StepLR": {"step_size": _int(1), "gamma": _GAMMA},
    "MultiStepLR": {"gamma": _GAMMA},
    "ExponentialLR": {"gamma": _GAMMA},
    "ConstantLR": {"factor": _number(0, 1), "total_iters": _int(0)},
    "LinearLR": {
        "start_factor": _number(0, 1, low_open=True),
        "end_factor": _number(0, 1),
        "total_iters": _int(0),
    },
    "PolynomialLR": {"total_iters": _int(1), "power": _number(0, FACTOR_MAX)},
    "CosineAnnealingLR": {"T_max": _number(0, COUNT_MAX, low_open=True), "eta_min": _number(0, math.inf)},
    "CosineAnnealingWarmRestarts": {
        "T_0": _int(1), "T_i": _number(0, COUNT_MAX, low_open=True), "T_mult": _int(1),
        "eta_min": _number(0, math.inf), "T_cur": _number(-1, COUNT_MAX),
    },
    "CyclicLR": {
        "max_lrs": _lrs(), "total_size": _number(0, COUNT_MAX, low_open=True),
        "step_ratio": _number(0, 1, low_open=True), "mode": _choice("triangular", "triangular2", "exp_range"),
        "gamma": _GAMMA, "scale_mode": _choice("cycle", "iterations"),
        "base_momentums": _lrs(), "max_momentums": _lrs(),
    },
    "OneCycleLR": {"total_steps": _int(1), "_anneal_func_type": _choice("cos", "linear")},
    "ReduceLROnPlateau": {
        "factor": _number(0, 1, high_open=True), "min_lrs": _lrs(),
        "default_min_lr": (lambda v: v is None or _number(0, math.inf)[0](v),
                           "must be None or a finite number >= 0"),
        "patience": _int(0), "cooldown": _int(0), "cooldown_counter": _int(0),
        "num_bad_epochs": _int(0), "eps": _number(0, math.inf), "last_epoch": _int(0),
        "threshold": _number(0, math.inf), "mode": _choice("min", "max"),
        "threshold_mode": _choice("rel", "abs"), "best": _not_nan(), "mode_worse": _not_nan(),
    },
    "SequentialLR": {"_milestones": (lambda v: isinstance(v, list) and all(
        is_int(m) and 0 <= m <= COUNT_MAX for m in v), "must be a list of ints in [0, 2**53]")},
}


def is_stock(cls: type) -> bool:
    """Whether ``cls`` is one of torch's own scheduler classes."""
    return getattr(cls, "__module__", "") == "torch.optim.lr_scheduler"


def decode_state(policy: str, state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a state read from JSON in the types the scheduler keeps:
    ``MultiStepLR.milestones`` as a ``Counter`` with int keys (left as it is
    where a key is not a decimal int; :func:`field_problems` refuses it)."""
    state = copy.deepcopy(state)
    milestones = state.get("milestones") if policy == "MultiStepLR" else None
    if isinstance(milestones, dict) and all(
        isinstance(k, int) or (isinstance(k, str) and k.isdigit() and k.isascii()) for k in milestones
    ):
        state["milestones"] = collections.Counter({int(k): v for k, v in milestones.items()})
    return state


def _nonfinite(value: Any, path: str, depth: int = 0) -> str | None:
    """The first number in ``value`` (nested) that is NaN or infinite."""
    if is_number(value) and not is_bool(value):
        return None if finite_number(value) else path
    if depth > 8:
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _nonfinite(item, f"{path}[{key!r}]", depth + 1)
        if found:
            return found
    return None


def field_problems(policy: str, state: dict[str, Any], path: str) -> list[str]:
    """What in the (decoded) ``state`` of the stock scheduler ``policy`` is
    out of range, one line per field, each naming ``path[field]``."""
    rules = {**_COMMON, **RULES.get(policy, {})}
    problems = []
    for key, value in state.items():
        where = f"{path}[{key!r}]"
        if key in rules:
            rule, wanted = rules[key]
            if not rule(value):
                problems.append(f"{where} = {describe(value)} {wanted}")
        elif key == "milestones" and policy == "MultiStepLR":
            if not (isinstance(value, collections.Counter) and all(
                    is_int(k) and 0 <= k <= COUNT_MAX and is_int(n) and 1 <= n <= COUNT_MAX
                    for k, n in value.items())):
                problems.append(
                    f"{where} = {describe(value)} must map epochs (ints in [0, 2**53]) to "
                    "counts (ints >= 1)"
                )
        elif key == "_schedule_phases" and policy == "OneCycleLR":
            problems += _phase_problems(value, where)
        else:
            found = _nonfinite(value, where)
            if found:
                problems.append(f"{found} must be a finite number")
    return problems


def _phase_problems(phases: Any, where: str) -> list[str]:
    if not isinstance(phases, list) or not all(isinstance(p, dict) for p in phases):
        return [f"{where} must be a list of dicts"]
    for i, phase in enumerate(phases):
        end = phase.get("end_step")
        if not (finite_number(end) and -1 <= end <= COUNT_MAX):
            return [f"{where}[{i}]['end_step'] = {describe(end)} must be a finite number in [-1, 2**53]"]
        for key, value in phase.items():
            if key != "end_step" and value not in _PHASE_VALUES:
                return [f"{where}[{i}][{key!r}] = {describe(value)} must be one of {list(_PHASE_VALUES)}"]
    return []


def trial_problem(scratch: Any, state: dict[str, Any], path: str) -> str | None:
    """Load ``state`` into ``scratch`` (a scheduler on a scratch optimizer,
    changed here) and step it :data:`TRIAL_STEPS` times; what went wrong,
    or None."""
    optimizer = scratch.optimizer
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scratch.load_state_dict(state)
            for _ in range(TRIAL_STEPS):
                if isinstance(scratch, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    scratch.step(0.0)
                else:
                    scratch.step()
                lrs = [float(group["lr"]) for group in optimizer.param_groups]
                if not all(math.isfinite(lr) and lr >= 0 for lr in lrs):
                    return (
                        f"{path} makes the learning rate {lrs[:4]} within {TRIAL_STEPS} steps "
                        "(it must stay finite and >= 0)"
                    )
    except Exception as exc:  # whatever the state makes the scheduler raise
        return f"{path} makes the scheduler fail to step ({type(exc).__name__}: {exc})"
    return None
