"""The benchmark's settings, shared by the runner, the contenders and the
memory-probe subprocess (which receives them as JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any

import torch

from ampnet_bench.workloads import Workload, get_workload

__all__ = ["BenchConfig", "OPTIMIZERS", "BATCHING", "MEMORY_METHODS", "ISOLATION"]

#: ``--optimizer`` choices: torch class name, default lr, extra keyword arguments.
OPTIMIZERS: "MappingProxyType[str, tuple[str, float, tuple[tuple[str, Any], ...]]]" = MappingProxyType({
    "sgd": ("SGD", 0.01, (("momentum", 0.9),)),
    "adam": ("Adam", 1e-3, ()),
    "adamw": ("AdamW", 1e-3, ()),
})

#: ``--batching`` choices.
BATCHING = ("dataloader", "tensors")

#: ``--memory`` choices.
MEMORY_METHODS = ("auto", "subprocess", "inprocess", "off")

#: ``--isolation`` choices.
ISOLATION = ("auto", "process", "inprocess")


#: The fit that ``amp_enabled='auto'`` is measured for, in epochs (``BenchConfig.auto_fit_epochs``):
#: the docs' target spreads its measuring cost over a 10-epoch fit.
AUTO_FIT_EPOCHS = 10


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark invocation.

    Attributes
    ----------
    workloads : tuple of str
      Workload names, in run order.

    device : str
      Torch device, e.g. ``'cpu'`` or ``'cuda'``.

    dtype : str
      Low-precision dtype of the AMP contenders: ``'bfloat16'`` or ``'float16'``.

    rounds, epochs, warmup : int
      Rounds of interleaved runs; measured epochs (or ``predict_proba``
      calls) per run; un-measured warm-up epochs at the start of each run.

    batch_size, n_samples : int or None
      Override the workloads' defaults.

    channels_last : bool
      channels_last memory format for the CNN.

    quick : bool
      Tiny sizes for smoke tests.

    threads : int
      torch intra-op threads.

    optimizer : str
      A key of ``OPTIMIZERS``.

    lr : float or None
      Learning rate; None takes the optimizer's default from ``OPTIMIZERS``.

    seed : int
      Seed of data, weights and shuffling.

    batching : str
      ``'dataloader'``: a ``torch.utils.data.DataLoader`` over
      ``skorch.dataset.Dataset`` for every contender (skorch's default);
      ``'tensors'``: shuffled index slices of the pre-generated tensors for
      every contender (no per-sample collation).

    memory : str
      A key of ``MEMORY_METHODS``.

    contenders : tuple of str or None
      Contender keys to run; None runs all.

    isolation : str
      A key of ``ISOLATION``: ``'process'`` runs every run (one
      contender, one round) in a fresh Python process, so that a process's
      allocator state does not follow a contender through all its rounds;
      ``'inprocess'`` runs them all in this process; ``'auto'``: inprocess
      in quick mode, process otherwise.

    auto_fit_epochs : int
      The fit that ``amp_enabled='auto'``'s net runs as (``max_epochs``):
      the report spreads its measuring cost over as many epochs. The run stops after ``warmup + epochs`` of them, as
      skorch's ``EarlyStopping`` stops a fit.

    dims : tuple of (str, str)
      Model sizes that override the workloads' defaults, as
      ``("workload.size", "value")`` pairs, e.g. ``(("transformer.d_model",
      "128"),)`` (``--dims transformer.d_model=128``); see
      ``ampnet_bench.workloads.MODEL_DIMS``.
    """

    workloads: tuple[str, ...]
    device: str = "cpu"
    dtype: str = "bfloat16"
    rounds: int = 5
    epochs: int = 3
    warmup: int = 1
    batch_size: int | None = None
    n_samples: int | None = None
    channels_last: bool = False
    quick: bool = False
    threads: int = 1
    optimizer: str = "sgd"
    lr: float | None = None
    seed: int = 0
    batching: str = "dataloader"
    memory: str = "auto"
    contenders: tuple[str, ...] | None = None
    isolation: str = "auto"
    dims: tuple[tuple[str, str], ...] = ()
    auto_fit_epochs: int = AUTO_FIT_EPOCHS

    # ---- derived settings -------------------------------------------------

    @property
    def device_type(self) -> str:
        """``'cpu'``, ``'cuda'``, ..."""
        return torch.device(self.device).type

    @property
    def torch_dtype(self) -> torch.dtype:
        """The AMP dtype as a ``torch.dtype``."""
        return {"bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def isolation_method(self) -> str:
        """``'process'`` or ``'inprocess'`` (``'auto'`` resolved)."""
        if self.isolation != "auto":
            return self.isolation
        return "inprocess" if self.quick else "process"

    @property
    def memory_method(self) -> str:
        """The memory measurement actually used: ``'auto'`` resolves to
        ``'inprocess'`` on CUDA (``max_memory_allocated`` is exact per run)
        and in quick mode, and to ``'subprocess'`` otherwise."""
        if self.memory != "auto":
            return self.memory
        if self.isolation_method == "process":
            return "subprocess"
        if self.device_type == "cuda" or self.quick:
            return "inprocess"
        return "subprocess"

    def optimizer_spec(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The optimizer class and its keyword arguments (``lr`` included)."""
        name, default_lr, extra = OPTIMIZERS[self.optimizer]
        kwargs = dict(extra)
        kwargs["lr"] = default_lr if self.lr is None else self.lr
        return getattr(torch.optim, name), kwargs

    def workload(self, name: str) -> Workload:
        """The named workload under these settings."""
        return get_workload(
            name,
            quick=self.quick,
            batch_size=self.batch_size,
            n_samples=self.n_samples,
            channels_last=self.channels_last,
            dims=self.workload_dims(name),
        )

    def workload_dims(self, name: str) -> dict[str, str]:
        """The size overrides of :attr:`dims` that name workload ``name``."""
        prefix = name + "."
        return {key[len(prefix):]: value for key, value in self.dims if key.startswith(prefix)}

    # ---- (de)serialization -------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (round-trips through :meth:`from_dict`)."""
        out = asdict(self)
        out["workloads"] = list(self.workloads)
        out["contenders"] = None if self.contenders is None else list(self.contenders)
        out["dims"] = [list(pair) for pair in self.dims]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchConfig":
        """Rebuild a config written by :meth:`to_dict`."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["workloads"] = tuple(kwargs["workloads"])
        if kwargs.get("contenders") is not None:
            kwargs["contenders"] = tuple(kwargs["contenders"])
        kwargs["dims"] = tuple(tuple(pair) for pair in kwargs.get("dims", ()))
        return cls(**kwargs)
