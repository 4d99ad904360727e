"""Reading, checking and writing the files of a net's state (used by
:class:`ampnet.persistence.PersistenceMixin` and :mod:`ampnet.checkpoint`)."""

from __future__ import annotations

import math
import os
import pickle
import string
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any, Callable

import torch
from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from skorch.history import History

from ampnet.atomic import is_path, read_json, recover
from ampnet.validation import MAX_DEPTH, describe, is_bool, type_mismatch

def _describe_target(key: str, target: Any) -> str:
    if is_path(target):
        return f"{key} file {os.fspath(target)!r}"
    return f"{key} ({getattr(target, 'name', type(target).__name__)!r})"


def _attr_of(key: str) -> str:
    return "module_" if key in ("f_params", "f_module") else key[2:] + "_"


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not is_bool(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not is_bool(value)


def _read_error(source: str, exc: OSError) -> OSError:
    """An OSError (of the same kind) that names ``source`` and the cause."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    return OSError(exc.errno, f"{source} could not be read: {cause}", exc.filename)


# ---- tensors <-> plain values (the scaler state under safetensors) -------


def _to_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, bool):
            out[key] = torch.tensor(value)
        elif isinstance(value, int):
            out[key] = torch.tensor(value, dtype=torch.int64)
        elif isinstance(value, float):
            out[key] = torch.tensor(value, dtype=torch.float64)
        else:
            out[key] = value
    return out


def _from_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
        for key, value in state.items()
    }


# ---- reading, without changing the net -----------------------------------


def _read_state(target: Any, source: str, safetensors: bool, map_location: Any,
                load_kwargs: dict[str, Any]) -> Any:
    try:
        if safetensors:
            from safetensors.torch import load, load_file

            if is_path(target):
                return load_file(os.fspath(target), device=str(map_location))
            return load(target.read())
        return torch.load(target, map_location=map_location, **load_kwargs)
    except OSError as exc:
        raise _read_error(source, exc) from exc
    except Exception as exc:  # whatever a damaged file makes the readers raise
        hint = (
            " It holds objects other than tensors and plain values, which a safe "
            "load refuses: it was not written by save_params, or it may be malicious."
            if isinstance(exc, pickle.UnpicklingError) else ""
        )
        kind = "safetensors" if safetensors else "torch"
        raise ValueError(
            f"{source} cannot be read as a {kind} file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else exc!r}).{hint} Fix: pass the file "
            "that save_params wrote, with the same use_safetensors setting."
        ) from exc


def _history_row_problem(row: dict, previous: int) -> str | None:
    """What in one epoch row skorch or ampnet could not use later."""
    epoch = row.get("epoch", previous + 1)
    if not (_is_int(epoch) and epoch > previous):
        return (
            f"'epoch' must be an int greater than the previous row's ({previous}), got "
            f"{describe(epoch)}"
        )
    batches = row.get("batches", [])
    if not (isinstance(batches, list) and all(isinstance(b, dict) for b in batches)):
        return f"'batches' must be a list of dicts, got {describe(batches)}"
    for place, entries in [("", row)] + [(f"batch {j}: ", b) for j, b in enumerate(batches)]:
        for key, value in entries.items():
            if key.endswith("_batch_count") and not (_is_int(value) and value >= 0):
                return f"{place}{key!r} must be an int >= 0, got {describe(value)}"
            if key.endswith("_best") and not isinstance(value, bool):
                return f"{place}{key!r} must be true or false, got {describe(value)}"
            if key in ("dur", "batch_size") and not _is_number(value):
                return f"{place}{key!r} must be a number, got {describe(value)}"
    return None


def _read_history(target: Any, source: str) -> list:
    """Read a history file and check it against skorch's layout: a list of
    epoch rows, where present an increasing int ``epoch``, ``batches`` (a
    list of dicts), int ``*_batch_count``, boolean ``*_best`` flags and
    numeric ``dur``/``batch_size``."""
    rows = read_json(target, source, "a JSON history")
    if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
        raise ValueError(
            f"{source} is not a skorch history: expected a JSON list of epoch dicts, got "
            f"{type(rows).__name__}."
        )
    previous = 0
    for index, row in enumerate(rows):
        problem = _history_row_problem(row, previous)
        if problem:
            raise ValueError(
                f"{source} is not a valid skorch history: in row {index}, {problem}. "
                "Nothing was loaded."
            )
        previous = row.get("epoch", previous + 1)
    return rows


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "floating" if t.is_floating_point() else "integer"


def _tensor_problem(value: Any) -> str | None:
    """Why ``value`` is not a plain tensor that can be loaded."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} instead of a tensor"
    if value.layout != torch.strided:
        return f"a {value.layout} tensor instead of a dense one"
    if value.device.type == "meta" or value.is_quantized:
        return f"a {value.device.type} {value.dtype} tensor without loadable values"
    return None


def _all_finite(value: torch.Tensor) -> bool:
    if _kind(value) not in ("floating", "complex"):
        return True
    return bool(torch.isfinite(value).all())


def _check_module_state(module: torch.nn.Module, state: Any, source: str, attr: str) -> None:
    """Check a module ``state_dict`` against ``module``: the same keys,
    dense tensors of the same shapes and dtype kinds (floating, integer,
    bool, complex), finite parameters, and buffers that are finite where
    the module's are.

    Raises
    ------
    ValueError
      Naming ``source`` and the entries in error.
    """
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{source} does not hold a module state_dict for net.{attr}: got "
            f"{type(state).__name__}."
        )
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(map(str, set(state) - set(own)))
    shapes, others = [], []
    for key, value in own.items():
        if key not in state or key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        saved = state[key]
        problem = _tensor_problem(saved)
        if problem:
            others.append(f"{key} is {problem}")
        elif _kind(saved) != _kind(value):
            others.append(f"{key} holds {saved.dtype} values, the net {value.dtype} ({_kind(value)})")
        elif not torch.nn.parameter.is_lazy(value) and saved.shape != value.shape:
            shapes.append(
                f"{key}: {tuple(saved.shape)} in the file, {tuple(value.shape)} in the net"
            )
        elif not _all_finite(saved) and (
            isinstance(value, torch.nn.Parameter) or torch.nn.parameter.is_lazy(value)
            or _all_finite(value.detach())
        ):
            what = "parameter" if isinstance(value, torch.nn.Parameter) else "buffer"
            others.append(f"{what} {key} holds NaN or inf values")
    if missing or unexpected or shapes or others:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:6]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:6]}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:4]))
        parts += others[:4]
        raise ValueError(
            f"{source} does not match net.{attr}: {', '.join(parts)}. Was another file "
            "passed (e.g. the optimizer file as f_params), or was the module built with "
            "other sizes? Nothing was loaded."
        )


def _plain_problem(value: Any, path: str, depth: int = 0) -> str | None:
    """Why ``value`` is not a plain setting (a finite number, bool, None,
    str, or a list of these)."""
    if value is None or is_bool(value) or isinstance(value, str):
        return None
    if _is_number(value):
        return None if math.isfinite(value) else f"{path} = {value!r} is not finite"
    if isinstance(value, (list, tuple)) and depth < MAX_DEPTH:
        for i, item in enumerate(value):
            problem = _plain_problem(item, f"{path}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    return f"{path} = {describe(value)} is not a plain setting"


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
    if _is_number(value):
        return None if math.isfinite(value) else f"{path} = {value!r} is not finite"
    if isinstance(value, torch.Tensor):
        problem = _tensor_problem(value)
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
        if not _all_finite(value):
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


def _check_groups(optimizer: torch.optim.Optimizer, groups: list, problems: list[str]) -> dict:
    """Check the saved parameter groups; return ``{id: (param, group numel)}``."""
    ids: dict[Any, tuple[torch.Tensor, int]] = {}
    for i, (group, own) in enumerate(zip(groups, optimizer.param_groups)):
        numel = sum(p.numel() for p in own["params"])
        for j, pid in enumerate(group["params"]):
            if not _is_int(pid) or pid in ids:
                problems.append(f"param_groups[{i}]['params'][{j}] = {describe(pid)} is not a new int id")
            else:
                ids[pid] = (own["params"][j], numel)
        for key, own_value in own.items():
            if key == "params":
                continue
            path = f"param_groups[{i}][{key!r}]"
            if key not in group:
                # flags (bool/None) that torch added over the versions get defaults on
                # load; numeric hyper-parameters (lr, betas, ...) do not
                if _is_number(own_value) or isinstance(own_value, (tuple, list, torch.Tensor)):
                    problems.append(f"{path} is missing")
                continue
            problem = type_mismatch(own_value, group[key], path, finite=True)
            if problem:
                problems.append(problem)
        for key, value in group.items():
            if key not in own and key != "params":
                problem = _plain_problem(value, f"param_groups[{i}][{key!r}]")
                if problem:
                    problems.append(problem)
    return ids


def _check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, source: str,
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
    if not (isinstance(state, Mapping) and "state" in state and "param_groups" in state):
        found = sorted(map(str, state))[:6] if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{source} is not an optimizer state for net.{attr} (expected the keys "
            f"'state' and 'param_groups', found {found}). Was another file passed?"
        )
    groups, own = state["param_groups"], optimizer.param_groups
    if not (
        isinstance(groups, (list, tuple))
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups)
    ):
        raise ValueError(
            f"{source} is not an optimizer state for net.{attr}: 'param_groups' must be a "
            f"list of dicts with a 'params' list, got {describe(groups)}. Nothing was loaded."
        )
    sizes = [len(g["params"]) for g in groups]
    own_sizes = [len(g["params"]) for g in own]
    if sizes != own_sizes:
        raise ValueError(
            f"{source} does not match net.{attr}: parameter groups of sizes {sizes} in the "
            f"file, {own_sizes} in the net. Nothing was loaded."
        )
    problems: list[str] = []
    unknown = sorted(map(str, set(state) - set(optimizer.state_dict())))
    if unknown:
        problems.append(f"unknown keys {unknown[:6]}")
    ids = _check_groups(optimizer, list(groups), problems)
    entries = state["state"]
    if not isinstance(entries, Mapping):
        problems.append(f"'state' must be a dict, got {describe(entries)}")
        entries = {}
    for pid, entry in entries.items():
        if pid not in ids:
            problems.append(f"state[{pid!r}] belongs to no parameter of param_groups")
        elif not (isinstance(entry, Mapping) and all(isinstance(k, str) for k in entry)):
            problems.append(f"state[{pid!r}] must be a dict with str keys, got {describe(entry)}")
        else:
            param, numel = ids[pid]
            problem = _state_value_problem(dict(entry), param, numel, f"state[{pid!r}]")
            if problem:
                problems.append(problem)
    if problems:
        raise ValueError(
            f"{source} does not match net.{attr}: " + "; ".join(problems[:6])
            + ". Nothing was loaded."
        )


def _escapes(path: str, root: str) -> bool:
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root or "."))
    return rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel)


def _confined(checkpoint: Any, files: dict[str, Any], source: str) -> dict[str, Any]:
    """Refuse file names that values from the history (``source``) moved out
    of the checkpoint's directory."""
    for key, template in checkpoint._f_kwargs().items():
        formatted = files.get(key)
        if not (isinstance(template, str) and "{" in template and isinstance(formatted, str)):
            continue
        inside = os.path.join(checkpoint.dirname, checkpoint.fn_prefix + template)
        if "\x00" in formatted or (
            not _escapes(inside, checkpoint.dirname) and _escapes(formatted, checkpoint.dirname)
        ):
            raise ValueError(
                f"{source} turns the file name {key}={template!r} into {formatted!r}, outside "
                f"the checkpoint's directory {checkpoint.dirname or '.'!r}. Nothing was loaded. "
                "Fix: use the history file that this checkpoint saved."
            )
    return files


def _format_files(checkpoint: Any, net: Any, rows: list | None,
                  source: str = "the history") -> dict[str, Any]:
    saved = net.history
    try:
        if rows is not None:
            net.history = History(rows)
        if len(net.history):
            if rows is None:
                return checkpoint.get_formatted_files(net)
            try:
                files = checkpoint.get_formatted_files(net)
            except Exception as exc:  # a format field that the saved history lacks
                raise ValueError(
                    f"{source} cannot format the checkpoint's file names "
                    f"({type(exc).__name__}: {exc}). Nothing was loaded. Fix: use the "
                    "history file that this checkpoint saved."
                ) from exc
            return _confined(checkpoint, files, source)
        # no history to format with (a first run): only plain names resolve
        files = {}
        for key, val in checkpoint._f_kwargs().items():
            if isinstance(val, str):
                if "{" in val:
                    continue
                val = os.path.join(checkpoint.dirname, checkpoint.fn_prefix + val)
            files[key] = val
        return files
    finally:
        net.history = saved


def resolve_checkpoint(checkpoint: Any) -> Any:
    """The Checkpoint that holds the file names (a TrainEndCheckpoint's
    inner one, initialized if needed)."""
    if isinstance(checkpoint, SkorchTrainEndCheckpoint):
        if not hasattr(checkpoint, "checkpoint_"):
            checkpoint.initialize()
        return checkpoint.checkpoint_
    return checkpoint


def checkpoint_files(checkpoint: Any, net: Any) -> dict[str, Any]:
    """The files of ``checkpoint`` as ``load_params`` resolves them, without
    changing ``net``.

    A save that a killed process left pending is completed first. File
    names with format specifiers are formatted with the saved history, as
    skorch does.
    """
    checkpoint = resolve_checkpoint(checkpoint)
    recover([checkpoint.dirname or "."])
    rows = None
    f_history = checkpoint.f_history_
    source = _describe_target("f_history", f_history)
    if f_history is not None and (not is_path(f_history) or os.path.exists(f_history)):
        rows = _read_history(f_history, source)
        if not is_path(f_history):
            f_history.seek(0)
    files = _format_files(checkpoint, net, rows, source)
    recover({os.path.dirname(os.path.abspath(v)) for v in files.values() if is_path(v)})
    return files


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _text_writer(text: str) -> Callable[[Any], None]:
    def write(target: Any) -> None:
        if is_path(target):
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            target.write(text)

    return write


def _torch_writer(state: Any) -> Callable[[Any], None]:
    def write(target: Any) -> None:
        if is_path(target):
            # through a Python file, so that a write error (a full disk) raises
            # the OSError with its cause; torch's own writer loses it
            with open(target, "wb") as f:
                torch.save(state, f)
        else:
            torch.save(state, target)

    return write


def _state_writer(state: Any, source: str, safetensors: bool) -> Callable[[Any], None]:
    if not safetensors:
        return _torch_writer(state)
    bad = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(
            f"Cannot save {source} with use_safetensors=True: safetensors stores only "
            f"tensors, and {bad[:4]} are Python values (an optimizer state cannot be "
            "stored). Fix: pass use_safetensors=False, or leave this file out. Nothing "
            "was written."
        )

    def write(target: Any) -> None:
        from safetensors.torch import save

        data = save(state)
        if is_path(target):
            with open(target, "wb") as f:  # a write error raises the OSError with its cause
                f.write(data)
        else:
            target.write(data)

    return write
