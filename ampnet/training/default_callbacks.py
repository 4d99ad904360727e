"""skorch's default callbacks as an AmpNet's history needs them:
``train_loss`` without the batches whose step was skipped, and a
``PrintLog`` that builds no table it would not print."""

from __future__ import annotations

from typing import Any

import numpy as np
from skorch.callbacks import PassthroughScoring, PrintLog

__all__ = ["TrainLoss", "QuietPrintLog", "default_callbacks"]


class TrainLoss(PassthroughScoring):
    """skorch's ``train_loss`` callback (``PassthroughScoring``): the
    epoch's ``train_loss`` is the mean of the batches' ``train_loss``
    weighted by ``train_batch_size``, over the batches whose optimizer step
    was applied.

    A batch whose step was skipped (non-finite gradients: ``step_skipped``,
    with its ``skip_cause``; with gradient accumulation every micro-batch of
    the group; with several optimizers, where none of them stepped) keeps
    its own ``train_loss`` in its batch record and is left out of the mean,
    so that one non-finite batch does not make the epoch's loss NaN; the
    epoch's ``skipped_steps`` counts the skipped steps. An epoch without
    skipped steps, and one without an applied step, get skorch's
    computation (the mean over all its batches), to the bit.
    """

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        state = net.__dict__.get("amp_step_state_") if self.on_train else None
        left_out = frozenset(state.skipped_rows) if state is not None else frozenset()
        history = net.history
        rows = [row for i, row in enumerate(history[-1].get("batches") or [])
                if i not in left_out and self.name in row] if left_out else []
        if not rows:  # no step skipped, or none applied: skorch's own computation
            super().on_epoch_end(net, **kwargs)
            return
        score = np.average([row[self.name] for row in rows], weights=[row["train_batch_size"] for row in rows])
        is_best = self._is_best_score(score)
        if is_best:
            self.best_score_ = score
        history.record(self.name, score)
        if is_best is not None:
            history.record(self.name + "_best", bool(is_best))


class QuietPrintLog(PrintLog):
    """skorch's ``PrintLog``, which with ``verbose=0`` and its ``sink`` left
    at ``print`` prints nothing: then it does not build the table it would
    not print (a few hundred Python calls an epoch), and otherwise is skorch's."""

    def on_epoch_end(self, net: Any, **kwargs: Any) -> None:
        if self.sink is print and not net.verbose:
            self.first_iteration_ = False  # as after skorch's silent first epoch
            return
        super().on_epoch_end(net, **kwargs)


def default_callbacks(callbacks: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """skorch's default callbacks, with :class:`TrainLoss` as ``train_loss``
    and :class:`QuietPrintLog` as ``print_log``."""
    out = []
    for name, cb in callbacks:
        if name == "train_loss" and type(cb) is PassthroughScoring:
            cb = TrainLoss(name="train_loss", on_train=True)
        elif name == "print_log" and type(cb) is PrintLog:
            cb = QuietPrintLog()
        out.append((name, cb))
    return out
