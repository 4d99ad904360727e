"""``Checkpoint``, ``TrainEndCheckpoint`` and ``LoadInitState``: drop-in
replacements for skorch's that also save and restore the loss-scaler state
and the RNG states, write crash-safe, and resume exactly.

>>> from ampnet.callbacks.checkpoint import Checkpoint, LoadInitState
>>> cp = Checkpoint(monitor=None, dirname="run1")
>>> net = AmpNetClassifier(MyModule, amp_enabled=True, amp_dtype="float16", max_epochs=20,
...                        callbacks=[LoadInitState(cp, resume="total"), LRScheduler(...), cp])
>>> net.fit(X, y)  # run it again after a crash: it finishes the 20 epochs

Put the Checkpoint after every callback that records into the history or
steps a learning-rate scheduler at the end of an epoch (last is simplest),
so that it saves the state of the finished epoch.
"""

from __future__ import annotations

import copy
import os
from numbers import Real
from typing import Any, Callable

from skorch.callbacks import LRScheduler
from skorch.callbacks import Checkpoint as SkorchCheckpoint
from skorch.callbacks import LoadInitState as SkorchLoadInitState
from skorch.callbacks import TrainEndCheckpoint as SkorchTrainEndCheckpoint
from skorch.utils import noop

from ampnet.exceptions import amp_warn
from ampnet.io.atomic import is_path
from ampnet.io.lock import REFRESH_EVERY_S, DirectoryLock
from ampnet.io.persistence import PersistenceMixin, checkpoint_files, resolve_checkpoint
from ampnet.io.schedulers import (
    check_lr_scheduler_states,
    read_lr_scheduler_states,
    restore_lr_schedulers,
)

__all__ = ["Checkpoint", "TrainEndCheckpoint", "LoadInitState", "RESUME_MODES", "epochs_to_run"]

#: Accepted values of ``LoadInitState(resume=...)``.
RESUME_MODES = ("more", "total")

_AMPNET_FILES_DOC = """
    f_grad_scaler : file-like object, str, None (default='grad_scaler.pt')
      File of the loss-scaler state (scale, growth tracker). Pass ``None``
      to not save it. Supports the same format specifiers as ``f_params``.

    f_rng_state : file-like object, str, None (default='rng_state.pt')
      File of the global RNG states (torch, CUDA where used, numpy,
      ``random``), restored on resume so that shuffling and dropout continue
      as in an uninterrupted run. Pass ``None`` to not save it.

    f_lr_schedulers : file-like object, str, None (default='lr_schedulers.json')
      File of the state of the ``LRScheduler`` callbacks (JSON), restored
      by :class:`LoadInitState` so that the schedule continues exactly.
      Pass ``None`` to not save it.
"""


def _document(intro: str, skorch_doc: str | None) -> str:
    """``intro`` followed by skorch's parameter section, with ampnet's files."""
    marker = "    Parameters\n    ----------"
    if not skorch_doc or marker not in skorch_doc:
        return intro
    params = marker + skorch_doc.split(marker, 1)[1]
    return intro + "\n" + params.replace(
        "    f_pickle :", _AMPNET_FILES_DOC.lstrip("\n") + "\n    f_pickle :", 1
    )


def _check_net(net: Any, owner: str) -> None:
    if not isinstance(net, PersistenceMixin):
        raise TypeError(
            f"ampnet.callbacks.checkpoint.{owner} saves the loss-scaler and RNG states and needs an "
            f"ampnet net (AmpNet, AmpNetClassifier, ...); got {type(net).__name__}. Fix: "
            f"use skorch.callbacks.{owner} for a plain skorch net."
        )


class Checkpoint(SkorchCheckpoint):
    __doc__ = _document(
        "skorch's :class:`skorch.callbacks.Checkpoint` that also saves the loss-scaler\n"
        "    and RNG states, and writes every checkpoint crash-safe: a process killed\n"
        "    during a save leaves the previous checkpoint whole (see\n"
        "    :meth:`ampnet.AmpNetMixin.save_params`). Errors while saving are raised, not\n"
        "    sent to ``sink``. With ``load_best=True`` the best checkpoint is loaded\n"
        "    without its RNG state, so that code after ``fit`` draws fresh numbers.\n",
        SkorchCheckpoint.__doc__,
    )

    def __init__(
        self,
        monitor: str | Callable[[Any], bool] | None = "valid_loss_best",
        f_params: Any = "params.pt",
        f_optimizer: Any = "optimizer.pt",
        f_criterion: Any = "criterion.pt",
        f_history: Any = "history.json",
        f_grad_scaler: Any = "grad_scaler.pt",
        f_rng_state: Any = "rng_state.pt",
        f_lr_schedulers: Any = "lr_schedulers.json",
        f_pickle: Any = None,
        fn_prefix: str = "",
        dirname: str = "",
        event_name: str | None = "event_cp",
        sink: Callable[..., Any] = noop,
        load_best: bool = False,
        use_safetensors: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            monitor=monitor, f_params=f_params, f_optimizer=f_optimizer,
            f_criterion=f_criterion, f_history=f_history, f_pickle=f_pickle,
            fn_prefix=fn_prefix, dirname=dirname, event_name=event_name, sink=sink,
            load_best=load_best, use_safetensors=use_safetensors,
            f_grad_scaler=f_grad_scaler, f_rng_state=f_rng_state,
            f_lr_schedulers=f_lr_schedulers, **kwargs,
        )

    def on_train_begin(self, net: Any, **kwargs: Any) -> None:
        _check_net(net, type(self).__name__)
        self._lock_directory()
        later = _epoch_schedulers_after(net, self)
        if later and (self.f_optimizer is not None or self.f_lr_schedulers is not None):
            amp_warn(
                f"LRScheduler {later} comes after this Checkpoint in callbacks, so each "
                "checkpoint holds the learning rate from before the epoch's scheduler step "
                "and a resumed run would be one step behind. Fix: put the Checkpoint after "
                "the LRScheduler (last in callbacks).",
            )

    def save_model(self, net: Any) -> None:
        """Save all files of this checkpoint in one crash-safe group."""
        _check_net(net, type(self).__name__)
        files = {
            key: self._format_target(net, val, -1)
            for key, val in self._f_kwargs().items()
            if val is not None and key != "f_history"
        }
        if self.f_history is not None:
            files["f_history"] = self.f_history_
        net.save_params(**files, use_safetensors=self.use_safetensors)

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        try:
            if not self.load_best or self.monitor is None:
                return
            self._sink("Loading best checkpoint after training.", net.verbose)
            without_rng = copy.copy(self)
            without_rng.f_rng_state = None
            without_rng.__dict__.pop("fit_lock_", None)
            net.load_params(checkpoint=without_rng, use_safetensors=self.use_safetensors)
        finally:
            self._unlock_directory()

    def on_batch_end(self, net: Any, **kwargs: Any) -> None:
        lock = self.__dict__.get("fit_lock_")
        if lock is not None:
            lock.refresh(every=REFRESH_EVERY_S)  # live for other hosts during long epochs

    def _lock_directory(self) -> None:
        """Take the lock of ``dirname`` for the fit (see :mod:`ampnet.io.lock`):
        a second run that shares the folder is refused here, before it
        trains, with :class:`ampnet.exceptions.DirectoryLockedError`. A lock
        this callback still holds (a fit that raised: skorch skips
        ``on_train_end`` then) is kept."""
        lock = self.__dict__.get("fit_lock_")
        if lock is not None and lock.held:
            lock.refresh()
            return
        directory = os.path.realpath(self.dirname or ".")
        os.makedirs(directory, exist_ok=True)
        self.fit_lock_ = DirectoryLock(directory, scope="fit").acquire()

    def _unlock_directory(self) -> None:
        lock = self.__dict__.pop("fit_lock_", None)
        if lock is not None:
            lock.release()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("fit_lock_", None)  # a copy (pickle, clone) holds no lock
        return state


class TrainEndCheckpoint(SkorchTrainEndCheckpoint):
    __doc__ = _document(
        "skorch's :class:`skorch.callbacks.TrainEndCheckpoint` that also saves the\n"
        "    loss-scaler and RNG states, crash-safe (see :class:`Checkpoint`).\n",
        SkorchTrainEndCheckpoint.__doc__,
    )

    def __init__(
        self,
        f_params: Any = "params.pt",
        f_optimizer: Any = "optimizer.pt",
        f_criterion: Any = "criterion.pt",
        f_history: Any = "history.json",
        f_grad_scaler: Any = "grad_scaler.pt",
        f_rng_state: Any = "rng_state.pt",
        f_lr_schedulers: Any = "lr_schedulers.json",
        f_pickle: Any = None,
        fn_prefix: str = "train_end_",
        dirname: str = "",
        use_safetensors: bool = False,
        sink: Callable[..., Any] = noop,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            f_params=f_params, f_optimizer=f_optimizer, f_criterion=f_criterion,
            f_history=f_history, f_pickle=f_pickle, fn_prefix=fn_prefix, dirname=dirname,
            use_safetensors=use_safetensors, sink=sink, f_grad_scaler=f_grad_scaler,
            f_rng_state=f_rng_state, f_lr_schedulers=f_lr_schedulers, **kwargs,
        )

    def initialize(self) -> "TrainEndCheckpoint":
        self.checkpoint_ = Checkpoint(
            monitor=None,
            fn_prefix=self.fn_prefix,
            dirname=self.dirname,
            event_name=None,
            sink=self.sink,
            use_safetensors=self.use_safetensors,
            **self._f_kwargs(),
        )
        self.checkpoint_.initialize()
        return self


class LoadInitState(SkorchLoadInitState):
    """skorch's :class:`skorch.callbacks.LoadInitState` for exact resume.

    At the start of the first ``fit``, if the checkpoint exists, it loads
    every file of it (parameters, optimizer, criterion, history, loss
    scaler, RNG states) after checking them all; a checkpoint that a killed
    process left half-written is completed or ignored as a whole first.
    It sets the best scores of the scoring callbacks from the loaded
    history, so that ``*_best`` flags continue as without interruption.
    When the first epoch begins, after every callback has started (skorch's
    ``LRScheduler`` rebuilds its scheduler in ``on_train_begin``), it
    restores the saved scheduler states and the optimizers' learning rates.

    A missing checkpoint (first run) loads nothing. A checkpoint without
    the scaler, RNG or scheduler file (written by skorch or an older
    ampnet) loads with an :class:`.AmpWarning`; any other missing or invalid
    file raises, and the net is left unchanged.

    Parameters
    ----------
    checkpoint : :class:`Checkpoint` or :class:`TrainEndCheckpoint`
      Checkpoint to get the file names from.

    use_safetensors : bool (default=False)
      Whether the checkpoint was saved with safetensors.

    resume : str (default='more')
      How many epochs the ``fit`` that loads a checkpoint trains.
      ``'more'`` (skorch's behaviour): ``max_epochs`` more, so a rerun of
      a script whose checkpoint holds 3 epochs ends with 3 + ``max_epochs``.
      ``'total'``: until the history holds ``max_epochs`` epochs, so rerunning
      the same script after a crash finishes the run; when the checkpoint
      already holds ``max_epochs`` epochs or more, the fit trains none and
      returns. Without a checkpoint (a first run) both train ``max_epochs``.

    Attributes
    ----------
    epochs_left_ : int or None
      With ``resume='total'``, during the ``fit`` that loaded a checkpoint:
      the epochs it trains; otherwise None.
    """

    def __init__(self, checkpoint: Any, use_safetensors: bool = False, resume: str = "more") -> None:
        super().__init__(checkpoint, use_safetensors=use_safetensors)
        self.resume = resume

    def initialize(self) -> "LoadInitState":
        if self.resume not in RESUME_MODES:
            raise ValueError(
                f"LoadInitState resume must be one of {', '.join(map(repr, RESUME_MODES))}; got "
                f"{self.resume!r} ({type(self.resume).__name__}). Fix: resume='total' to train "
                "until max_epochs epochs in all (a rerun finishes the run), or resume='more' "
                "(skorch's behaviour) to train max_epochs more epochs after loading."
            )
        super().initialize()
        self.pending_ = None
        self.epochs_left_ = None
        return self

    def on_train_begin(self, net: Any, X: Any = None, y: Any = None, **kwargs: Any) -> None:
        self.epochs_left_ = None
        if self.did_load_:
            return
        self.did_load_ = True
        checkpoint = resolve_checkpoint(self.checkpoint)
        files = checkpoint_files(checkpoint, net)
        if not any(
            not is_path(v) or os.path.exists(v)
            for k, v in files.items()
            if v is not None and k != "f_pickle"
        ):
            return  # nothing saved yet: a first run
        schedulers = None
        target = files.get("f_lr_schedulers")
        if target is not None and (not is_path(target) or os.path.exists(target)):
            # read and checked before anything loads; restored once the
            # schedulers exist (on_epoch_begin)
            source = f"f_lr_schedulers file {target!r}"
            schedulers = (read_lr_scheduler_states(target, source), source)
            check_lr_scheduler_states(net, *schedulers)
            checkpoint = copy.copy(checkpoint)
            checkpoint.f_lr_schedulers = None
        net.load_params(checkpoint=checkpoint, use_safetensors=self.use_safetensors)
        if any(isinstance(cb, LRScheduler) for _, cb in net.callbacks_):
            # skorch rebuilds the schedulers as resumed (last_epoch >= 0), which
            # torch allows only with 'initial_lr' in every group; a checkpoint
            # saved without a scheduler lacks it: start from the loaded lr
            for name in net._optimizers:
                for group in getattr(net, name + "_").param_groups:
                    group.setdefault("initial_lr", group["lr"])
        _restore_best_scores(net)
        if self.resume == "total":
            done = len(net.history)
            self.epochs_left_ = max(0, net.max_epochs - done)
            if net.verbose:
                print(
                    f"Resumed from a checkpoint with {done} epoch(s); training "
                    f"{self.epochs_left_} more to reach max_epochs={net.max_epochs}."
                )
        groups = {
            name: [
                {k: v for k, v in group.items() if k != "params"}
                for group in getattr(net, name + "_").param_groups
            ]
            for name in net._optimizers
        }
        self.pending_ = (groups, schedulers)

    def on_epoch_begin(self, net: Any, **kwargs: Any) -> None:
        self._restore_pending(net)

    def on_train_end(self, net: Any, **kwargs: Any) -> None:
        # a fit that trained no epoch (resume='total' on a finished run)
        # leaves the loaded state as it was saved
        self._restore_pending(net)
        self.epochs_left_ = None

    def _restore_pending(self, net: Any) -> None:
        if self.pending_ is None:
            return
        groups, schedulers = self.pending_
        self.pending_ = None
        # a scheduler built in on_train_begin may have changed the loaded
        # learning rates (torch steps a scheduler once when it is built)
        for name, saved in groups.items():
            for group, values in zip(getattr(net, name + "_").param_groups, saved):
                group.update(values)
        if schedulers is not None:
            notes = restore_lr_schedulers(net, *schedulers)
            if notes:
                amp_warn(
                    "Learning-rate schedulers not restored: " + "; ".join(notes) + ".",
                )


def epochs_to_run(net: Any) -> int:
    """The epochs a ``fit_loop`` without an explicit ``epochs`` trains:
    what a :class:`LoadInitState` with ``resume='total'`` left, else
    ``net.max_epochs``."""
    left = [
        cb.epochs_left_ for _, cb in getattr(net, "callbacks_", [])
        if isinstance(cb, LoadInitState) and getattr(cb, "epochs_left_", None) is not None
    ]
    return min(left) if left else net.max_epochs


def _epoch_schedulers_after(net: Any, checkpoint: Any) -> list[str]:
    """Names of epoch-stepping LRScheduler callbacks placed after ``checkpoint``."""
    names, seen = [], False
    for name, cb in net.callbacks_:
        if cb is checkpoint:
            seen = True
        elif seen and isinstance(cb, LRScheduler) and cb.step_every == "epoch":
            names.append(name)
    return names


def _restore_best_scores(net: Any) -> None:
    """Set ``best_score_`` of scoring callbacks from the loaded history
    (skorch's PassthroughScoring never does, and EpochScoring did it before
    the history was loaded)."""
    for _, cb in net.callbacks_:
        if not (hasattr(cb, "best_score_") and hasattr(cb, "lower_is_better")):
            continue
        name = getattr(cb, "name_", None) or getattr(cb, "name", None)
        if not isinstance(name, str):
            continue
        for row in reversed(net.history):
            score = row.get(name)
            if row.get(f"{name}_best") is True and isinstance(score, Real) and not isinstance(score, bool):
                cb.best_score_ = score
                break
