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
    "CONTENDERS",
    "CONTENDER_KEYS",
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
      ``'raw'`` (hand-written loop), ``'skorch'`` or ``'ampnet'``.

    amp : bool
      Whether automatic mixed precision is on.

    level : str
      AmpNet's ``amp_level`` (``'mixed'`` or ``'pure'``).

    master_weights : bool
      AmpNet's ``amp_master_weights`` (only matters in ``'pure'``).

    skip_nonfinite : bool
      AmpNet's ``amp_skip_nonfinite`` (the non-finite gradient guard).
    """

    key: str
    label: str
    framework: str
    amp: bool
    level: str = "mixed"
    master_weights: bool = True
    skip_nonfinite: bool = True


#: All contenders, in the order they run within a round.
CONTENDERS: tuple[Contender, ...] = (
    Contender("raw-fp32", "PyTorch loop, float32", "raw", False),
    Contender("raw-amp", "PyTorch loop, autocast", "raw", True),
    Contender("skorch-fp32", "skorch NeuralNetClassifier, float32", "skorch", False),
    Contender("ampnet-fp32", "AmpNet, amp_enabled=False", "ampnet", False),
    Contender("ampnet-mixed", "AmpNet, amp_level='mixed'", "ampnet", True, "mixed"),
    Contender("ampnet-mixed-noguard", "AmpNet, amp_level='mixed', amp_skip_nonfinite=False",
              "ampnet", True, "mixed", skip_nonfinite=False),
    Contender("ampnet-pure", "AmpNet, amp_level='pure'", "ampnet", True, "pure"),
    Contender("ampnet-pure-nomw", "AmpNet, amp_level='pure', amp_master_weights=False", "ampnet",
              True, "pure", False),
)

#: Keys of :data:`CONTENDERS`.
CONTENDER_KEYS: tuple[str, ...] = tuple(c.key for c in CONTENDERS)


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
    """

    epoch_times: list[float]
    final_loss: float
    accuracy: float
    param_dtypes: list[str]
    warnings: list[str] = field(default_factory=list)


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

    Attributes
    ----------
    epoch_times_ : list of float
      Seconds per epoch, from ``on_epoch_begin`` to ``on_epoch_end``.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

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
    labels = y.numpy()
    picked = proba[np.arange(len(labels)), labels]
    loss = float(-np.log(np.clip(picked, 1e-12, None)).mean())
    return loss, float((proba.argmax(axis=1) == labels).mean())


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
) -> tuple[list[float], float, nn.Module]:
    """The hand-written loop: zero_grad, forward and loss under autocast,
    (scaled) backward, step. The loss is accumulated as a tensor (no
    per-batch host sync); its mean over the last epoch is the final loss."""
    model = wl.build_module(cfg.seed).to(cfg.device)
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    optimizer = opt_cls(model.parameters(), **opt_kwargs)
    criterion = nn.CrossEntropyLoss()
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
    return times, final_loss, model


# ---- skorch and AmpNet ------------------------------------------------------


def _make_net(
    contender: Contender, module: nn.Module, wl: Workload, cfg: BenchConfig, **kwargs: Any
) -> NeuralNetClassifier:
    opt_cls, opt_kwargs = cfg.optimizer_spec()
    params: dict[str, Any] = dict(
        module=module,
        criterion=nn.CrossEntropyLoss,
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
    # AMP settings only where AMP is on (with AMP off they would have no effect)
    amp = dict(amp_dtype=cfg.dtype, amp_level=contender.level,
               amp_master_weights=contender.master_weights) if contender.amp else {}
    return AmpNetClassifier(
        amp_enabled=contender.amp, amp_skip_nonfinite=contender.skip_nonfinite, **amp, **params
    )


def _net_train(
    contender: Contender, wl: Workload, data: Data, cfg: BenchConfig, epochs: int
) -> tuple[list[float], float, NeuralNetClassifier]:
    clock = EpochClock(cfg.device)
    net = _make_net(
        contender, wl.build_module(cfg.seed), wl, cfg, max_epochs=epochs, callbacks=[clock]
    )
    net.fit(data.X, data.y)
    return list(clock.epoch_times_), float(net.history[-1, "train_loss"]), net


# ---- entry points ---------------------------------------------------------------


def train_reference_weights(wl: Workload, data: Data, cfg: BenchConfig) -> dict[str, torch.Tensor]:
    """Weights for ``predict`` workloads: one float32 epoch of the raw loop
    (not timed), so that the predictions are meaningful."""
    _, _, model = _raw_train(CONTENDERS[0], wl, data, cfg, epochs=1)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def run_contender(
    contender: Contender,
    wl: Workload,
    data: Data,
    cfg: BenchConfig,
    weights: dict[str, torch.Tensor] | None = None,
    meter: ContextManager[Any] | None = None,
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

    Returns
    -------
    RunOutcome
    """
    meter = meter if meter is not None else contextlib.nullcontext()
    n_epochs = cfg.warmup + cfg.epochs
    with warnings.catch_warnings(record=True) as caught:
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
                if contender.framework == "raw":
                    times, loss, model = _raw_train(contender, wl, data, cfg, n_epochs)
                    module = model
                else:
                    times, loss, net = _net_train(contender, wl, data, cfg, n_epochs)
                    module = net.module_
            if contender.framework == "raw":
                proba = _raw_predict_proba(model, data.X_eval, wl.batch_size, cfg, contender.amp)
            else:
                proba = net.predict_proba(data.X_eval)
            accuracy = _loss_and_accuracy(proba, data.y_eval)[1]
    messages = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return RunOutcome(
        epoch_times=times[cfg.warmup :],
        final_loss=loss,
        accuracy=accuracy,
        param_dtypes=_param_dtypes(module),
        warnings=messages,
    )


def _predictor(
    contender: Contender, wl: Workload, cfg: BenchConfig, weights: dict[str, torch.Tensor] | None
) -> tuple[Callable[[torch.Tensor], np.ndarray], nn.Module]:
    module = wl.build_module(cfg.seed)
    if weights is not None:
        module.load_state_dict(weights)
    if contender.framework == "raw":
        module = module.to(cfg.device)
        return (
            lambda X: _raw_predict_proba(module, X, wl.batch_size, cfg, contender.amp),
            module,
        )
    net = _make_net(contender, module, wl, cfg).initialize()
    return net.predict_proba, net.module_
