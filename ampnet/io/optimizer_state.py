"""Checks of a saved optimizer ``state_dict`` against the net's optimizer,
before anything is loaded: its layout, the parameter groups, the
per-parameter state, and what the optimizer's own class makes of them."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ampnet.io.untrusted import brief as describe
from ampnet.utils.file_values import MAX_DEPTH, all_finite, tensor_problem, type_mismatch
from ampnet.utils.values import finite_number, is_bool, is_int, is_number

__all__ = ["check_optimizer_state"]


def _state_value_problem(value: Any, param: torch.Tensor, group_numel: int, path: str,
                         depth: int = 0) -> str | None:
    """Why ``value`` cannot be per-parameter optimizer state of ``param``.

    A tensor that is not a scalar must have the parameter's shape, a shape
    that broadcasts to it with the same number of dimensions (factored
    moments, e.g. Adafactor), or be flat over the parameters of its group
    (e.g. LBFGS).
    """
    if depth > MAX_DEPTH:
        return f"{path} is nested deeper than {MAX_DEPTH} levels"
    if value is None or is_bool(value) or isinstance(value, str):
        return None
    if is_number(value):
        return None if finite_number(value) else f"{path} = {describe(value)} is not a finite number"
    if isinstance(value, torch.Tensor):
        problem = tensor_problem(value)
        if problem:
            return f"{path} is {problem}"
        if value.dim() > 0:
            shape, own = tuple(value.shape), tuple(param.shape)
            factored = len(shape) == len(own) and all(s in (1, o) for s, o in zip(shape, own))
            flat = len(shape) == 1 and shape[0] == group_numel
            if not (factored or flat):
                return (
                    f"{path} has shape {shape}, but its parameter has shape {own} (and its "
                    f"group {group_numel} values)"
                )
        if not all_finite(value):
            return f"{path} holds NaN or inf values"
        return None
    if isinstance(value, (list, tuple, Mapping)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            problem = _state_value_problem(item, param, group_numel, f"{path}[{key!r}]", depth + 1)
            if problem:
                return problem
        return None
    return f"{path} = {describe(value)} is not optimizer state"


#: Per-parameter state of torch's optimizers that is never negative: second
#: moments and their maxima (Adam, AdamW, RAdam, NAdam, Adamax's ``exp_inf``),
#: sums and running means of squares (Adagrad, RMSprop, Adadelta).
_NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta", "exp_inf"})


def _key(pid: Any) -> str:
    """A state key of the file, as messages show it (bounded)."""
    return describe(pid, 40, typed=False)


def _range_problem(key: str, value: Any, path: str, cls: str) -> str | None:
    """Why ``value`` of the state ``key`` is one that ``cls`` (of
    ``torch.optim``) can never hold: a negative second moment, or a
    ``step`` that is not a whole number >= 0."""
    if key not in _NON_NEGATIVE and key != "step":
        return None
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool or not value.numel():
            return None
        value = value.detach()
        negative = value.min().item() < 0  # a reduction: no copy of a large tensor
        fractional = key == "step" and value.is_floating_point() and bool(
            (value != value.round()).any()
        )
    elif is_number(value) and finite_number(value):
        negative = value < 0
        fractional = key == "step" and float(value) != round(float(value))
    else:
        return None
    if key == "step" and (negative or fractional):
        return f"{path} must be a whole number >= 0 (the steps taken), got {describe(value)}"
    if negative:
        return (
            f"{path} holds negative values, which {cls} never holds (it is a mean or sum of "
            "squares, or their maximum)"
        )
    return None


#: Size of each dimension of the scratch parameters of _reference_states.
_SCRATCH = 2


def _settings(group: Mapping) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params", "param_names")}


def _scratch_step(cls: type, settings: list[dict], shapes: list[list[int]],
                  state: dict | None = None) -> torch.optim.Optimizer:
    """One step of a ``cls`` optimizer over tiny float32 parameters (one per
    real parameter, with as many dimensions) whose gradients are ones;
    ``state`` (by parameter index) and ``settings`` are loaded through the
    optimizer's own ``load_state_dict``, as a real load does."""
    params = [[torch.ones((_SCRATCH,) * dim, requires_grad=True) for dim in dims] for dims in shapes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch = cls([{**s, "params": ps} for s, ps in zip(settings, params)])
        if state is not None:
            index = iter(range(sum(map(len, params))))
            groups = [{**s, "params": [next(index) for _ in ps]} for s, ps in zip(settings, params)]
            scratch.load_state_dict({"state": state, "param_groups": groups})
        for p in (p for ps in params for p in ps):
            p.grad = torch.ones_like(p)
        scratch.step(lambda: torch.zeros(()))
    return scratch


def _reference_states(optimizer: torch.optim.Optimizer) -> list[list[dict]] | None:
    """The per-parameter state that ``optimizer``'s class creates with the
    net's own settings, from one scratch step (see :func:`_scratch_step`);
    by group and position, each with ``"__numel__"``, the scratch group's
    size.

    None for optimizers outside ``torch.optim`` (a user's step may have
    side effects) or when the scratch step fails here (e.g. a setting that
    needs CUDA): then only the generic checks apply.
    """
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    shapes = [[p.dim() for p in g["params"]] for g in optimizer.param_groups]
    try:
        scratch = _scratch_step(type(optimizer), [_settings(g) for g in optimizer.param_groups], shapes)
    except Exception:
        return None
    return [
        [
            {"__numel__": sum(q.numel() for q in g["params"]), **scratch.state.get(p, {})}
            for p in g["params"]
        ]
        for g in scratch.param_groups
    ]


_UNMAPPED = object()


def _scratch_value(value: Any, reference: Any) -> Any:
    """``value`` of a saved state, reduced to the scratch parameter's size
    (a tensor becomes its first value, repeated)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if isinstance(reference, torch.Tensor) and reference.dim() > 0 and value.numel():
            return torch.full(tuple(reference.shape), value.reshape(-1)[0].item(), dtype=value.dtype)
        return _UNMAPPED
    if isinstance(value, (list, tuple, Mapping)):
        return _UNMAPPED
    return copy.deepcopy(value)


def _saved_settings_problem(optimizer: torch.optim.Optimizer, groups: list, entries: Mapping,
                            ids: dict, references: list[list[dict]]) -> str | None:
    """Whether the optimizer's class accepts the saved settings (its own
    constructor checks) and can step with them and the saved state (a
    scratch step, as :func:`_scratch_step`)."""
    cls = type(optimizer)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    for i, group in enumerate(groups):
        kwargs = {k: v for k, v in _settings(group).items() if k in accepted}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except Exception as exc:
            return f"param_groups[{i}]: {cls.__name__} refuses these settings ({exc})"
    index = {}
    for i, g in enumerate(optimizer.param_groups):
        for j in range(len(g["params"])):
            index[(i, j)] = len(index)
    state = {}
    for pid, entry in entries.items():
        _, _, i, j = ids[pid]
        mapped = {k: _scratch_value(v, references[i][j].get(k)) for k, v in entry.items()}
        if not any(v is _UNMAPPED for v in mapped.values()):
            state[index[(i, j)]] = mapped
    shapes = [[p.dim() for p in g["params"]] for g in optimizer.param_groups]
    try:
        _scratch_step(cls, [_settings(g) for g in groups], shapes, state)
    except Exception as exc:
        return (
            f"{cls.__name__} fails to step with the saved settings and state "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        )
    return None


def _expected_shape(reference: torch.Tensor, param: torch.Tensor, group_numel: int,
                    scratch_numel: int) -> tuple[int, ...] | None:
    """The shape the scratch optimizer's ``reference`` state means for the
    real ``param``: the parameter's shape (or a factored one, with 1 where
    the reference has 1), or flat over the group; None if unknown."""
    ref = tuple(reference.shape)
    if len(ref) == param.dim() and all(r in (1, _SCRATCH) for r in ref):
        return tuple(1 if r == 1 and _SCRATCH != 1 else n for r, n in zip(ref, param.shape))
    if len(ref) == 1 and ref[0] == scratch_numel:
        return (group_numel,)
    return None


def _kind_problem(reference: Any, value: Any, path: str,
                  shape: tuple[int, ...] | None = None) -> str | None:
    """Why ``value`` cannot stand where the scratch optimizer holds
    ``reference`` (``shape``: the shape it means for the real parameter)."""
    if isinstance(reference, torch.Tensor):
        if reference.dim() == 0:
            ok = is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
            if not ok:
                return f"{path} must be a number or a one-element tensor, got {describe(value)}"
        else:
            ok = isinstance(value, torch.Tensor) and value.dim() > 0
            if ok and shape is not None and tuple(value.shape) != shape:
                return f"{path} has shape {tuple(value.shape)}, expected {shape}"
        return None if ok else f"{path} must be a tensor like the optimizer's own, got {describe(value)}"
    if is_number(reference):
        ok = is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        return None if ok else f"{path} must be a number, got {describe(value)}"
    if is_bool(reference):
        return None if is_bool(value) else f"{path} must be True or False, got {describe(value)}"
    if isinstance(reference, (list, tuple)):
        return None if isinstance(value, (list, tuple)) else f"{path} must be a list, got {describe(value)}"
    return None


def _check_groups(optimizer: torch.optim.Optimizer, groups: list, problems: list[str]) -> dict:
    """Check the saved parameter groups; return ``{id: (param, group numel)}``."""
    ids: dict[Any, tuple[torch.Tensor, int, int, int]] = {}
    for i, (group, own) in enumerate(zip(groups, optimizer.param_groups)):
        numel = sum(p.numel() for p in own["params"])
        for j, pid in enumerate(group["params"]):
            if not is_int(pid) or pid in ids:
                problems.append(f"param_groups[{i}]['params'][{j}] = {describe(pid)} is not a new int id")
            else:
                ids[pid] = (own["params"][j], numel, i, j)
        for key, own_value in own.items():
            if key == "params":
                continue
            path = f"param_groups[{i}][{key!r}]"
            if key not in group:
                # flags (bool/None) that torch added over the versions get defaults on
                # load; numeric hyper-parameters (lr, betas, ...) do not
                if is_number(own_value) or isinstance(own_value, (tuple, list, torch.Tensor)):
                    problems.append(f"{path} is missing")
                continue
            problem = type_mismatch(own_value, group[key], path, finite=True)
            if problem:
                problems.append(problem)
        for key, value in group.items():
            if key in own or key == "params":
                continue
            path = f"param_groups[{i}][{key!r}]"
            if key == "initial_lr":  # set by torch's LR schedulers: a learning rate
                problem = type_mismatch(own.get("lr"), value, path, finite=True)
            elif key == "param_names":
                ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
                problem = None if ok else f"{path} must be a list of str, got {describe(value)}"
            elif value is None or is_bool(value) or finite_number(value):
                problem = None
            else:
                problem = f"{path} = {describe(value)} must be a finite number, True, False or None"
            if problem:
                problems.append(problem)
    return ids


def _check_layout(optimizer: torch.optim.Optimizer, state: Any, source: str, attr: str) -> list:
    """The parameter groups of ``state``, after its keys, the groups' type
    and their sizes were found to be those of ``optimizer``'s."""
    if not (isinstance(state, Mapping) and "state" in state and "param_groups" in state):
        found = sorted(map(str, state))[:6] if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{source} is not an optimizer state for net.{attr} (expected the keys "
            f"'state' and 'param_groups', found {found}). Was another file passed?"
        )
    groups = state["param_groups"]
    if not (
        isinstance(groups, (list, tuple))
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups)
    ):
        raise ValueError(
            f"{source} is not an optimizer state for net.{attr}: 'param_groups' must be a "
            f"list of dicts with a 'params' list, got {describe(groups)}. Nothing was loaded."
        )
    sizes = [len(g["params"]) for g in groups]
    own_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != own_sizes:
        raise ValueError(
            f"{source} does not match net.{attr}: parameter groups of sizes {sizes} in the "
            f"file, {own_sizes} in the net. Nothing was loaded."
        )
    return list(groups)


def _reference_problem(entry: Mapping, path: str, param: torch.Tensor, numel: int,
                       reference: dict, cls: str) -> str | None:
    """The first field of the reference state (what a step of the
    optimizer's class writes) that ``entry`` lacks or holds in another kind
    or shape."""
    scratch_numel = reference.pop("__numel__", 0)
    for key, ref in reference.items():
        if key not in entry:
            return f"{path} lacks {key!r}, which {cls} needs"
        shape = None
        if isinstance(ref, torch.Tensor) and ref.dim() > 0:
            shape = _expected_shape(ref, param, numel, scratch_numel)
        problem = _kind_problem(ref, entry[key], f"{path}[{key!r}]", shape)
        if problem:
            return problem
    return None


def _entry_problem(optimizer: torch.optim.Optimizer, pid: Any, entry: Any, ids: dict,
                   references: list[list[dict]] | None) -> str | None:
    """What is wrong with the per-parameter state ``entry`` of id ``pid``:
    no such parameter, its values, a field its optimizer's class needs
    (``references``: None when the class's states are unknown), a value out
    of its range."""
    path = f"state[{_key(pid)}]"
    if pid not in ids:
        return f"{path} belongs to no parameter of param_groups"
    if not (isinstance(entry, Mapping) and all(isinstance(k, str) for k in entry)):
        return f"{path} must be a dict with str keys, got {describe(entry)}"
    param, numel, i, j = ids[pid]
    cls = type(optimizer).__name__
    problem = _state_value_problem(dict(entry), param, numel, path)
    if problem or references is None:
        return problem
    problem = _reference_problem(entry, path, param, numel, dict(references[i][j]), cls)
    for key, value in entry.items():  # torch.optim's own classes
        if problem:
            break
        problem = _range_problem(key, value, f"{path}[{key!r}]", cls)
    return problem


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, source: str,
                           attr: str) -> None:
    """Check an optimizer ``state_dict`` against ``optimizer``: its keys, the
    parameter groups (sizes, ids, every hyper-parameter of the net's groups
    present with a value of the same type, numbers finite) and the
    per-parameter state (tensors shaped for their parameter, finite).

    Raises
    ------
    ValueError
      Naming ``source`` and the fields in error.
    """
    groups = _check_layout(optimizer, state, source, attr)
    problems: list[str] = []
    unknown = sorted(map(str, set(state) - set(optimizer.state_dict())))
    if unknown:
        problems.append(f"unknown keys {unknown[:6]}")
    ids = _check_groups(optimizer, groups, problems)
    entries = state["state"]
    if not isinstance(entries, Mapping):
        problems.append(f"'state' must be a dict, got {describe(entries)}")
        entries = {}
    references = _reference_states(optimizer) if not problems else None
    for pid, entry in entries.items():
        problem = _entry_problem(optimizer, pid, entry, ids, references)
        if problem:
            problems.append(problem)
    if not problems and references is not None:
        problem = _saved_settings_problem(optimizer, groups, entries, ids, references)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError(
            f"{source} does not match net.{attr}: " + "; ".join(problems[:6])
            + ". Nothing was loaded."
        )
