"""Callbacks that make the loss scale and skipped steps visible."""

from __future__ import annotations

from typing import Any, Callable

from skorch.callbacks import Callback, TensorBoard

__all__ = ["AmpMonitor"]


class AmpMonitor(Callback):
    """Report loss-scale changes and bursts of skipped steps.

    Reads what an ampnet net records per batch (``loss_scale``,
    ``step_skipped``) and, per epoch, adds ``scale_changes`` (how often the
    scale moved) and ``max_skip_burst`` (the longest run of skipped steps)
    to the history, so that :class:`skorch.callbacks.PrintLog` and
    :class:`skorch.callbacks.TensorBoard` show them. If the net has a
    ``TensorBoard`` callback, the per-step scale and skips are also written
    to its writer under ``amp/loss_scale`` and ``amp/step_skipped``.

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
    ) -> None:
        self.burst = burst
        self.report_scale_changes = report_scale_changes
        self.sink = sink

    def initialize(self) -> "AmpMonitor":
        if not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError(f"burst must be an int >= 1; got {self.burst!r}.")
        self.events_: list[dict[str, Any]] = []
        self.last_scale_: float | None = None
        self.run_: int = 0
        self.global_step_: int = 0
        return self

    def on_epoch_begin(self, net, **kwargs) -> None:
        self.changes_ = 0
        self.max_run_ = 0

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
