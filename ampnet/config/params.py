"""Every AMP parameter of a net, once: its default, its check, what a change
rebuilds on a fitted net, and whether a change drops ``amp_enabled='auto'``'s
choice.

This table is the one place that says what a parameter is. The constructor's
defaults (a test compares them), ``initialize`` and ``set_params``
(:mod:`ampnet.config.reconfigure`), the warnings for settings that do nothing
(:mod:`ampnet.config.no_effect`), the inputs of ``'auto'`` and the parameter table of
the documentation (:func:`markdown_table`; a test compares it with
``docs/user_guide/precision.md``) all read it. Adding a parameter means one row
here plus the code that uses it.

String choices follow one rule: case and surrounding spaces do not matter
(``amp_level='Pure '`` is ``'pure'``); the value is stored as given
(scikit-learn's ``clone`` needs that) and read through :func:`check`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch

from ampnet.precision import GradScaler, check_device, dtype_name, parse_amp_dtype, parse_selectors
from ampnet.precision import validate_scaler_settings
from ampnet.precision import AMP_LEVELS, LIVE_SETTINGS, SCALER_DEFAULTS
from ampnet.utils.values import describe, exception_text, is_bool
from ampnet.utils.hints import named_with_hints

__all__ = [
    "Param", "PARAMS", "REBUILDS", "INT_MAX", "check", "check_all", "unreadable", "check_names", "is_auto",
    "rebuilds", "auto_inputs", "constructor_defaults", "amp_only", "pending_params", "CHOICE_PARAMS", "MODULE_PARAMS", "ParsedParams", "PARSED_ATTRIBUTE",
    "parsed", "is_parsed_name", "markdown_table",
    "NOTHING", "LIVE_SCALER", "SCALER", "STEP", "PRECISION", "LAYOUT", "PARALLEL",
]

# ---- what a change rebuilds on a fitted net ------------------------------------------

#: Stored; read where it is used (no component changes).
NOTHING = "nothing"
#: The live loss scaler takes the setting in place.
LIVE_SCALER = "live scaler"
#: A new loss scaler (the scale restarts at ``init_scale``).
SCALER = "scaler"
#: The training step's state (whether optimizers step through skorch's closure).
STEP = "step state"
#: A new precision component over the same module layout.
PRECISION = "precision"
#: The module moves to a new precision layout (weights kept); optimizers are
#: rebuilt where their parameters or their kernel change.
LAYOUT = "precision layout"
#: The data-parallel component, rebuilt at once where the change turns data
#: parallelism on or off (refused, as by ``initialize()``, where it cannot be
#: built: ``distributed=True`` without a process group).
PARALLEL = "data parallelism"

REBUILDS = (NOTHING, LIVE_SCALER, SCALER, STEP, PRECISION, LAYOUT, PARALLEL)


@dataclass(frozen=True)
class Param:
    """One row of the table.

    Attributes
    ----------
    name : str
      The parameter, as ``get_params()`` names it.
    default : object
      Its default (for ``grad_scaler__*``: the default scaler class's).
    check : callable
      ``check(value) -> value``: the value read the way ampnet uses it
      (string choices in their canonical spelling), or raises ``ValueError``
      / ``TypeError`` naming the parameter, the value, the choices and a fix.
    rebuilds : tuple of str
      What a change rebuilds on a fitted net (:data:`REBUILDS`).
    auto_input : bool
      A change drops ``amp_enabled='auto'``'s choice: the next fit probes again.
    amp_only : bool
      Acts only with AMP on: a value other than the default on an AMP-off net
      gets the "has no effect" warning.
    doc : str
      One line for the documentation's table.
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    rebuilds: tuple[str, ...]
    auto_input: bool
    amp_only: bool
    doc: str


# ---- checks ----------------------------------------------------------------------------


def _refuse(name: str, value: Any, expected: str, fix: str, error: type = ValueError) -> Exception:
    return error(f"{name} must be {expected}; got {describe(value)}. Fix: {fix}")


def _choice(name: str, choices: tuple[Any, ...], fix: str, error: type = ValueError) -> Callable[[Any], Any]:
    """A check for a value among ``choices`` (booleans as Python or numpy
    booleans; strings whatever their case and surrounding spaces); a
    refusal raises ``error`` (0.3's type for the parameter)."""
    listed = [repr(c) for c in choices]
    if any(c is True or c is False for c in choices):  # "True, False or 'auto'"
        shown = ", ".join(listed[:-1]) + " or " + listed[-1]
    else:  # "one of 'mixed', 'pure'"
        shown = "one of " + ", ".join(listed)

    def check(value: Any) -> Any:
        if is_bool(value) and any(c is True or c is False for c in choices):
            return bool(value)
        if isinstance(value, str):
            key = str.lower(str.strip(value))  # str's own methods: a str subclass may override them
            for c in choices:
                if isinstance(c, str) and c == key:
                    return c
        raise _refuse(name, value, shown, fix, error)

    return check


#: The largest int a parameter without a bound of its own takes: torch's int64
#: (a larger one, such as ``10**400``, overflows where it meets a float or a tensor).
INT_MAX = 2**63 - 1


def _int_at_least(name: str, low: int, high: int | None, fix: str, optional: bool = False) -> Callable[[Any], Any]:
    top = INT_MAX if high is None else high

    def check(value: Any) -> Any:
        if optional and value is None:
            return None
        number = None
        if isinstance(value, Integral) and not is_bool(value):
            number = int(value)
            if low <= number <= top:
                return number
        if high is not None:
            span = f"an int in [{low}, {high}]"
        elif number is not None and number > top:  # 10**400 overflows where it meets a float or a tensor
            span = f"an int >= {low} and at most 2**63 - 1"
        else:
            span = f"an int >= {low}"
        raise _refuse(name, value, ("None or " if optional else "") + span, fix)

    return check


def _number_in(name: str, low: float, high: float, high_open: bool, fix: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, Real) and not is_bool(value):
            try:
                x = float(value)
            except OverflowError:
                x = math.inf
            if low <= x and (x < high if high_open else x <= high):
                return x  # a plain float: the number a subclass holds, read once
        raise _refuse(name, value, f"a number in [{low:g}, {high:g}{')' if high_open else ']'}", fix)

    return check


def _cache(value: Any) -> Any:
    if isinstance(value, (str, os.PathLike)) and not is_bool(value):
        folder = str.__str__(os.fspath(value)) if isinstance(os.fspath(value), str) else os.fsdecode(value)
        if folder.strip():
            return folder  # the plain str a str subclass or a path holds
    try:
        return _bool("amp_autotune__cache", "")(value)
    except ValueError:
        raise _refuse("amp_autotune__cache", value, "True, False or a folder",
                      "amp_autotune__cache=True (the cache folder: AMPNET_CACHE_DIR, else the user's cache "
                      "folder), a folder of your own (a str or a path), or False (nothing read or written).") from None


def _timer(value: Any) -> Any:
    if value is None or callable(value):
        return value
    raise _refuse("amp_autotune__timer", value, "None or a callable timer(params, seconds) -> seconds",
                  "leave it at None (the wall clock), or pass a function that returns the seconds to count "
                  "for a step of the candidate params.", TypeError)


def _amp_enabled(value: Any) -> Any:
    return _choice("amp_enabled", (True, False, "auto"),
                   "amp_enabled=True (mixed precision), False (float32, as skorch) or 'auto' (measure "
                   "at the first fit which precision is fastest here, and use it).")(value)


def _amp_dtype(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in ("float8", "fp8"):
        return "float8"  # ampnet.precision.kinds.float8: torchao's float8 matmuls, bf16 autocast elsewhere
    dtype = parse_amp_dtype(value)  # raises, naming amp_dtype, the choices and a fix
    return "auto" if dtype is None else dtype_name(dtype)


def _selectors(name: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        parse_selectors(value, name)
        return value

    return check


def _grad_scaler(value: Any) -> Any:
    if isinstance(value, torch.amp.GradScaler) or (isinstance(value, type) and issubclass(value, torch.amp.GradScaler)):
        return value
    raise _refuse("grad_scaler", value, "a torch.amp.GradScaler subclass or instance",
                  "grad_scaler=ampnet.GradScaler (the default), or an instance such as "
                  "ampnet.GradScaler(init_scale=256.0).")


def _scaler_setting(setting: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        validate_scaler_settings(**{setting: value})  # names grad_scaler__<setting>
        return value

    return check


def _device(value: Any) -> Any:
    check_device(value)
    return value


def _data_on_device(value: Any) -> Any:
    fix = ("data_on_device='auto' (on a CUDA device when the arrays take at most a quarter of its free "
           "memory), True, False (each batch copied from pinned memory), or a cap in bytes such as 2**30.")
    if is_bool(value) or isinstance(value, str):
        return _choice("data_on_device", (True, False, "auto"), fix)(value)
    if isinstance(value, Integral) and 0 <= int(value) <= INT_MAX:
        return int(value)
    raise _refuse("data_on_device", value, "True, False, 'auto' or an int >= 0 (bytes)", fix)


def _bool(name: str, fix: str) -> Callable[[Any], Any]:
    return _choice(name, (True, False), fix)


def _row(name: str, default: Any, check: Callable[[Any], Any], rebuilds: Iterable[str], doc: str,
         auto_input: bool = False, amp_only: bool = False) -> Param:
    return Param(name, default, check, tuple(rebuilds), auto_input, amp_only, doc)


_ROWS = [
    _row("amp_enabled", False, _amp_enabled, (LAYOUT, SCALER), auto_input=True,
         doc="True: mixed precision; False: float32, as skorch; 'auto': measure at the first fit what pays off"),
    _row("amp_dtype", "auto", _amp_dtype, (LAYOUT, SCALER), auto_input=True, amp_only=True,
         doc="'auto' (bfloat16 where supported, else float16), 'bfloat16', 'float16' or 'float8' (torchao's "
             "float8 matmuls for the linear layers, bfloat16 autocast elsewhere; pip install \"ampnet[fp8]\")"),
    _row("amp_level", "mixed",
         _choice("amp_level", AMP_LEVELS,
                 "amp_level='mixed' (float32 weights, autocast) or 'pure' (weights stored in low precision)."),
         (LAYOUT,), auto_input=True, amp_only=True,
         doc="'mixed': float32 weights under autocast; 'pure': weights stored in the low-precision dtype"),
    _row("amp_master_weights", True,
         _choice("amp_master_weights", (True, False, "compensated"),
                 "amp_master_weights=True (float32 masters, the default), False (the optimizer updates the "
                 "low-precision weights) or 'compensated' (a low-precision compensation buffer, no float32 copy).",
                 TypeError),
         (LAYOUT,), auto_input=True, amp_only=True,
         doc="'pure' only: float32 master copies (True), none (False) or 'compensated' (Kahan)"),
    _row("amp_fp32_modules", None, _selectors("amp_fp32_modules"), (LAYOUT,), amp_only=True,
         doc="modules kept in float32 (classes, globs, regexes), or 'auto' (those that overflow)"),
    _row("amp_modules", None, _selectors("amp_modules"), (LAYOUT,), amp_only=True,
         doc="the only modules that run in low precision (None: all)"),
    _row("memory_format", "preserve",
         _choice("memory_format", ("preserve", "channels_last"),
                 "memory_format='channels_last' for convolutional models, else 'preserve'."),
         (LAYOUT,), auto_input=True, doc="'channels_last' for convolutional models"),
    _row("grad_scaler", GradScaler, _grad_scaler, (SCALER,),
         doc="the loss scaler's class or instance (float16)"),
    _row("gradient_accumulation_steps", 1,
         _int_at_least("gradient_accumulation_steps", 1, None,
                       "gradient_accumulation_steps=1 (a step per batch) or the number of batches per step."),
         (STEP,), doc="micro-batches per optimizer step"),
    _row("amp_max_consecutive_skips", 50,
         _int_at_least("amp_max_consecutive_skips", 1, None,
                       "amp_max_consecutive_skips=50 (the default), another int >= 1, or None (never stop).",
                       optional=True),
         (NOTHING,), doc="skipped steps in a row that stop the fit (None: never)"),
    _row("amp_skip_nonfinite", True,
         _bool("amp_skip_nonfinite", "amp_skip_nonfinite=True (skip steps with NaN/inf gradients) or False."),
         (PRECISION, STEP), doc="skip optimizer steps whose gradients hold NaN/inf"),
    _row("batch_gather", True,
         _bool("batch_gather", "batch_gather=True (each batch of array data gathered with one index) or False "
               "(skorch's DataLoader, row by row)."),
         (NOTHING,), doc="array data: each batch gathered with one index, in the DataLoader's order (False: "
                         "skorch's DataLoader)"),
    _row("data_on_device", "auto", _data_on_device, (NOTHING,),
         doc="CUDA, array data: 'auto' (the arrays on the device when they fit), True, False, or a cap in bytes"),
    _row("distributed", "auto",
         _choice("distributed", ("auto", True, False),
                 "distributed='auto' (on when a torch.distributed process group is initialized), True or False."),
         (PARALLEL,), doc="data-parallel training: 'auto', True or False"),
    _row("device", "cpu", _device, (SCALER, PRECISION), auto_input=True,
         doc="skorch's device; AMP follows it"),
]
# the loss scaler's settings: ampnet.GradScaler's own defaults and live settings (another scaler class
# has its own)
for _name, _default in SCALER_DEFAULTS.items():
    _ROWS.append(_row(f"grad_scaler__{_name}", _default, _scaler_setting(_name),
                      (LIVE_SCALER,) if _name in LIVE_SETTINGS else (SCALER,),
                      doc="loss-scaler setting" + (", changed on the live scaler" if _name in LIVE_SETTINGS else "")))
_ROWS += [
    _row("amp_float8__recipe", "tensorwise",
         _choice("amp_float8__recipe", ("tensorwise", "rowwise"),
                 "amp_float8__recipe='tensorwise' (one scale per tensor, the fastest) or 'rowwise' (a scale per "
                 "row, more accurate)."),
         (LAYOUT,), amp_only=True, doc="amp_dtype='float8': torchao's scaling recipe, 'tensorwise' or 'rowwise'"),
    _row("amp_float8__keep_first_last", True,
         _bool("amp_float8__keep_first_last", "amp_float8__keep_first_last=True (the first and last linear layers "
               "in bfloat16) or False (float8 too)."),
         (LAYOUT,), amp_only=True, doc="amp_dtype='float8': the first and last linear layers stay in bfloat16"),
    _row("amp_float8__modules", None, _selectors("amp_float8__modules"), (LAYOUT,), amp_only=True,
         doc="amp_dtype='float8': the only modules whose linear layers may run float8 (classes, globs, regexes; "
             "None: all)"),
    _row("amp_autotune__steps", 6,
         _int_at_least("amp_autotune__steps", 1, 100, "leave it at 6, or pass an int in [1, 100]."),
         (NOTHING,), doc="'auto': timed pairs (a float32 and a mixed step) at most"),
    _row("amp_autotune__warmup", 1,
         _int_at_least("amp_autotune__warmup", 0, 100, "leave it at 1, or pass an int in [0, 100]."),
         (NOTHING,), doc="'auto': untimed first steps per candidate"),
    _row("amp_autotune__min_steps", 64,
         _int_at_least("amp_autotune__min_steps", 0, 10**6, "leave it at 64, or pass an int in [0, 1000000]."),
         (NOTHING,), doc="'auto': a fit of fewer training steps does not measure (too short to pay for it)"),
    _row("amp_autotune__margin", 0.05,
         _number_in("amp_autotune__margin", 0.0, 1.0, True, "leave it at 0.05, or pass a number in [0, 1)."),
         (NOTHING,), doc="'auto': how much faster than float32 mixed precision must be"),
    _row("amp_autotune__cache", True, _cache,
         (NOTHING,), doc="'auto': True (the cache folder: AMPNET_CACHE_DIR, else the user's), a folder, or False"),
    _row("amp_autotune__timer", None, _timer, (NOTHING,),
         doc="'auto': None (the wall clock) or timer(params, seconds) -> seconds counted for a step"),
]

#: Settings of ``amp_enabled='auto'`` that 0.4's measurement in the fit's own steps removed, with why.
REMOVED = {
    "budget": "auto measures in the fit's own steps, every one of them kept, so there is no probe to budget",
    "min_cosine": "auto no longer compares gradients on copies of the model",
}

#: The table, by name.
PARAMS: Mapping[str, Param] = MappingProxyType({row.name: row for row in _ROWS})
del _name, _default


# ---- reading the table -------------------------------------------------------------------


def check(name: str, value: Any) -> Any:
    """``value`` of parameter ``name`` as ampnet reads it, checked (see
    :class:`Param`). A name that is not in the table is returned as is (a
    ``grad_scaler__*`` setting of another scaler class, checked with that
    class's settings).

    Whatever a hostile value's own methods raise while it is read (a
    ``__repr__``, ``__float__`` or ``strip`` that raises, an ``OverflowError``)
    comes out as a ``ValueError`` naming the parameter.

    Raises
    ------
    ValueError, TypeError
      Naming the parameter, the value, the valid choices and a fix.
    """
    row = PARAMS.get(name)
    if row is None:
        return value
    try:
        return row.check(value)
    except (ValueError, TypeError) as exc:
        if _names(exc, name):
            raise  # the check's own refusal
        problem: Exception = exc
    except Exception as exc:  # noqa: BLE001 - raised by the value's own methods
        problem = exc
    raise unreadable(name, value, problem) from problem


def _names(exc: BaseException, name: str) -> bool:
    """Whether ``exc``'s message names parameter ``name`` (ampnet's refusals do)."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001
        return False
    return type(text) is str and name in text


def unreadable(name: str, value: Any, exc: BaseException) -> ValueError:
    """The ``ValueError`` for a value of parameter ``name`` whose own
    methods raised ``exc`` while ampnet read it: the parameter, the value
    (:func:`ampnet.utils.values.describe`, which never raises), what it raised,
    the parameter's valid values and a fix."""
    row = PARAMS.get(name)
    valid = f" {name}: {row.doc}." if row is not None else ""
    default = f" such as the default {name}={_shown_default(row.default)}" if row is not None else ""
    return ValueError(
        f"{name} got {describe(value)}, which raised {exception_text(exc)} when ampnet read it.{valid} "
        f"Fix: pass a plain value (a bool, int, float, str or None){default}.")


def _shown_default(default: Any) -> str:
    return default.__name__ if isinstance(default, type) else repr(default)


def check_all(params: Mapping[str, Any]) -> dict[str, Any]:
    """Every table parameter of ``params`` checked (:func:`check`); the
    others are returned as they are."""
    return {name: check(name, value) for name, value in params.items()}


def check_names(prefix: str, given: Mapping[str, Any]) -> None:
    """Refuse ``<prefix>__<name>`` settings that the table does not list
    (``given``: names without the prefix), suggesting the closest.

    Raises
    ------
    ValueError
      Naming the unknown settings and the valid ones.
    """
    valid = [name.split("__", 1)[1] for name in PARAMS if name.startswith(prefix + "__")]
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    removed = [name for name in unknown if prefix == "amp_autotune" and name in REMOVED]
    if removed:
        name = removed[0]
        raise ValueError(
            f"amp_autotune__{name} was removed in ampnet 0.4: {REMOVED[name]}. Fix: drop "
            f"amp_autotune__{name}={describe(given[name])}.")
    raise ValueError(
        f"Unknown {prefix} setting(s): {named_with_hints(prefix, unknown, valid)}. Valid settings are: "
        f"{', '.join(prefix + '__' + v for v in valid)}. Fix: correct the name, or drop it.")


def is_auto(value: Any) -> bool:
    """Whether an ``amp_enabled`` value means ``'auto'``."""
    return isinstance(value, str) and str.lower(str.strip(value)) == "auto"


def rebuilds(names: Iterable[str]) -> set[str]:
    """What changing the parameters ``names`` rebuilds on a fitted net
    (a ``grad_scaler__*`` setting outside the table: a new scaler; a
    parameter outside the table: nothing of ampnet's)."""
    out: set[str] = set()
    for name in names:
        row = PARAMS.get(name)
        if row is not None:
            out.update(row.rebuilds)
        elif name.startswith("grad_scaler__"):
            out.add(SCALER)
    return out


def auto_inputs() -> frozenset[str]:
    """The parameters whose change drops ``amp_enabled='auto'``'s choice."""
    return frozenset(row.name for row in _ROWS if row.auto_input)


def amp_only() -> tuple[str, ...]:
    """The parameters that act only with AMP on."""
    return tuple(row.name for row in _ROWS if row.amp_only)


def constructor_defaults() -> dict[str, Any]:
    """The AMP parameters of ``AmpNet.__init__`` with their defaults."""
    return {row.name: row.default for row in _ROWS if "__" not in row.name and row.name != "device"}


#: The precision parameters that ``amp_enabled='auto'`` chooses (its candidates set them).
CHOICE_PARAMS = ("amp_enabled", "amp_dtype", "amp_level", "amp_master_weights", "memory_format")

#: The parameters that act on the net's ``module_`` (its precision layout): a net without one
#: (skorch's custom module names) keeps their defaults.
MODULE_PARAMS = ("amp_level", "amp_fp32_modules", "amp_modules", "memory_format")


def pending_params(memory_format: Any = "preserve") -> dict[str, Any]:
    """The precision parameters of an ``'auto'`` net before it has chosen:
    float32 (the table's defaults, AMP off), in the memory format it was
    given (the baseline candidate)."""
    return {**{name: PARAMS[name].default for name in CHOICE_PARAMS}, "amp_enabled": False,
            "memory_format": memory_format}


class ParsedParams(Mapping[str, Any]):
    """A net's AMP parameters as ampnet reads them, each checked once by
    :func:`check` (string choices in their canonical spelling): the
    constructor's parameters, ``device`` and the ``grad_scaler__*``
    settings. ``initialize()`` and ``set_params`` parse them; every other
    reader reads them here (:func:`parsed`). Read-only."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ParsedParams is read-only: change a net's parameters with set_params")

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._values)

    def __setstate__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __repr__(self) -> str:
        return f"ParsedParams({self._values!r})"


#: The attribute under which a net keeps its :class:`ParsedParams`.
PARSED_ATTRIBUTE = "amp_params_"

#: Where an initialized net keeps the parse its components were built from
#: while a parameter set by plain assignment waits to be applied.
BUILT_ATTRIBUTE = "amp_params_built_"


def is_parsed_name(name: str) -> bool:
    """Whether ``name`` is one of the parameters a :class:`ParsedParams`
    holds (the constructor's AMP parameters, ``device``, ``grad_scaler__*``, ``amp_float8__*``)."""
    return (name in PARAMS and "__" not in name) or name.startswith(("grad_scaler__", "amp_float8__"))


def parsed(net: Any, name: str) -> Any:
    """Parameter ``name`` of ``net`` as ``initialize()`` or ``set_params``
    parsed it; checked now where the net holds no parse of it (never
    initialized, or unpickled from an older ampnet)."""
    values = net.__dict__.get(PARSED_ATTRIBUTE)
    if values is not None and name in values:
        return values[name]
    return check(name, getattr(net, name))


def markdown_table() -> str:
    """The table as the documentation shows it."""
    lines = ["| parameter | default | a change on a fitted net rebuilds | drops auto's choice | what it does |",
             "|---|---|---|---|---|"]
    for row in _ROWS:
        default = row.default.__name__ if isinstance(row.default, type) else repr(row.default)
        lines.append(f"| `{row.name}` | `{default}` | {', '.join(row.rebuilds)} | "
                     f"{'yes' if row.auto_input or row.name.startswith('amp_autotune__') else 'no'} | {row.doc} |")
    return "\n".join(lines)
