"""The saved choices of both autos, one mechanism: they travel in the
metadata of the module's state in the parameters file that ``save_params``
(and so every checkpoint) writes, and come back through ``load_params`` or
a ``LoadInitState`` resume.

- ``amp_enabled='auto'``: the chosen constructor parameters, under
  :data:`ENABLED_KEY`;
- ``amp_fp32_modules='auto'``: the names of the modules kept in float32,
  under :data:`FP32_KEY`.

(The keys are those of ampnet 0.3, so files move both ways.) A saved choice
is untrusted input like the rest of the file: :func:`enabled_choice` and
:func:`fp32_choice` take only well-formed values, and a choice is adopted
only after the parameter table and the precision component accept it for
this net (:func:`ampnet.auto.switching.choice_problem`); otherwise the load
warns, naming the file, and ignores the choice: the net measures its own at
its next fit. Adopting is all or nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ampnet.io.rollback import Step
from ampnet.auto.enabled import CHOICE_KEYS, AutotuneResult, label
from ampnet.config.params import PARAMS, is_auto
from ampnet.precision import module_root
from ampnet.auto import switching

__all__ = [
    "ENABLED_KEY", "FP32_KEY", "enabled_choice", "fp32_choice", "fp32_problem", "write_choices",
    "plan_choices", "shown_names",
]

#: The key of ``amp_enabled='auto'``'s choice in the module state's metadata.
ENABLED_KEY = "ampnet_autotune"

#: The key of ``amp_fp32_modules='auto'``'s choice.
FP32_KEY = "ampnet_auto_fp32_modules"

#: Names of modules that a message shows at most.
SHOWN_NAMES = 8


def shown_names(names: Any) -> str:
    """``names`` as a list for a message, at most :data:`SHOWN_NAMES` of them."""
    names = list(names)
    if len(names) <= SHOWN_NAMES:
        return repr(names)
    return f"{names[:SHOWN_NAMES]!r}[:{SHOWN_NAMES}] (of {len(names)})"


def _root_metadata(state: Any) -> Mapping[str, Any] | None:
    meta = getattr(state, "_metadata", None)
    root = meta.get("") if isinstance(meta, Mapping) else None
    return root if isinstance(root, Mapping) else None


def enabled_choice(state: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The ``amp_enabled='auto'`` choice in a module state's metadata, as
    ``(params, None)``; ``(None, problem)`` for a malformed one; ``(None,
    None)`` when there is none. Each value is checked by the parameter table
    (:data:`ampnet.config.params.PARAMS`) and must be a plain value."""
    root = _root_metadata(state)
    if root is None or ENABLED_KEY not in root:
        return None, None
    value = root[ENABLED_KEY]
    if not isinstance(value, Mapping) or set(value) != set(CHOICE_KEYS):
        return None, f"expected a dict with the keys {', '.join(CHOICE_KEYS)}"
    params = {}
    for name in CHOICE_KEYS:
        raw = value[name]
        if not isinstance(raw, (bool, str)):
            return None, f"{name} holds a {type(raw).__name__}, not a bool or a str"
        try:
            params[name] = PARAMS[name].check(raw)
        except (ValueError, TypeError) as exc:
            return None, str(exc).splitlines()[0]
    if is_auto(params["amp_enabled"]):
        return None, "amp_enabled is 'auto' (a choice is True or False)"
    if params["amp_dtype"] == "float8":
        return None, "amp_dtype is 'float8', which amp_enabled='auto' never chooses"
    return params, None


def fp32_problem(root: torch.nn.Module, saved: Any) -> str | None:
    """Why a saved ``amp_fp32_modules='auto'`` choice cannot be taken by
    ``root``: it must be a list of distinct names of ``root``'s modules (as
    ``named_modules`` gives them)."""
    if not (isinstance(saved, (list, tuple)) and all(isinstance(n, str) for n in saved)):
        return f"expected a list of module names, got {type(saved).__name__}"
    names = dict(root.named_modules())
    unknown = [n for n in saved if n not in names]
    if unknown:
        verb = "is not a module" if len(unknown) == 1 else "are not modules"
        return f"{shown_names(unknown)} {verb} of {type(root).__name__}"
    if len(set(saved)) != len(saved):
        return "it names a module twice"
    return None


def fp32_choice(state: Any, module: torch.nn.Module) -> tuple[tuple[str, ...] | None, str | None]:
    """The ``amp_fp32_modules='auto'`` choice in a module state's metadata,
    as ``(names, None)``; ``(None, problem)`` when it does not fit
    ``module``; ``(None, None)`` when there is none."""
    root = _root_metadata(state)
    if root is None or FP32_KEY not in root:
        return None, None
    problem = fp32_problem(module_root(module), root[FP32_KEY])
    return (None, problem) if problem else (tuple(root[FP32_KEY]), None)


def write_choices(net: Any, state: Any) -> None:
    """Write the net's choices into the metadata of its module ``state`` (a
    ``state_dict``), for ``save_params``."""
    meta = getattr(state, "_metadata", None)
    if meta is None:
        return
    root = meta.setdefault("", {})
    result = net.__dict__.get("amp_autotune_")
    if result is not None and result.source != "measuring" and is_auto(getattr(net, "amp_enabled", False)):
        root[ENABLED_KEY] = dict(result.params)
    prec = net.__dict__.get("precision_")
    layout = getattr(prec, "layout", None)
    if layout is not None and layout.auto_fp32_modules is not None:
        root[FP32_KEY] = list(layout.auto_fp32_modules)


def _warn_only(source: str, message: str) -> Step:
    return Step(source, lambda: None, message)


def plan_choices(net: Any, state: Any, source: str) -> list[Step]:
    """The load steps (:class:`ampnet.io.rollback.Step`) for the choices
    saved with the module ``state`` read from ``source``: an ``'auto'`` net
    that has not chosen takes them (all or nothing); a net that chose
    otherwise, or cannot use them, is told so and keeps its own.

    Raises
    ------
    ValueError
      A malformed ``amp_fp32_modules`` choice (names that are not the
      module's): the file does not belong to this module.
    """
    steps: list[Step] = []
    module = net.__dict__.get("module_")
    fp32, problem = fp32_choice(state, module) if isinstance(module, torch.nn.Module) else (None, None)
    if problem:
        raise ValueError(
            f"{source} holds an invalid amp_fp32_modules='auto' choice in its metadata "
            f"({FP32_KEY!r}): {problem}. ampnet saves there the names of the modules its "
            "probe kept in float32. Nothing was loaded. Fix: pass the parameters that "
            "save_params wrote for this module.")
    if is_auto(getattr(net, "amp_enabled", False)):
        step = _plan_enabled(net, state, source)
        if step is not None:
            steps.append(step)
    if fp32 is not None:
        step = _plan_fp32(net, fp32, source)
        if step is not None:
            steps.append(step)
    return steps


def _plan_enabled(net: Any, state: Any, source: str) -> Step | None:
    saved, problem = enabled_choice(state)
    if problem:
        return _warn_only(source, (
            f"{source} holds an amp_enabled='auto' choice that ampnet cannot read ({problem}); it was "
            "ignored, and the net measures its own at its next fit."))
    if saved is None:
        return None
    own = net.__dict__.get("amp_autotune_")
    if own is not None and own.source != "measuring":
        if own.params == saved:
            return None
        return _warn_only(source, (
            f"{source} was saved by a net whose amp_enabled='auto' chose {label(saved)}; this net "
            f"chose {label(own.params)} and keeps its own choice. To train with the saved one, "
            f"pass {saved!r} to the constructor."))
    problem = switching.choice_problem(net, saved)
    if problem:
        return _warn_only(source, (
            f"{source} holds the choice of amp_enabled='auto' {label(saved)}, which this net "
            f"cannot use ({problem}); it was ignored, and the net measures its own at its next fit."))
    result = AutotuneResult(params=saved, device=str(net.device), source="loaded")
    return Step(source, lambda: switching.apply_choice(net, result))


def _plan_fp32(net: Any, names: tuple[str, ...], source: str) -> Step | None:
    prec = net.__dict__.get("precision_")
    if prec is None:
        return None
    if prec.auto_pending:
        return Step(source, lambda: switching.apply_fp32_choice(net, names))
    own = prec.layout.auto_fp32_modules if prec.layout is not None else None
    if own is None or set(own) == set(names):
        return None
    return _warn_only(source, (
        f"{source} was trained with amp_fp32_modules='auto' keeping {shown_names(names)} in float32; "
        f"this net's probe kept {shown_names(own)}. The net keeps its own choice. To use the saved "
        f"one, pass amp_fp32_modules={shown_names(names)}."))
