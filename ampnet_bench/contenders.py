"""The contenders: a hand-written PyTorch loop, skorch and AmpNet, each
running one workload once (build, warm up, measure, evaluate).

Fairness rules implemented here:

- every contender builds its module with :meth:`Workload.build_module`
  (same seed, same initial weights) and trains on the same tensors;
- the same optimizer class and settings, batch size and loss
  (``CrossEntropyLoss`` on logits);
- the same batching: the raw loop iterates exactly what skorch's
  ``get_iterator`` builds (a ``DataLoader`` over ``skorch.dataset.Dataset``,
  or :class:`TensorBatches`), shuffled by a ``torch.Generator`` with the
  same seed, so all contenders see the same batches in the same order;
- skorch and AmpNet run with ``train_split=None`` and ``verbose=0``, so an
  epoch is training only;
- epochs are timed with ``time.perf_counter`` from ``on_epoch_begin`` to
  ``on_epoch_end`` (a skorch callback) and over the same span in the raw
  loop (loader creation to the last optimizer step), with
  ``torch.cuda.synchronize`` on CUDA.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import torch
from skorch import NeuralNetClassifier
from skorch.callbacks import Callback
from skorch.dataset import Dataset
from torch import nn

from ampnet import AmpNetClassifier
from ampnet_bench.config import BenchConfig
from ampnet_bench.workloads import Data, Workload

__all__ = [
    "Contender",
    "ContenderUnavailable",
    "CONTENDERS",
    "GPU_CONTENDERS",
    "OVERHEAD_CONTENDERS",
    "overhead_contenders",
    "CONTENDER_KEYS",
    "HEADLINE_CONTENDERS",
    "RunOutcome",
    "TensorBatches",
    "EpochClock",
    "run_contender",
    "train_reference_weights",
]


@dataclass(frozen=True)
class Contender:
    """One way of training the model.

    Attributes
    ----------
    key : str
      Short identifier (``--contenders``, JSON).

    label : str
      Description for the report.

    framework : str
      ``'raw'`` (hand-written loop), ``'careful'`` (the careful loop,
      :mod:`ampnet_bench.careful_loop`), ``'item'`` (a loop that reads the
      loss each step), ``'skorch'``, ``'ampnet'``,
      ``'accelerate'`` (skorch with ``skorch.hf.AccelerateMixin``) or
      ``'lightning'`` (a Lightning ``Trainer``).

    amp : bool
      Whether automatic mixed precision is on.

    level : str
      AmpNet's ``amp_level`` (``'mixed'`` or ``'pure'``).

    master_weights : bool or str
      AmpNet's ``amp_master_weights`` (only matters in ``'pure'``):
      True, False or ``'compensated'``.

    skip_nonfinite : bool
      AmpNet's ``amp_skip_nonfinite`` (the non-finite gradient guard).

    fused : bool
      The optimizer with ``fused=True`` (AmpNet: ``optimizer__fused=True``;
      the raw loop: its optimizer built so).

    auto : bool
      AmpNet with ``amp_enabled='auto'``, its cache off (it measures in every
      run, as a first fit on a machine does): what its measuring steps cost
      beyond the choice (``amp_autotune_.cost_s``) is spread over the
      measured epochs, so the epoch times include it.

    control_of : str or None
      Key of the contender this one repeats exactly (the A/A control).

    monitor : bool
      AmpNet with an :class:`ampnet.callbacks.AmpMonitor` callback (the
      flight recorder: skip causes, ``grad_norm``, ``lost_updates``).

    float32 : str or None
      The careful loop's float32 arithmetic on CUDA: ``'ieee'`` (TF32 off for
      matmuls and cuDNN), ``'tf32'`` (on), None (torch's settings as they are).

    amp_dtype : str or None
      AmpNet's ``amp_dtype`` where it is not the benchmark's ``--dtype``
      (``'float8'``).

    compile : bool
      AmpNet with ``compile=True``.
    """

    key: str
    label: str
    framework: str
    amp: bool
    level: str = "mixed"
    master_weights: bool | str = True
    skip_nonfinite: bool = True
    fused: bool = False
    control_of: str | None = None
    auto: bool = False
    monitor: bool = False
    float32: str | None = None
    amp_dtype: str | None = None
    compile: bool = False


class ContenderUnavailable(RuntimeError):
    """A contender that cannot run here (a CUDA-only setting on a CPU, a
    missing package, a setting this ampnet does not have); its message
    says why and is reported in place of the contender's figures."""


#: All contenders, in the order they run within a round.
CONTENDERS: tuple[Contender, ...] = (
    Contender("raw-fp32", "PyTorch loop, float32", "raw", False),
    Contender("raw-amp", "PyTorch loop, autocast", "raw", True),
    Contender("raw-amp-aa", "PyTorch loop, autocast, again (A/A control)", "raw", True,
              control_of="raw-amp"),
    Contender("raw-amp-fused", "PyTorch loop, autocast, fused optimizer (the best hand-written loop)",
              "raw", True, fused=True),
    Contender("skorch-fp32", "skorch NeuralNetClassifier, float32", "skorch", False),
    Contender("ampnet-fp32", "AmpNet, amp_enabled=False", "ampnet", False),
    Contender("ampnet-fp32-aa", "AmpNet, amp_enabled=False, again (A/A control)", "ampnet", False,
              control_of="ampnet-fp32"),
    Contender("ampnet-fp32-noguard", "AmpNet, amp_enabled=False, amp_skip_nonfinite=False", "ampnet", False,
              skip_nonfinite=False),
    Contender("ampnet-fp32-monitor", "AmpNet, amp_enabled=False, with AmpMonitor", "ampnet", False,
              monitor=True),
    Contender("ampnet-mixed", "AmpNet, amp_level='mixed'", "ampnet", True, "mixed"),
    Contender("ampnet-mixed-noguard", "AmpNet, amp_level='mixed', amp_skip_nonfinite=False",
              "ampnet", True, "mixed", skip_nonfinite=False),
    Contender("ampnet-mixed-monitor", "AmpNet, amp_level='mixed', with AmpMonitor", "ampnet", True, "mixed",
              monitor=True),
    Contender("ampnet-pure", "AmpNet, amp_level='pure'", "ampnet", True, "pure"),
    Contender("ampnet-pure-nomw", "AmpNet, amp_level='pure', amp_master_weights=False", "ampnet",
              True, "pure", False),
    Contender("ampnet-mixed-fused", "AmpNet, amp_level='mixed', optimizer__fused=True", "ampnet",
              True, "mixed", fused=True),
    Contender("ampnet-pure-comp", "AmpNet, amp_level='pure', amp_master_weights='compensated'",
              "ampnet", True, "pure", "compensated"),
    Contender("ampnet-pure-comp-fused",
              "AmpNet, amp_level='pure', amp_master_weights='compensated', optimizer__fused=True",
              "ampnet", True, "pure", "compensated", fused=True),
    Contender("ampnet-auto", "AmpNet, amp_enabled='auto' (its probe included)", "ampnet", True, auto=True),
    Contender("skorch-accelerate",
              "skorch + accelerate (AccelerateMixin, Accelerator(mixed_precision='bf16'|'fp16'))",
              "accelerate", True),
    Contender("lightning", "Lightning Trainer(precision='bf16-mixed'|'16-mixed')", "lightning", True),
    Contender("raw-careful", "careful hand loop: data on the device, one index_select a batch, fused optimizer, "
              "autocast, loss read once an epoch", "careful", True),
    Contender("raw-careful-aa", "careful hand loop, again (A/A control)", "careful", True,
              control_of="raw-careful"),
    Contender("raw-careful-fp32", "careful hand loop, float32 (IEEE: TF32 off)", "careful", False,
              float32="ieee"),
    Contender("raw-careful-tf32", "careful hand loop, float32 with TF32 matmuls and convolutions (CUDA)",
              "careful", False, float32="tf32"),
    Contender("raw-item-fp32", "hand loop: DataLoader over a TensorDataset, loss.item() each step, float32",
              "item", False),
    Contender("raw-item-amp", "hand loop: DataLoader over a TensorDataset, loss.item() each step, autocast",
              "item", True),
    Contender("ampnet-float8", "AmpNet, amp_dtype='float8', compile=True (CUDA: compute capability >= 8.9 "
              "and torchao)", "ampnet", True, amp_dtype="float8", compile=True),
)

#: Keys of :data:`CONTENDERS`.
CONTENDER_KEYS: tuple[str, ...] = tuple(c.key for c in CONTENDERS)

#: The contenders of the docs' per-workload tables and of ``--check``: the float32 loop, the
#: autocast loop (twice: the A/A control), the autocast loop with a fused optimizer, the peers
#: (skorch + accelerate, Lightning), and AmpNet with default settings, ``'auto'`` and compensated
#: pure weights.
HEADLINE_CONTENDERS: tuple[str, ...] = (
    "raw-fp32", "raw-amp", "raw-amp-aa", "raw-amp-fused", "skorch-accelerate", "lightning",
    "ampnet-mixed", "ampnet-auto", "ampnet-pure-comp",
)


#: The overhead workload's contenders (``raw-careful-tf32`` on CUDA only: see :func:`overhead_contenders`).
OVERHEAD_CONTENDERS: tuple[str, ...] = (
    "raw-careful", "raw-careful-aa", "raw-careful-fp32", "raw-careful-tf32", "raw-item-fp32", "raw-item-amp",
    "skorch-fp32", "ampnet-fp32", "ampnet-mixed", "ampnet-auto",
)

#: The contenders of the GPU workloads (:data:`ampnet_bench.workloads.GPU_WORKLOADS`): float32 with IEEE
#: arithmetic and with TF32, the careful loop under autocast (twice: the A/A control), AmpNet's default
#: and ``'auto'``, and ``amp_dtype='float8'`` (the encoder and decoder only).
GPU_CONTENDERS: tuple[str, ...] = (
    "raw-careful-fp32", "raw-careful-tf32", "raw-careful", "raw-careful-aa", "ampnet-mixed", "ampnet-auto",
    "ampnet-float8",
)


def overhead_contenders(device_type: str) -> tuple[str, ...]:
    """:data:`OVERHEAD_CONTENDERS` for a device type: TF32 is a CUDA setting,
    so ``raw-careful-tf32`` runs on CUDA only.

    Parameters
    ----------
    device_type : str
      ``'cpu'``, ``'cuda'``, ...

    Returns
    -------
    tuple of str
    """
    return tuple(k for k in OVERHEAD_CONTENDERS if device_type == "cuda" or k != "raw-careful-tf32")


@dataclass
class RunOutcome:
    """What one run of one contender produced.

    Attributes
    ----------
    epoch_times : list of float
      Seconds per measured epoch (or ``predict_proba`` call); warm-up excluded.

    final_loss : float
      Training loss of the last epoch (mean over samples); for prediction,
      the cross-entropy of the predicted probabilities.

    accuracy : float
      Accuracy on the held-out rows (training) or on the predicted rows.

    param_dtypes : list of str
      dtypes of the module's parameters after the run.

    warnings : list of str
      Distinct warnings raised during the run.

    state_bytes : dict or None
      Bytes of the training state after the run, by role: AmpNet's
      ``net.memory_report().to_dict()``; for the other contenders the same
      count (:func:`ampnet.precision.memory.measure_memory`) over their
      module and optimizer. None for prediction.

    auto_choice : dict or None
      ``amp_enabled='auto'`` only: what its probe chose (``chosen``, in
      words; ``params``, the constructor parameters; ``cost_s``).
    """

    epoch_times: list[float]
    final_loss: float
    accuracy: float
    param_dtypes: list[str]
    warnings: list[str] = field(default_factory=list)
    state_bytes: dict[str, Any] | None = None
    auto_choice: dict[str, Any] | None = None


class TensorBatches:
    """Batches as index slices of the dataset's tensors (``--batching tensors``).

    A drop-in for ``torch.utils.data.DataLoader`` as skorch's
    ``iterator_train``/``iterator_valid``: no per-sample indexing and
    collation, so the timings show the trainer rather than the loader.

    Parameters
    ----------
    dataset : skorch.dataset.Dataset
      Holds ``X`` and ``y`` tensors.

    batch_size : int
      Rows per batch.

    shuffle : bool
      Draw a fresh permutation each time the iterator is iterated.

    generator : torch.Generator or None
      Source of the permutations.

    **kwargs
      Other ``DataLoader`` arguments; ignored.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 128,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        self.X = dataset.X
        self.y = dataset.y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.generator = generator

    def __len__(self) -> int:
        return -(-len(self.X) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Any]]:
        n = len(self.X)
        if self.shuffle:
            order = torch.randperm(n, generator=self.generator)
            for start in range(0, n, self.batch_size):
                idx = order[start : start + self.batch_size]
                yield self.X[idx], (None if self.y is None else self.y[idx])
        else:
            for start in range(0, n, self.batch_size):
                stop = start + self.batch_size
                yield self.X[start:stop], (None if self.y is None else self.y[start:stop])


class EpochClock(Callback):
    """skorch callback that records the wall time of each epoch.

    Parameters
    ----------
    device : str
      The net's device; CUDA is synchronized before reading the clock.

    stop_after : int or None
      End the fit after this many epochs (raising ``KeyboardInterrupt``,
      which skorch's ``partial_fit`` takes as the end of training, as
      ``EarlyStopping`` does); None: run ``max_epochs``.

    Attributes
    ----------
    epoch_times_ : list of float
      Seconds per epoch, from ``on_epoch_begin`` to ``on_epoch_end``.
    """

    def __init__(self, device: str = "cpu", stop_after: int | None = None) -> None:
        self.device = device
        self.stop_after = stop_after

    def initialize(self) -> "EpochClock":
        self.epoch_times_: list[float] = []
        self._start = 0.0
        return self

    def on_epoch_begin(self, net: Any, **kwargs: Any) -> None:
        _sync(self.device)
        self._start = time.perf_counter()

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        _sync(self.device)
        self.epoch_times_.append(time.perf_counter() - self._start)
        if self.stop_after is not None and len(self.epoch_times_) >= self.stop_after:
            raise KeyboardInterrupt  # skorch ends the fit here, as EarlyStopping does


# ---- helpers ----------------------------------------------------------------


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _iterator_class(cfg: BenchConfig) -> type:
    return torch.utils.data.DataLoader if cfg.batching == "dataloader" else TensorBatches


def _make_iterator(
    cfg: BenchConfig, dataset: Dataset, batch_size: int, shuffle: bool, generator: torch.Generator | None
) -> Any:
    kwargs: dict[str, Any] = {"batch_size": batch_size}
    if shuffle:
        kwargs.update(shuffle=True, generator=generator)
    return _iterator_class(cfg)(dataset, **kwargs)


def _shuffle_generator(cfg: BenchConfig) -> torch.Generator:
    return torch.Generator().manual_seed(cfg.seed + 1)


def _param_dtypes(module: nn.Module) -> list[str]:
    return sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()})


def _loss_and_accuracy(proba: np.ndarray, y: torch.Tensor) -> tuple[float, float]:
    """Cross-entropy and accuracy of class probabilities on their last axis
    (``(n, classes)``, or ``(n, seq, vocab)`` for next-token targets ``(n, seq)``)."""
    labels = y.numpy()
    picked = np.take_along_axis(proba, labels[..., None], axis=-1)[..., 0]
    loss = float(-np.log(np.clip(picked, 1e-12, None)).mean())
    return loss, float((proba.argmax(axis=-1) == labels).mean())


def _autocast(cfg: BenchConfig, amp: bool) -> ContextManager[Any]:
    return torch.autocast(cfg.device_type, dtype=cfg.torch_dtype, enabled=amp)


def _raw_predict_proba(
    model: nn.Module, X: torch.Tensor, batch_size: int, cfg: BenchConfig, amp: bool
) -> np.ndarray:
    """What skorch's ``predict_proba`` does, by hand: eval mode, no grad,
    the same iterator, softmax, to numpy, concatenate."""
    model.eval()
    out = []
    with torch.no_grad():
        for Xb, _ in _make_iterator(cfg, Dataset(X), batch_size, False, None):
            Xb = Xb.to(cfg.device)
            with _autocast(cfg, amp):
                logits = model(Xb)
            out.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
    return np.concatenate(out, 0)


def _timed(cfg: BenchConfig, fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync(cfg.device)
    start = time.perf_counter()
    result = fn()
    _sync(cfg.device)
    return time.perf_counter() - start, result


# ---- the raw PyTorch loop ----------------------------------------------------


def _raw_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, nn.Module, torch.optim.Optimizer]:
    """The hand-written loop: zero_grad, forward and loss under autocast,
    (scaled) backward, step. The loss is accumulated as a tensor (no
    per-batch host sync); its mean over the last epoch is the final loss."""
    model = wl.build_module(cfg.seed).to(cfg.device)
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    if contender.fused:
        opt_kwargs["fused"] = True
    optimizer = opt_cls(model.parameters(), **opt_kwargs)
    criterion = wl.criterion()
    scaler = torch.amp.GradScaler(
        cfg.device_type, enabled=contender.amp and cfg.torch_dtype == torch.float16
    )
    dataset = Dataset(data.X, data.y)
    generator = _shuffle_generator(cfg)
    times, final_loss = [], float("nan")
    for _ in range(epochs):
        _sync(cfg.device)
        start = time.perf_counter()
        model.train()
        total = torch.zeros((), device=cfg.device)
        count = 0
        for Xb, yb in _make_iterator(cfg, dataset, wl.batch_size, True, generator):
            Xb, yb = Xb.to(cfg.device), yb.to(cfg.device)
            optimizer.zero_grad(set_to_none=True)
            with _autocast(cfg, contender.amp):
                loss = criterion(model(Xb), yb)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.detach() * len(yb)
            count += len(yb)
        _sync(cfg.device)
        times.append(time.perf_counter() - start)
        final_loss = float(total) / count
    return times, final_loss, model, optimizer


# ---- skorch and AmpNet ------------------------------------------------------


def _make_net(
    contender: Contender, module: nn.Module, wl: Workload, cfg: BenchConfig, **kwargs: Any
) -> NeuralNetClassifier:
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    if contender.fused:
        opt_kwargs["fused"] = True
    params: dict[str, Any] = dict(
        module=module,
        criterion=wl.criterion,
        optimizer=opt_cls,
        lr=opt_kwargs.pop("lr"),
        batch_size=wl.batch_size,
        train_split=None,
        verbose=0,
        device=cfg.device,
        iterator_train=_iterator_class(cfg),
        iterator_valid=_iterator_class(cfg),
        iterator_train__shuffle=True,
        iterator_train__generator=_shuffle_generator(cfg),
        **{f"optimizer__{k}": v for k, v in opt_kwargs.items()},
        **kwargs,
    )
    if contender.framework == "skorch":
        return NeuralNetClassifier(**params)
    if contender.framework == "accelerate":
        return _accelerated_net(cfg, params)
    # AMP settings only where AMP is on (with AMP off they would have no effect); 'auto'
    # measures with the benchmark's dtype and otherwise AmpNet's defaults
    amp = dict(amp_dtype=cfg.dtype, amp_level=contender.level,
               amp_master_weights=contender.master_weights) if contender.amp else {}
    if contender.auto:  # measures in every run: its cache off
        amp = dict(amp_dtype=cfg.dtype, amp_autotune__cache=False)
    if contender.amp_dtype is not None:
        amp["amp_dtype"] = contender.amp_dtype
    if contender.compile:
        amp["compile"] = True
    if contender.monitor:
        from ampnet.callbacks import AmpMonitor

        params["callbacks"] = [*params.get("callbacks", []), AmpMonitor()]
    return AmpNetClassifier(
        amp_enabled="auto" if contender.auto else contender.amp,
        amp_skip_nonfinite=contender.skip_nonfinite, **amp, **params
    )


def _accelerated_net(cfg: BenchConfig, params: dict[str, Any]) -> NeuralNetClassifier:
    """skorch's documented accelerate integration in its default
    configuration: ``AccelerateMixin`` with an ``Accelerator`` that owns the
    device and the mixed precision."""
    from accelerate import Accelerator
    from skorch.hf import AccelerateMixin

    class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
        pass

    mixed = "bf16" if cfg.torch_dtype == torch.bfloat16 else "fp16"
    accelerator = Accelerator(mixed_precision=mixed, cpu=cfg.device_type == "cpu")
    # device: the accelerator places the module; AccelerateMixin gives PrintLog a sink, which
    # makes it print despite verbose=0: a sink that prints nothing (printing only)
    params = {**params, "device": None}
    return AcceleratedNet(accelerator=accelerator, callbacks__print_log__sink=_no_print, **params)


def _no_print(*args: Any, **kwargs: Any) -> None:
    return None


def _state_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    from ampnet.precision import measure_memory

    return measure_memory(module, None, optimizers, "as stored").to_dict()


def _net_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, NeuralNetClassifier]:
    # 'auto' runs as in a fit of cfg.auto_fit_epochs epochs, stopped after the epochs that are timed
    fit_epochs = max(epochs, cfg.auto_fit_epochs) if contender.auto else epochs
    clock = EpochClock(cfg.device, stop_after=epochs if fit_epochs > epochs else None)
    if contender.amp_dtype == "float8":
        _check_float8(cfg, wl)
        try:  # another version of ampnet may not have float8 or compile: reported, not a failure
            net = _make_net(
                contender, wl.build_module(cfg.seed), wl, cfg, max_epochs=fit_epochs, callbacks=[clock]
            ).initialize()
        except (TypeError, ValueError) as exc:
            raise ContenderUnavailable(f"not available in this version: {exc}") from exc
    else:
        net = _make_net(
            contender, wl.build_module(cfg.seed), wl, cfg, max_epochs=fit_epochs, callbacks=[clock]
        )
    net.fit(data.X, data.y)
    return list(clock.epoch_times_), float(net.history[-1, "train_loss"]), net


#: The workloads the float8 contender runs on (matmul-bound transformers).
FLOAT8_WORKLOADS = ("encoder", "decoder")


def float8_unavailable(device: str, workload: str, capability: tuple[int, int] | None = None,
                       torchao: bool | None = None) -> str | None:
    """Why the ``ampnet-float8`` contender cannot run here (None: it can).

    It runs on the encoder and the decoder, on a CUDA device of compute
    capability 8.9 or more, with torchao importable.

    Parameters
    ----------
    device : str
      The benchmark's device.

    workload : str
      The workload's name.

    capability, torchao
      The GPU's compute capability and whether torchao imports; None reads
      them from this machine.

    Returns
    -------
    str or None
      ``'skipped: ...'`` with the reason.
    """
    if workload not in FLOAT8_WORKLOADS:
        return f"skipped: the float8 contender runs on the {' and the '.join(FLOAT8_WORKLOADS)} only"
    if torch.device(device).type != "cuda":
        return "skipped: float8 needs a CUDA device of compute capability >= 8.9 (this run: the CPU)"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 9):
        return (f"skipped: float8 needs compute capability >= 8.9 (this GPU: "
                f"{'.'.join(map(str, capability))})")
    if torchao is None:
        import importlib.util

        torchao = importlib.util.find_spec("torchao") is not None
    if not torchao:
        return "skipped: float8 needs torchao, which is not installed (pip install torchao)"
    return None


def _check_float8(cfg: BenchConfig, wl: Workload) -> None:
    reason = float8_unavailable(cfg.device, wl.name)
    if reason is not None:
        raise ContenderUnavailable(reason)


# ---- the careful loop and the loop that reads the loss each step -----------------


def _careful_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, nn.Module, torch.optim.Optimizer]:
    """:func:`ampnet_bench.careful_loop.careful_train` on the workload."""
    from ampnet_bench.careful_loop import careful_train

    if contender.float32 == "tf32" and cfg.device_type != "cuda":
        raise ContenderUnavailable("skipped: TF32 is a CUDA setting (this run: the CPU)")
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    run = careful_train(
        wl.build_module(cfg.seed), data.X, data.y, batch_size=wl.batch_size, epochs=epochs,
        optimizer_cls=opt_cls, optimizer_kwargs=opt_kwargs, device=cfg.device,
        amp_dtype=cfg.torch_dtype if contender.amp else None, float32=contender.float32,
        criterion=wl.criterion(), seed=cfg.seed + 1,
    )
    return run.epoch_times, run.epoch_losses[-1], run.model, run.optimizer


def _item_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, nn.Module, torch.optim.Optimizer]:
    """The loop most tutorials show: a ``DataLoader`` over a ``TensorDataset``,
    each batch copied to the device, the optimizer as it comes (not fused),
    ``loss.item()`` read each step."""
    model = wl.build_module(cfg.seed).to(cfg.device)
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    optimizer = opt_cls(model.parameters(), **opt_kwargs)
    criterion = wl.criterion()
    scaler = torch.amp.GradScaler(
        cfg.device_type, enabled=contender.amp and cfg.torch_dtype == torch.float16
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.X, data.y), batch_size=wl.batch_size,
                                         shuffle=True, generator=_shuffle_generator(cfg))
    times, final_loss = [], float("nan")
    for _ in range(epochs):
        _sync(cfg.device)
        start = time.perf_counter()
        model.train()
        total, count = 0.0, 0
        for Xb, yb in loader:
            Xb, yb = Xb.to(cfg.device), yb.to(cfg.device)
            optimizer.zero_grad()
            with _autocast(cfg, contender.amp):
                loss = criterion(model(Xb), yb)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.item() * len(yb)
            count += len(yb)
        _sync(cfg.device)
        times.append(time.perf_counter() - start)
        final_loss = total / count
    return times, final_loss, model, optimizer


# ---- Lightning --------------------------------------------------------------


def _lightning_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, nn.Module, list[torch.optim.Optimizer]]:
    """A ``LightningModule`` around the workload's module, trained by a
    ``Trainer`` in its default configuration with ``precision='bf16-mixed'``
    (``'16-mixed'`` for float16) and without logging, checkpoints or progress
    bar; the same batches as every other contender."""
    import lightning as L

    opt_cls, opt_kwargs = cfg.optimizer_spec()
    criterion = wl.criterion()

    class Lit(L.LightningModule):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self.total = torch.zeros(())
            self.count = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            Xb, yb = batch
            loss = criterion(self.module(Xb), yb)
            self.total = self.total.to(loss.device) + loss.detach().float() * len(yb)
            self.count += len(yb)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return opt_cls(self.parameters(), **opt_kwargs)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.final_loss = float("nan")

        def on_train_epoch_start(self, trainer: Any, lit: Any) -> None:
            torch.set_num_threads(cfg.threads)  # as every other contender runs
            lit.total = torch.zeros((), device=lit.device)
            lit.count = 0
            _sync(cfg.device)
            self._start = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, lit: Any) -> None:
            _sync(cfg.device)
            self.times.append(time.perf_counter() - self._start)
            self.final_loss = float(lit.total) / max(lit.count, 1)

    lit, clock = Lit(wl.build_module(cfg.seed)), Clock()
    precision = "bf16-mixed" if cfg.torch_dtype == torch.bfloat16 else "16-mixed"
    trainer = L.Trainer(
        accelerator="gpu" if cfg.device_type == "cuda" else "cpu", devices=1,
        precision=precision, max_epochs=epochs, callbacks=[clock], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    loader = _make_iterator(cfg, Dataset(data.X, data.y), wl.batch_size, True,
                            _shuffle_generator(cfg))
    trainer.fit(lit, train_dataloaders=loader)
    return clock.times, clock.final_loss, lit.module, list(trainer.optimizers)


#: The contenders that train with a hand-written loop or Lightning, by framework.
_LOOPS: "MappingProxyType[str, Callable[..., Any]]" = MappingProxyType(
    {"raw": _raw_train, "careful": _careful_train, "item": _item_train, "lightning": _lightning_train})


# ---- entry points ---------------------------------------------------------------


def train_reference_weights(wl: Workload, data: Data, cfg: BenchConfig) -> dict[str, torch.Tensor]:
    """Weights for ``predict`` workloads: one float32 epoch of the raw loop
    (not timed), so that the predictions are meaningful."""
    model = _raw_train(CONTENDERS[0], wl, data, cfg, epochs=1)[2]
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def run_contender(
    contender: Contender,
    wl: Workload,
    data: Data,
    cfg: BenchConfig,
    weights: dict[str, torch.Tensor] | None = None,
    meter: ContextManager[Any] | None = None,
    caught: list[warnings.WarningMessage] | None = None,
) -> RunOutcome:
    """Run one contender once on one workload.

    Parameters
    ----------
    contender : Contender
      Who runs.

    wl : Workload
      What runs.

    data : Data
      The workload's pre-generated tensors.

    cfg : BenchConfig
      Epochs, warm-up, device, dtype, optimizer, batching.

    weights : dict or None
      Module weights for ``predict`` workloads (see
      :func:`train_reference_weights`).

    meter : context manager or None
      Entered around model construction and the timed epochs (not the
      evaluation); used for memory measurement.

    caught : list or None
      Receives every warning of the run as recorded (file and line
      included): the run records its warnings itself, so that an outer
      ``warnings.catch_warnings`` sees none of them.

    Returns
    -------
    RunOutcome
    """
    meter = meter if meter is not None else contextlib.nullcontext()
    n_epochs = cfg.warmup + cfg.epochs
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        if wl.task == "predict":
            with meter:
                predict, module = _predictor(contender, wl, cfg, weights)
                times, proba = [], None
                for _ in range(n_epochs):
                    seconds, proba = _timed(cfg, lambda: predict(data.X))
                    times.append(seconds)
            loss, accuracy = _loss_and_accuracy(proba, data.y)
        else:
            with meter:
                if contender.framework in _LOOPS:
                    train = _LOOPS[contender.framework]
                    times, loss, module, optimizers = train(contender, wl, data, cfg, n_epochs)
                    module = module.to(cfg.device)
                    state = _state_bytes(module, optimizers if isinstance(optimizers, list)
                                         else [optimizers])
                else:
                    times, loss, net = _net_train(contender, wl, data, cfg, n_epochs)
                    module = net.module_
                    state = (net.memory_report().to_dict() if contender.framework == "ampnet"
                             else _state_bytes(module, [net.optimizer_]))
            if contender.framework in _LOOPS:
                proba = _raw_predict_proba(module, data.X_eval, wl.batch_size, cfg, contender.amp)
            else:
                proba = net.predict_proba(data.X_eval)
            accuracy = _loss_and_accuracy(proba, data.y_eval)[1]
    if caught is not None:
        caught.extend(recorded)
    messages = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in recorded))
    measured = times[cfg.warmup :]
    auto_choice = None
    if contender.auto and wl.task != "predict":
        result = net.amp_autotune_
        auto_choice = {"chosen": str(getattr(result, "chosen", result.params)),
                       "params": {k: _plain(v) for k, v in result.params.items()},
                       "cost_s": float(result.cost_s)}
        if measured:
            # it measured in the first (untimed) epoch: that cost, spread over the measured epochs
            measured = [t + result.cost_s / len(measured) for t in measured]
    return RunOutcome(
        epoch_times=measured,
        final_loss=loss,
        accuracy=accuracy,
        param_dtypes=_param_dtypes(module),
        warnings=messages,
        state_bytes=None if wl.task == "predict" else state,
        auto_choice=auto_choice,
    )


def _plain(value: Any) -> Any:
    """A JSON-friendly form of an AMP parameter's value (dtypes and other objects as text)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def _predictor(
    contender: Contender, wl: Workload, cfg: BenchConfig, weights: dict[str, torch.Tensor] | None
) -> tuple[Callable[[torch.Tensor], np.ndarray], nn.Module]:
    if contender.framework == "lightning":
        raise NotImplementedError("the Lightning contender times training only")
    module = wl.build_module(cfg.seed)
    if weights is not None:
        module.load_state_dict(weights)
    if contender.framework in ("raw", "careful", "item"):
        module = module.to(cfg.device)
        return (
            lambda X: _raw_predict_proba(module, X, wl.batch_size, cfg, contender.amp),
            module,
        )
    net = _make_net(contender, module, wl, cfg).initialize()
    return net.predict_proba, net.module_
