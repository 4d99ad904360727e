"""The careful hand-written training loop: what a user who minds every
microsecond of a step writes in about 30 lines, the benchmark's floor for a
trainer's own cost.

- the data go to the device once; each batch is gathered with one
  ``index_select`` from one ``randperm`` per epoch (no ``DataLoader``, no
  per-sample indexing or collation);
- the optimizer is fused (``fused=True``) where torch has that kernel for the
  device, else ``foreach=True``;
- the forward pass and the loss run under ``torch.autocast`` (or in float32,
  with TF32 on or off as asked);
- the loss is summed on the device and read once an epoch: no host sync per
  step (bfloat16; float16's ``GradScaler`` reads its overflow flag each step).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["CarefulRun", "FLOAT32_MODES", "careful_train", "float32_mode", "make_fast_optimizer"]

#: ``float32`` choices of :func:`careful_train` and :func:`float32_mode`: None (torch's settings as they
#: are), ``'ieee'`` (TF32 off for matmuls and cuDNN) and ``'tf32'`` (TF32 on for both).
FLOAT32_MODES = (None, "ieee", "tf32")


@contextlib.contextmanager
def float32_mode(mode: str | None) -> Iterator[None]:
    """Set TF32 for float32 matmuls and cuDNN convolutions inside the block
    (``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.backends.cudnn.allow_tf32``) and restore both after it.

    Parameters
    ----------
    mode : {None, 'ieee', 'tf32'}
      None leaves both as they are; ``'ieee'`` turns TF32 off (IEEE float32
      arithmetic); ``'tf32'`` turns it on.

    Raises
    ------
    ValueError
      ``mode`` is not one of :data:`FLOAT32_MODES`.
    """
    if mode not in FLOAT32_MODES:
        raise ValueError(f"float32 mode {mode!r} is not one of None, 'ieee', 'tf32'; pass 'ieee' for IEEE "
                         f"float32 (TF32 off) or 'tf32' for TF32 matmuls and convolutions")
    if mode is None:
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    on = mode == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def make_fast_optimizer(
    optimizer_cls: type[torch.optim.Optimizer], params: Any, kwargs: dict[str, Any]
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer with ``fused=True``, or ``foreach=True`` where torch
    refuses the fused kernel for these parameters (their device or dtype).

    Returns
    -------
    (optimizer, str)
      The optimizer and which implementation it got: ``'fused'`` or ``'foreach'``.
    """
    params = list(params)
    try:
        return optimizer_cls(params, **kwargs, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return optimizer_cls(params, **kwargs, foreach=True), "foreach"


@dataclass
class CarefulRun:
    """What :func:`careful_train` returns.

    Attributes
    ----------
    epoch_times : list of float
      Seconds per epoch, from before the epoch's permutation to after its
      last optimizer step (the device synchronized at both ends).

    epoch_losses : list of float
      Mean training loss of each epoch (read once at its end).

    model : torch.nn.Module
      The trained model.

    optimizer : torch.optim.Optimizer
      Its optimizer.

    optimizer_impl : str
      ``'fused'`` or ``'foreach'`` (see :func:`make_fast_optimizer`).
    """

    epoch_times: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    optimizer_impl: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def careful_train(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    epochs: int,
    optimizer_cls: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    device: str | torch.device = "cpu",
    amp_dtype: torch.dtype | None = torch.bfloat16,
    float32: str | None = None,
    criterion: nn.Module | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> CarefulRun:
    """Train ``model`` on ``(X, y)`` with the careful loop (see the module's docstring).

    Parameters
    ----------
    model : torch.nn.Module
      Moved to ``device``.

    X, y : torch.Tensor
      All rows, moved to ``device`` once.

    batch_size, epochs : int
      Rows per batch (the last batch may be short) and epochs.

    optimizer_cls, optimizer_kwargs
      The optimizer (built fused, see :func:`make_fast_optimizer`) and its
      settings (``lr`` included).

    device : str or torch.device
      Where the model and data live.

    amp_dtype : torch.dtype or None
      The autocast dtype; None trains in float32. ``torch.float16`` adds a
      ``GradScaler``.

    float32 : {None, 'ieee', 'tf32'}
      TF32 for float32 matmuls and convolutions (:func:`float32_mode`).

    criterion : torch.nn.Module or None
      The loss; None: ``nn.CrossEntropyLoss()``.

    seed : int
      Seed of the permutations (a CPU ``torch.Generator``).

    clock : callable
      Returns seconds; the epochs are timed with it.

    Returns
    -------
    CarefulRun
    """
    device = torch.device(device)
    model = model.to(device)
    X, y = X.to(device), y.to(device)
    criterion = criterion if criterion is not None else nn.CrossEntropyLoss()
    optimizer, impl = make_fast_optimizer(optimizer_cls, model.parameters(), dict(optimizer_kwargs))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    generator = torch.Generator().manual_seed(seed)
    run = CarefulRun(model=model, optimizer=optimizer, optimizer_impl=impl)
    n = len(X)
    with float32_mode(float32):
        for _ in range(epochs):
            _sync(device)
            start = clock()
            model.train()
            order = torch.randperm(n, generator=generator).to(device, non_blocking=True)
            total = torch.zeros((), device=device)
            for begin in range(0, n, batch_size):
                idx = order[begin:begin + batch_size]
                Xb, yb = X.index_select(0, idx), y.index_select(0, idx)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                    loss = criterion(model(Xb), yb)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                total += loss.detach() * len(idx)
            _sync(device)
            run.epoch_times.append(clock() - start)
            run.epoch_losses.append(float(total) / n)  # the one read of the epoch
    return run
