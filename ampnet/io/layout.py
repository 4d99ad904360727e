"""Which files a checkpoint folder holds for a net, and where: resolved, named for messages, and
confined to the folder (used by :class:`ampnet.io.persistence.PersistenceMixin` and
:mod:`ampnet.callbacks.checkpoint`)."""

from __future__ import annotations

import os
from typing import Any

from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from skorch.history import History

from ampnet.io.atomic import recover
from ampnet.io.state_files import describe_target, read_history
from ampnet.io.untrusted import is_path

__all__ = ["attr_of", "resolve_checkpoint", "checkpoint_files"]


def attr_of(key: str) -> str:
    return "module_" if key in ("f_params", "f_module") else key[2:] + "_"


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
    source = describe_target("f_history", f_history)
    if f_history is not None and (not is_path(f_history) or os.path.exists(f_history)):
        rows = read_history(f_history, source)
        if not is_path(f_history):
            f_history.seek(0)
    files = _format_files(checkpoint, net, rows, source)
    recover({os.path.dirname(os.path.abspath(v)) for v in files.values() if is_path(v)})
    return files
