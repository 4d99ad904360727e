"""Data-parallel training with ``torch.distributed``, as a component that
the training step calls (fitted attribute ``parallel_``).

:class:`Parallel` is one process: every hook does nothing.
:class:`DataParallel` is built when ``distributed`` is on (``'auto'`` with an
initialized process group, or True): the training forward pass runs through
:class:`~torch.nn.parallel.DistributedDataParallel` (``net.module_`` stays the
plain module, so checkpoints and pickles are the same as from one process),
data is split with a ``DistributedSampler``, losses are averaged and
validation predictions gathered in dataset order so that the history is the
same on every rank, an overflow on any rank skips the step on every rank,
and only rank 0 prints and writes checkpoints.

Launch with ``torchrun --nproc_per_node=N train.py`` and initialize the
process group (``torch.distributed.init_process_group('gloo' or 'nccl')``)
before fitting.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from skorch.callbacks import Checkpoint as SkorchCheckpoint
from skorch.callbacks import PrintLog, ProgressBar
from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from skorch.dataset import unpack_data
from torch.utils.data import DistributedSampler

from ampnet.config.params import parsed

__all__ = ["Parallel", "DataParallel", "build_parallel", "rebuild_parallel"]

_RANK0_ONLY = (PrintLog, ProgressBar, SkorchCheckpoint, SkorchTrainEndCheckpoint)


class Parallel:
    """One process: the hooks of the data-parallel component do nothing.

    Attributes
    ----------
    rank : int
      This process's rank (0).

    world_size : int
      Number of processes (1).

    ddp : DistributedDataParallel or None
      The wrapper of the training forward pass (None here).
    """

    rank = 0
    world_size = 1
    ddp = None

    def no_sync(self, boundary: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch; ``boundary``: an optimizer step follows."""
        return contextlib.nullcontext()

    def forward_module(self, net: Any) -> contextlib.AbstractContextManager:
        """Context of the training forward pass."""
        return contextlib.nullcontext()

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over ranks."""
        return tensor

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return flag

    def iterator(self, net: Any, dataset: Any, training: bool) -> Any:
        """A data loader for this rank, or None for skorch's own."""
        return None

    @contextlib.contextmanager
    def fitting(self) -> Iterator[None]:
        """Around ``fit_loop``."""
        yield

    def begin_epoch(self, epoch: int) -> None:
        """At the start of each epoch."""

    def validation(self, step: dict, batch: Any) -> dict:
        """A validation step's output, the same on every rank."""
        return step

    def callback_kwargs(self, method_name: str, cb_kwargs: dict) -> dict:
        """The keyword arguments callbacks receive for ``method_name``."""
        return cb_kwargs

    def after_notify(self, net: Any, method_name: str) -> None:
        """After every callback saw ``method_name``."""

    def held_callbacks(self, net: Any) -> list:
        """Callbacks that do not run on this rank."""
        return []

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        pass  # a pickled net is a single-process net


class DataParallel(Parallel):
    """Training over the ranks of an initialized process group (see the module docs)."""

    def __init__(self, net: Any) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(net.device or "cpu")
        self.ddp = self._wrap(net.module_)
        self.samplers: list[DistributedSampler] = []
        self.active = False  # inside fit_loop
        self.valid_len = 0  # rows of the validation set
        self.valid_seen = 0  # validation rows gathered so far in this epoch
        self.valid_batch: Any = None  # the gathered (X, y) of the current validation batch

    def _wrap(self, module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        kwargs = {}
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            kwargs = {"device_ids": [index], "output_device": index}
        ddp = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
        self.param_dtypes = tuple(p.dtype for p in module.parameters())
        return ddp

    def _comm_device(self) -> torch.device:
        return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")

    def no_sync(self, boundary: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if boundary else self.ddp.no_sync()

    @contextlib.contextmanager
    def forward_module(self, net: Any) -> Iterator[None]:
        module = net.__dict__.get("module_")
        if not (torch.is_grad_enabled() and module.training):
            yield
            return
        if self.ddp.module is not module or self.param_dtypes != tuple(p.dtype for p in module.parameters()):
            # the module was re-initialized (set_params) or its parameters
            # changed dtype: wrap again (every rank does so at the same step)
            self.ddp = self._wrap(module)
        # A temporary swap, bypassing skorch's attribute registration: skorch's
        # infer calls self.module_, which must be the DDP wrapper for its
        # gradient hooks; everything else keeps seeing the plain module.
        net.__dict__["module_"] = self.ddp
        try:
            yield
        finally:
            net.__dict__["module_"] = module

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to(self._comm_device()).clone()
        dist.all_reduce(out)
        return out / self.world_size

    def any(self, flag: bool) -> bool:
        t = torch.tensor([float(flag)], device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    @contextlib.contextmanager
    def fitting(self) -> Iterator[None]:
        self.active, self.samplers = True, []
        try:
            yield
        finally:
            self.active = False

    def iterator(self, net: Any, dataset: Any, training: bool) -> Any:
        if not self.active:
            return None
        prefix = "iterator_train" if training else "iterator_valid"
        kwargs = net.get_params_for(prefix)
        shuffle = bool(kwargs.pop("shuffle", False)) and training
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=0)
        self.samplers.append(sampler)
        if not training:
            self.valid_len = len(dataset)
        kwargs["sampler"] = sampler
        kwargs.setdefault("batch_size", net.batch_size)
        if kwargs["batch_size"] == -1:
            kwargs["batch_size"] = len(sampler)
        iterator = net.iterator_train if training else net.iterator_valid
        return iterator(dataset, **kwargs)

    def begin_epoch(self, epoch: int) -> None:
        self.valid_seen = 0
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def validation(self, step: dict, batch: Any) -> dict:
        loss = self.mean(step["loss"])
        Xi, yi = unpack_data(batch)
        y_pred, y_true = self._gather_in_order(step["y_pred"]), self._gather_in_order(yi)
        rows = len(y_pred) if isinstance(y_pred, torch.Tensor) else 0
        # the sampler pads the last round with repeats: drop them
        keep = max(0, min(rows, self.valid_len - self.valid_seen))
        self.valid_seen += rows
        if isinstance(y_pred, torch.Tensor):
            y_pred = y_pred[:keep]
        if isinstance(y_true, torch.Tensor):
            y_true = y_true[:keep]
        self.valid_batch = (Xi, y_true)
        return {"loss": loss, "y_pred": y_pred}

    def _gather_in_order(self, local: Any) -> Any:
        """All ranks' rows of this batch, in dataset order (the
        DistributedSampler without shuffling deals indices round-robin)."""
        if not isinstance(local, torch.Tensor):
            return local
        device = local.device
        local = local.detach().to(self._comm_device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts, dim=1).flatten(0, 1).to(device)

    def callback_kwargs(self, method_name: str, cb_kwargs: dict) -> dict:
        # scoring callbacks cache (batch, y_pred) of validation batches: give
        # them the targets gathered from all ranks, matching y_pred
        if method_name == "on_batch_end" and not cb_kwargs.get("training", False) and self.valid_batch is not None:
            cb_kwargs = dict(cb_kwargs, batch=self.valid_batch)
            self.valid_batch = None
        return cb_kwargs

    def after_notify(self, net: Any, method_name: str) -> None:
        if method_name == "on_epoch_end":
            # rank-0-only callbacks (Checkpoint's event_cp, ...) write to the
            # history there: every rank adopts rank 0's row for this epoch
            row = [net.history[-1] if self.rank == 0 else None]
            dist.broadcast_object_list(row, src=0)
            net.history[-1] = row[0]

    def held_callbacks(self, net: Any) -> list:
        if self.rank == 0:
            return []
        return [cb for _, cb in net.callbacks_ if isinstance(cb, _RANK0_ONLY)]


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def build_parallel(net: Any, closure: bool) -> Parallel:
    """The data-parallel component for ``net.distributed``; ``closure``:
    whether the net steps through skorch's closure path.

    ``net.distributed`` is read through the parameter table
    (:func:`ampnet.config.params.check`): ``'AUTO'`` or ``' auto'`` is ``'auto'``,
    a numpy boolean is a bool.

    Raises
    ------
    ValueError
      An unknown ``distributed`` value (the table's refusal), ``True``
      without a process group, NCCL with a CPU device, a closure optimizer,
      or learnable parameters outside ``module_``.
    """
    mode = parsed(net, "distributed")
    on = _process_group_ready() if mode == "auto" else mode
    if not on:
        return Parallel()
    if not _process_group_ready():
        raise ValueError(
            "distributed=True, but no torch.distributed process group is initialized. "
            "Fix: launch with torchrun and call "
            "torch.distributed.init_process_group('nccl' or 'gloo') before fit, or set "
            "distributed='auto'."
        )
    device = torch.device(net.device or "cpu")
    if dist.get_backend() == "nccl" and device.type != "cuda":
        raise ValueError(
            f"The process group uses the 'nccl' backend, which needs CUDA tensors, but "
            f"device={net.device!r}. Fix: device='cuda' (with "
            "torch.cuda.set_device(local_rank)), or init_process_group('gloo') for CPU."
        )
    if closure:
        raise ValueError(
            "Distributed training cannot use skorch's closure path (an optimizer such as "
            "LBFGS, or one whose step takes an optional closure): each rank would decide "
            "on its own loss how often to evaluate the closure, and the gradient "
            "all-reduce would hang. Fix: use a torch.optim first-order optimizer."
        )
    extra = [
        name for name in net._modules + net._criteria
        if name != "module"
        and isinstance(getattr(net, name + "_", None), torch.nn.Module)
        and any(p.requires_grad for p in getattr(net, name + "_").parameters())
    ]
    if extra:
        raise ValueError(
            f"Distributed training synchronizes the gradients of module_ only, but "
            f"{', '.join(n + '_' for n in extra)} also has learnable parameters, which "
            "would drift apart across ranks. Fix: make them submodules of the module, "
            "or freeze them."
        )
    return DataParallel(net)


def rebuild_parallel(net: Any, current: Parallel, closure: bool) -> Parallel:
    """The data-parallel component after ``set_params`` changed
    ``distributed`` on a fitted net: ``current`` where the new value keeps
    data parallelism as it is (on with a process group, or off), so that no
    rank wraps the module again; else a new one, refused as
    :func:`build_parallel` refuses it at ``initialize()`` (``True`` without
    a process group).

    Raises
    ------
    ValueError
      As :func:`build_parallel`.
    """
    mode = parsed(net, "distributed")
    on = _process_group_ready() if mode == "auto" else mode
    if bool(on) == isinstance(current, DataParallel) and (not on or _process_group_ready()):
        return current
    return build_parallel(net, closure)
