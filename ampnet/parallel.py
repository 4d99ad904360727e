"""Data-parallel training with ``torch.distributed``: DDP, distributed
samplers, identical history on every rank, rank-0 output.

Launch with ``torchrun --nproc_per_node=N train.py``; inside, initialize
the process group (``torch.distributed.init_process_group('gloo' or
'nccl')``) before fitting. ``distributed='auto'`` then wraps the module in
:class:`~torch.nn.parallel.DistributedDataParallel` for the training
forward pass; ``net.module_`` itself stays the plain module, so checkpoints
and pickles are the same as from a single process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from skorch.callbacks import PrintLog, ProgressBar
from skorch.callbacks import Checkpoint as SkorchCheckpoint
from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from torch.utils.data import DistributedSampler

__all__ = ["DistributedMixin", "DistState"]

_RANK0_ONLY = (PrintLog, ProgressBar, SkorchCheckpoint, SkorchTrainEndCheckpoint)


@dataclass
class DistState:
    """The distributed setup of a fitted net (attribute ``dist_state_``).

    ``ddp`` is not pickled: a pickled net is a single-process net.
    """

    rank: int = 0
    world_size: int = 1
    ddp: Any = None
    samplers: list = field(default_factory=list)
    fitting: bool = False
    valid_len: int = 0  # rows of the validation set
    valid_seen: int = 0  # validation rows gathered so far in this epoch
    valid_batch: Any = None  # the gathered (X, y) of the current validation batch

    def __getstate__(self) -> dict[str, Any]:
        return {"rank": 0, "world_size": 1, "ddp": None, "samplers": [], "fitting": False,
                "valid_len": 0, "valid_seen": 0, "valid_batch": None}


def _layout_changed(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether the wrapped module's parameter dtypes changed since DDP
    registered them (e.g. amp_level changed through set_params)."""
    registered = getattr(ddp, "_ampnet_params", None)
    current = tuple(p.dtype for p in ddp.module.parameters())
    if registered is None:
        ddp._ampnet_params = current
        return False
    return registered != current


def _process_group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class DistributedMixin:
    """DDP training for ampnet nets (see the module docs)."""

    def initialize_distributed(self) -> "DistributedMixin":
        """Resolve ``distributed`` and wrap the module in DDP when on."""
        mode = self.distributed
        if mode not in ("auto", True, False):
            raise ValueError(
                f"distributed must be 'auto', True or False; got {mode!r} "
                f"({type(mode).__name__}). 'auto' turns it on when a torch.distributed "
                "process group is initialized."
            )
        on = _process_group_ready() if mode == "auto" else mode
        if not on:
            self.dist_state_ = DistState()
            return self
        if not _process_group_ready():
            raise ValueError(
                "distributed=True, but no torch.distributed process group is initialized. "
                "Fix: launch with torchrun and call "
                "torch.distributed.init_process_group('nccl' or 'gloo') before fit, or set "
                "distributed='auto'."
            )
        backend = dist.get_backend()
        device = torch.device(self.device or "cpu")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(
                f"The process group uses the 'nccl' backend, which needs CUDA tensors, but "
                f"device={self.device!r}. Fix: device='cuda' (with "
                "torch.cuda.set_device(local_rank)), or init_process_group('gloo') for CPU."
            )
        if self.amp_closure_mode_:
            raise ValueError(
                "Distributed training cannot use skorch's closure path (an optimizer such as "
                "LBFGS, or one whose step takes an optional closure): each rank would decide "
                "on its own loss how often to evaluate the closure, and the gradient "
                "all-reduce would hang. Fix: use a torch.optim first-order optimizer."
            )
        extra = [
            name for name in self._modules + self._criteria
            if name != "module"
            and isinstance(getattr(self, name + "_", None), torch.nn.Module)
            and any(p.requires_grad for p in getattr(self, name + "_").parameters())
        ]
        if extra:
            raise ValueError(
                f"Distributed training synchronizes the gradients of module_ only, but "
                f"{', '.join(n + '_' for n in extra)} also has learnable parameters, which "
                "would drift apart across ranks. Fix: make them submodules of the module, "
                "or freeze them."
            )
        self.dist_state_ = DistState(dist.get_rank(), dist.get_world_size(), self._wrap_ddp())
        return self

    def _wrap_ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        device = torch.device(self.device or "cpu")
        kwargs = {}
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            kwargs = {"device_ids": [index], "output_device": index}
        return torch.nn.parallel.DistributedDataParallel(self.module_, **kwargs)

    @property
    def _ddp(self):
        state = self.__dict__.get("dist_state_")
        return None if state is None else state.ddp

    # ---- forward through DDP while training --------------------------------

    def infer(self, x, **fit_params):
        ddp = self._ddp
        module = self.__dict__.get("module_")
        if ddp is None or not (torch.is_grad_enabled() and module.training):
            return super().infer(x, **fit_params)
        if ddp.module is not module or _layout_changed(ddp):
            # the module was re-initialized (set_params) or its parameters
            # changed dtype: wrap again (every rank does so at the same step)
            ddp = self.dist_state_.ddp = self._wrap_ddp()
        # A temporary swap, bypassing skorch's attribute registration: skorch's
        # infer calls self.module_, which must be the DDP wrapper for its
        # gradient hooks; everything else keeps seeing the plain module.
        self.__dict__["module_"] = ddp
        try:
            return super().infer(x, **fit_params)
        finally:
            self.__dict__["module_"] = module

    def _micro_batch_context(self, boundary: bool):
        ddp = self._ddp
        if ddp is None or boundary:
            return contextlib.nullcontext()
        return ddp.no_sync()

    # ---- data ----------------------------------------------------------------

    def fit_loop(self, X, y=None, epochs=None, **fit_params):
        state = self.__dict__.get("dist_state_")
        if state is None or state.ddp is None:
            return super().fit_loop(X, y, epochs=epochs, **fit_params)
        state.fitting, state.samplers = True, []
        try:
            return super().fit_loop(X, y, epochs=epochs, **fit_params)
        finally:
            state.fitting = False

    def get_iterator(self, dataset, training=False):
        state = self.__dict__.get("dist_state_")
        if state is None or state.ddp is None or not state.fitting:
            return super().get_iterator(dataset, training=training)
        prefix = "iterator_train" if training else "iterator_valid"
        kwargs = self.get_params_for(prefix)
        shuffle = bool(kwargs.pop("shuffle", False)) and training
        sampler = DistributedSampler(
            dataset, num_replicas=state.world_size, rank=state.rank, shuffle=shuffle, seed=0
        )
        state.samplers.append(sampler)
        if not training:
            state.valid_len = len(dataset)
        kwargs["sampler"] = sampler
        kwargs.setdefault("batch_size", self.batch_size)
        if kwargs["batch_size"] == -1:
            kwargs["batch_size"] = len(sampler)
        iterator = self.iterator_train if training else self.iterator_valid
        return iterator(dataset, **kwargs)

    def on_epoch_begin(self, net, **kwargs):
        super().on_epoch_begin(net, **kwargs)
        state = self.__dict__.get("dist_state_")
        if state is not None:
            state.valid_seen = 0
            for sampler in state.samplers:
                sampler.set_epoch(len(self.history))

    # ---- identical history on every rank ---------------------------------------

    def _mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        dist.all_reduce(out)
        return out / self.dist_state_.world_size

    def _any_rank(self, flag: bool) -> bool:
        if self._ddp is None:
            return flag
        t = torch.tensor([float(flag)], device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _comm_device(self) -> torch.device:
        return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")

    def train_step(self, batch, **fit_params):
        step = super().train_step(batch, **fit_params)
        if self._ddp is not None:
            step = dict(step, loss=self._mean_over_ranks(step["loss"].to(self._comm_device())))
        return step

    def validation_step(self, batch, **fit_params):
        step = super().validation_step(batch, **fit_params)
        if self._ddp is None:
            return step
        from skorch.dataset import unpack_data

        loss = self._mean_over_ranks(step["loss"].to(self._comm_device()))
        state = self.dist_state_
        Xi, yi = unpack_data(batch)
        y_pred, y_true = self._gather_in_order(step["y_pred"]), self._gather_in_order(yi)
        rows = len(y_pred) if isinstance(y_pred, torch.Tensor) else 0
        # the sampler pads the last round with repeats: drop them
        keep = max(0, min(rows, state.valid_len - state.valid_seen))
        state.valid_seen += rows
        if isinstance(y_pred, torch.Tensor):
            y_pred = y_pred[:keep]
        if isinstance(y_true, torch.Tensor):
            y_true = y_true[:keep]
        state.valid_batch = (Xi, y_true)
        return {"loss": loss, "y_pred": y_pred}

    def _gather_in_order(self, local: Any) -> Any:
        """All ranks' rows of this batch, in dataset order (the
        DistributedSampler without shuffling deals indices round-robin)."""
        if not isinstance(local, torch.Tensor):
            return local
        device = local.device
        local = local.detach().to(self._comm_device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.dist_state_.world_size)]
        dist.all_gather(parts, local)
        return torch.stack(parts, dim=1).flatten(0, 1).to(device)

    def notify(self, method_name: str, **cb_kwargs: Any) -> None:
        # scoring callbacks cache (batch, y_pred) of validation batches: give
        # them the targets gathered from all ranks, matching y_pred
        state = self.__dict__.get("dist_state_")
        if (
            method_name == "on_batch_end"
            and not cb_kwargs.get("training", False)
            and state is not None
            and state.valid_batch is not None
        ):
            cb_kwargs["batch"], state.valid_batch = state.valid_batch, None
        super().notify(method_name, **cb_kwargs)
        if method_name == "on_epoch_end" and state is not None and state.ddp is not None:
            # rank-0-only callbacks (Checkpoint's event_cp, ...) write to the
            # history there: every rank adopts rank 0's row for this epoch
            row = [self.history[-1] if state.rank == 0 else None]
            dist.broadcast_object_list(row, src=0)
            self.history[-1] = row[0]

    def _held_callbacks(self, method_name: str, cb_kwargs: dict) -> list:
        held = super()._held_callbacks(method_name, cb_kwargs)
        state = self.__dict__.get("dist_state_")
        if state is not None and state.rank != 0:
            held = held + [cb for _, cb in self.callbacks_ if isinstance(cb, _RANK0_ONLY)]
        return held

