"""Reading, checking and writing the files of a net's state (used by
:class:`ampnet.io.persistence.PersistenceMixin` and :mod:`ampnet.callbacks.checkpoint`)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any, Callable

import torch
from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from skorch.history import History

from ampnet.io.atomic import is_path, read_json, recover

def _describe_target(key: str, target: Any) -> str:
    if is_path(target):
        return f"{key} file {os.fspath(target)!r}"
    return f"{key} ({getattr(target, 'name', type(target).__name__)!r})"


def _attr_of(key: str) -> str:
    return "module_" if key in ("f_params", "f_module") else key[2:] + "_"


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (
        pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError,
    )
    try:
        from safetensors import SafetensorError
    except ImportError:  # safetensors is optional
        return errors
    return errors + (SafetensorError,)


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
    except _read_errors() as exc:
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


def _read_history(target: Any, source: str) -> list:
    rows = read_json(target, source, "a JSON history")
    if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
        raise ValueError(
            f"{source} is not a skorch history: expected a JSON list of epoch dicts, got "
            f"{type(rows).__name__}."
        )
    return rows


def _check_module_state(module: torch.nn.Module, state: Any, source: str, attr: str) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{source} does not hold a module state_dict for net.{attr}: got "
            f"{type(state).__name__}."
        )
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{key}: {tuple(state[key].shape)} in the file, {tuple(value.shape)} in the net"
        for key, value in own.items()
        if key in state
        and isinstance(value, torch.Tensor)
        and isinstance(state[key], torch.Tensor)
        and not torch.nn.parameter.is_lazy(value)
        and state[key].shape != value.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:6]}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:6]}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(shapes[:4]))
        raise ValueError(
            f"{source} does not match net.{attr}: {', '.join(parts)}. Was another file "
            "passed (e.g. the optimizer file as f_params), or was the module built with "
            "other sizes? Nothing was loaded."
        )


def _check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, source: str,
                           attr: str) -> None:
    if not (isinstance(state, Mapping) and "state" in state and "param_groups" in state):
        found = sorted(map(str, state))[:6] if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"{source} is not an optimizer state for net.{attr} (expected the keys "
            f"'state' and 'param_groups', found {found}). Was another file passed?"
        )
    groups, own = state["param_groups"], optimizer.param_groups
    sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    own_sizes = [len(g["params"]) for g in own]
    if sizes != own_sizes:
        raise ValueError(
            f"{source} does not match net.{attr}: parameter groups of sizes {sizes} in the "
            f"file, {own_sizes} in the net. Nothing was loaded."
        )


def _format_files(checkpoint: Any, net: Any, rows: list | None) -> dict[str, Any]:
    saved = net.history
    try:
        if rows is not None:
            net.history = History(rows)
        if len(net.history):
            return checkpoint.get_formatted_files(net)
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
    if f_history is not None and (not is_path(f_history) or os.path.exists(f_history)):
        rows = _read_history(f_history, _describe_target("f_history", f_history))
        if not is_path(f_history):
            f_history.seek(0)
    files = _format_files(checkpoint, net, rows)
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


def _state_writer(state: Any, source: str, safetensors: bool) -> Callable[[Any], None]:
    if not safetensors:
        return lambda target: torch.save(state, target)
    bad = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(
            f"Cannot save {source} with use_safetensors=True: safetensors stores only "
            f"tensors, and {bad[:4]} are Python values (an optimizer state cannot be "
            "stored). Fix: pass use_safetensors=False, or leave this file out. Nothing "
            "was written."
        )

    def write(target: Any) -> None:
        from safetensors.torch import save, save_file

        if is_path(target):
            save_file(state, os.fspath(target))
        else:
            target.write(save(state))

    return write
