"""Callbacks that make the loss scale and skipped steps visible."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from skorch.callbacks import Callback, TensorBoard

from ampnet.diagnostics.flight import FlightRecorder
from ampnet.training.step import SKIP_CAUSES

__all__ = ["AmpMonitor"]


class AmpMonitor(Callback):
    """Report loss-scale changes and bursts of skipped steps, and record
    why steps were skipped, gradient norms and lost updates.

    Reads what an ampnet net records per batch (``loss_scale``,
    ``step_skipped``, ``skip_cause``) and switches on the net's flight
    recorder (``ampnet.diagnostics.flight``) for the fit. A good step pays no host
    read for it: the per-epoch values stay on the device until the epoch
    ends and are read back once; only skipped steps are replayed.

    Columns it adds to the history, per epoch:

    - ``scale_changes``: how often the loss scale moved;
    - ``max_skip_burst``: the longest run of skipped steps;
    - ``grad_norm``: the mean over the epoch's applied optimizer steps of the
      global L2 norm of the unscaled gradients, before clipping (what a
      ``GradientNormClipping`` callback sees); NaN if no step was applied;
    - ``lost_updates`` (``amp_level='pure'`` only): the share of parameter
      elements with a non-zero gradient whose update was lost to rounding
      (estimated on a sample of each parameter; close to 0 with float32
      master weights or ``'compensated'``, where only updates below their
      resolution are lost). NaN if no step was applied.

    and per skipped batch (besides ``step_skipped`` and ``skip_cause``,
    which the net records with or without this callback):

    - ``first_nonfinite``: the name (as in ``module.named_modules()``) of the
      first module whose activations or gradients went non-finite, found by
      replaying the batch on a copy of the module (see
      ``ampnet.diagnostics.diagnosis``); None if the replay stayed finite. Not
      recorded for bad data (``skip_cause='nonfinite_input'``) nor beyond
      ``max_replays`` skipped steps per epoch. The skips of the loss
      scale's settling (``'overflow'`` skips while a fresh scaler's scale
      falls from ``init_scale``, before the fit's first applied step) are
      replayed without counting against ``max_replays``.

    :class:`skorch.callbacks.PrintLog` and :class:`skorch.callbacks.TensorBoard`
    show the epoch columns. If the net has a ``TensorBoard`` callback, its
    writer also gets ``amp/loss_scale`` and ``amp/step_skipped`` per step,
    and ``amp/grad_norm``, ``amp/lost_updates`` and ``amp/skipped/<cause>``
    per epoch. :func:`ampnet.plot_precision` draws them all.

    Parameters
    ----------
    burst : int (default=3)
      A run of at least this many skipped steps in a row is reported
      through ``sink`` when it ends (or when the epoch ends).

    report_scale_changes : bool (default=False)
      Whether to report every change of the scale through ``sink`` (off by
      default: with a small ``growth_interval`` it is chatty).

    sink : callable (default=print)
      Where the reports go, e.g. ``print`` or ``logging.getLogger().info``.

    max_replays : int (default=3)
      At most this many skipped steps per epoch are replayed to find
      ``first_nonfinite``, besides those of the loss scale's settling at
      the start of a fit (at most about log2(init_scale / min_scale)
      times the scaler's ``hysteresis``); each replay costs about one
      training step and memory for a copy of the module while it runs. 0
      turns the replay off, the settling's included.

    Attributes
    ----------
    events_ : list of dict
      Every reported event: ``{'epoch', 'batch', 'kind', 'value'}`` with
      kind ``'scale'`` (value: the new scale) or ``'burst'`` (value: the
      number of skipped steps in the run).
    """

    def __init__(
        self,
        burst: int = 3,
        report_scale_changes: bool = False,
        sink: Callable[[str], Any] = print,
        max_replays: int = 3,
    ) -> None:
        self.burst = burst
        self.report_scale_changes = report_scale_changes
        self.sink = sink
        self.max_replays = max_replays

    def initialize(self) -> "AmpMonitor":
        if not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError(f"burst must be an int >= 1; got {self.burst!r}.")
        if not (isinstance(self.max_replays, int) and not isinstance(self.max_replays, bool)
                and self.max_replays >= 0):
            raise ValueError(
                f"max_replays must be an int >= 0; got {self.max_replays!r} "
                f"({type(self.max_replays).__name__}). Fix: e.g. max_replays=3, or 0 for no replay.")
        self.events_: list[dict[str, Any]] = []
        self.last_scale_: float | None = None
        self.run_: int = 0
        self.global_step_: int = 0
        return self

    def on_train_begin(self, net, **kwargs) -> None:
        state = getattr(net, "amp_step_state_", None)
        if state is not None and state.recorder is None:
            prec = net.precision_
            pure = prec.enabled and prec.policy.level == "pure"
            state.recorder = FlightRecorder(lost_updates=pure, max_replays=self.max_replays)

    def on_train_end(self, net, **kwargs) -> None:
        state = getattr(net, "amp_step_state_", None)
        if state is not None:
            state.recorder = None

    def on_epoch_begin(self, net, **kwargs) -> None:
        self.changes_ = 0
        self.max_run_ = 0
        recorder = _recorder(net)
        if recorder is not None:
            recorder.begin_epoch()

    def _event(self, net, kind: str, value: Any, text: str) -> None:
        epoch = len(net.history)
        batch = len(net.history[-1, "batches"])
        self.events_.append({"epoch": epoch, "batch": batch, "kind": kind, "value": value})
        self.sink(f"[ampnet] epoch {epoch}, batch {batch}: {text}")

    def _end_run(self, net) -> None:
        if self.run_ >= self.burst:
            self._event(net, "burst", self.run_, f"{self.run_} optimizer steps in a row were skipped (non-finite gradients)")
        self.run_ = 0

    def on_batch_end(self, net, batch=None, training=False, **kwargs) -> None:
        if not training:
            return
        row = net.history[-1, "batches", -1]
        state = getattr(net, "amp_step_state_", None)
        if state is None or (not state.stepped_batch and not row.get("step_skipped", False)):
            return  # not an ampnet net, or a micro-batch inside an accumulation group: no step
        self.global_step_ += 1
        skipped = bool(row.get("step_skipped", False))
        scale = row.get("loss_scale")
        if skipped:
            self.run_ += 1
            self.max_run_ = max(self.max_run_, self.run_)
        else:
            self._end_run(net)
        if scale is not None and self.last_scale_ is not None and scale != self.last_scale_:
            self.changes_ += 1
            if self.report_scale_changes:
                self._event(net, "scale", scale, f"loss scale {self.last_scale_:g} -> {scale:g}")
        if scale is not None:
            self.last_scale_ = scale
        for _, cb in net.callbacks_:
            if isinstance(cb, TensorBoard):
                if scale is not None:
                    cb.writer.add_scalar("amp/loss_scale", scale, self.global_step_)
                cb.writer.add_scalar("amp/step_skipped", float(skipped), self.global_step_)

    def on_epoch_end(self, net, **kwargs) -> None:
        self._end_run(net)
        net.history.record("scale_changes", self.changes_)
        net.history.record("max_skip_burst", self.max_run_)
        recorder = _recorder(net)
        if recorder is None:
            return
        values = recorder.end_epoch()
        for key, value in values.items():
            net.history.record(key, value)
        causes = Counter(row.get("skip_cause") for row in net.history[-1, "batches"] if row.get("step_skipped"))
        epoch = len(net.history)
        for _, cb in net.callbacks_:
            if isinstance(cb, TensorBoard):
                for key, value in values.items():
                    cb.writer.add_scalar(f"amp/{key}", value, epoch)
                for cause in SKIP_CAUSES:
                    cb.writer.add_scalar(f"amp/skipped/{cause}", causes.get(cause, 0), epoch)


def _recorder(net) -> FlightRecorder | None:
    state = getattr(net, "amp_step_state_", None)
    return state.recorder if state is not None else None
