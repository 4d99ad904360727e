"""Writing the files of a net's state: the writers that :func:`ampnet.io.atomic.atomic_write_group`
calls with each temporary path (torch, safetensors and text), a write error raised with its cause."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ampnet.io.untrusted import is_path

__all__ = ["plain", "text_writer", "state_writer"]


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def text_writer(text: str) -> Callable[[Any], None]:
    def write(target: Any) -> None:
        if is_path(target):
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            target.write(text)

    return write


def _os_error_behind(exc: BaseException) -> OSError | None:
    """The OSError that ``exc`` was raised while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _torch_writer(state: Any) -> Callable[[Any], None]:
    def write(target: Any) -> None:
        try:
            if is_path(target):
                # through a Python file, so that a write error (a full disk) raises
                # the OSError with its cause; torch's own writer loses it
                with open(target, "wb") as f:
                    torch.save(state, f)
            else:
                torch.save(state, target)
        except RuntimeError as exc:
            # torch's zip writer, closing after a failed write, raises its own
            # "unexpected pos" error over the OSError
            cause = _os_error_behind(exc)
            if cause is None:
                raise
            raise cause from None

    return write


def state_writer(state: Any, source: str, safetensors: bool) -> Callable[[Any], None]:
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
        # optional dependency: safetensors (only for use_safetensors=True)
        from safetensors.torch import save

        data = save(state)
        if is_path(target):
            with open(target, "wb") as f:  # a write error raises the OSError with its cause
                f.write(data)
        else:
            target.write(data)

    return write
