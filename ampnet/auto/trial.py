"""``amp_enabled='auto'``'s measurement: the fit's own first steps.

The net trains its first steps alternately in float32 and in mixed
precision (float32 first; both keep float32 weights and optimizer state, so
switching between two steps costs nothing and every step is a real, kept
training step). Each candidate's first ``warmup`` steps are not timed; then
each timed pair (a float32 step and the mixed step after it) gives a ratio,
mixed over float32. :func:`decide` reads the ratios after every pair; once
it has decided, the rest of the fit trains in the choice. A :class:`Trial`
also watches the chosen setting's steps for the rest of the fit and says
when they run slower than measured (:meth:`Trial.end_epoch`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ampnet.utils.tree import iter_tensors
from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.precision import dtype_name

__all__ = ["Trial", "decide", "CLEAR", "DRIFT"]

#: A single timed pair decides when its ratio is beyond this factor either way.
CLEAR = 1.6

#: How much slower than measured the chosen setting's epoch may run before the record says so.
DRIFT = 0.25

#: Steps shorter than this are not judged by the watch: their time is Python's overhead and its noise.
JUDGED_S = 0.002


def decide(ratios: list[float], margin: float, pairs: int) -> tuple[int | None, str]:
    """The choice after the timed pairs' ``ratios`` (mixed step time over
    float32's): 1 (mixed), 0 (float32) or None (measure another pair), and
    why. Mixed precision wins when it is faster than float32 by more than
    ``margin``: at once where one pair is beyond :data:`CLEAR` either way,
    after two pairs that agree, else by the median of ``pairs`` pairs."""
    if not ratios:
        return None, ""
    threshold = 1 - margin
    median = statistics.median(ratios)
    pairs_said = f"{len(ratios)} timed pair{'s' if len(ratios) != 1 else ''}"
    said = f"mixed took {median:.2f}x float32's step time (median of {pairs_said})"
    if len(ratios) == 1:
        if ratios[0] >= CLEAR:
            return 0, said
        if ratios[0] <= 1 / CLEAR:
            return 1, said
        return None, ""
    if max(ratios) < threshold:
        return 1, said
    if min(ratios) >= threshold:
        return 0, said
    if len(ratios) >= pairs:
        return (1 if median < threshold else 0), said + ", the pairs disagreeing: decided by the median"
    return None, ""


def _low_precision_inputs(batch: Any) -> str:
    """The low-precision dtypes of a batch's inputs ('' where none): a
    float32 module cannot take them, mixed precision's autocast can."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
    found = sorted({dtype_name(t.dtype) for t in iter_tensors(inputs) if t.dtype in LOW_PRECISION_DTYPES})
    return " and ".join(found)


class Trial:
    """The measurement of one ``'auto'`` net, then the watch over its choice.

    Parameters
    ----------
    candidates : list of dict
      The constructor parameters of float32 (first) and mixed precision.
    margin, pairs, warmup
      The net's ``amp_autotune__margin``, ``__steps`` (timed pairs at most)
      and ``__warmup`` (untimed steps per candidate).
    device : torch.device
      Where the net trains (CUDA steps are timed between synchronizations).
    timer : callable or None
      ``amp_autotune__timer``: ``timer(params, seconds) -> seconds`` turns a
      step's measured wall time into the one counted (tests use it to stand
      for another machine); None counts the wall time.
    predicted_s : float or None
      The chosen setting's step time when the choice is already made (a
      stored one): the trial then only watches.
    """

    def __init__(self, candidates: list[dict[str, Any]], margin: float, pairs: int, warmup: int,
                 device: torch.device, timer: Callable[[dict, float], float] | None = None,
                 chosen: int | None = None, predicted_s: float | None = None) -> None:
        self.candidates, self.margin, self.pairs, self.warmup = candidates, margin, pairs, warmup
        self.device, self.timer = device, timer
        self.times: list[list[float]] = [[] for _ in candidates]  # timed steps, per candidate
        self.log: list[int] = []  # the candidate of each measured step, in order
        self.seconds: list[tuple[int, float]] = []  # (candidate, seconds) of each measured step
        self.key: dict[str, Any] | None = None  # the cache key of the choice (None: no cache)
        self.folder: str | None = None  # the cache folder
        self.unhealthy = False  # a mixed step's forward pass went non-finite where float32's did not
        self.chosen, self.reason = chosen, ""
        self.predicted_s = predicted_s
        self.watched: list[float] = []  # the chosen setting's steps this epoch
        self.drift: str | None = None
        self._current: int | None = None
        self._elapsed = 0.0

    @property
    def decided(self) -> bool:
        return self.chosen is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, net: Any, step: Callable[..., dict], batch: Any, **fit_params: Any) -> dict:
        """One micro-batch through ``step`` (:func:`ampnet.training.step.train_step`),
        in the candidate of its step, timed; a step's end is recorded."""
        state = net.amp_step_state_
        begins = state.micro_batches == 0
        if begins:
            self._elapsed = 0.0
            low = "" if self.decided else _low_precision_inputs(batch)
            if low:
                self.chosen, self.reason = 1, f"the fit has {low} inputs, which float32 cannot take"
            self._current = self.chosen if self.decided else len(self.log) % 2
        timed = not self.decided or self.device.type == "cpu"  # CUDA: no synchronization once decided
        if timed and begins:
            self._sync()
        state.float32_step = not self.decided and self._current == 0  # the fit's state, not the component's
        start = time.perf_counter()
        try:
            out = step(net, batch, **fit_params)
        finally:
            state.float32_step = False
        if timed:
            if state.micro_batches == 0:
                self._sync()
            self._elapsed += time.perf_counter() - start
        if state.micro_batches == 0 and timed:  # the step ended
            seconds = self._elapsed
            if self.timer is not None:
                seconds = float(self.timer(self.candidates[self._current], seconds))
            if self.decided:
                self.watched.append(seconds)
            else:
                self._end_step(net, self._current, seconds)
        return out

    def _end_step(self, net: Any, index: int, seconds: float) -> None:
        runs = self.log.count(index)
        self.log.append(index)
        self.seconds.append((index, seconds))
        if net.history[-1]["batches"][-1].get("skip_cause") == "nonfinite_loss" and index == 1:
            self.unhealthy = True
        if runs >= self.warmup:
            self.times[index].append(seconds)
        if self.unhealthy:
            self.chosen, self.reason = 0, "a mixed step's forward pass went non-finite (NaN/inf loss)"
            return
        if index == 1 and len(self.times[1]) == len(self.times[0]):
            self.chosen, self.reason = decide(self.ratios(), self.margin, self.pairs)

    def ratios(self) -> list[float]:
        """Each timed pair's mixed step time over its float32 step's."""
        return [a / f for f, a in zip(self.times[0], self.times[1]) if f > 0]

    def finish(self) -> None:
        """Decide with what was measured, where the fit ended first."""
        if not self.decided:
            ratios = self.ratios()
            if ratios:
                median = statistics.median(ratios)
                self.chosen = 1 if median < 1 - self.margin else 0
                self.reason = (f"mixed took {median:.2f}x float32's step time (median of {len(ratios)} timed "
                               "pairs: the fit ended before the measurement)")
            else:
                self.chosen, self.reason = 0, "the fit ended before a timed pair: float32 kept"

    def step_s(self, index: int) -> float | None:
        """A candidate's median timed step, in seconds."""
        return statistics.median(self.times[index]) if self.times[index] else None

    def end_epoch(self, epoch: int) -> str | None:
        """Compare this epoch's steps of the chosen setting with what was
        measured; the finding when they ran slower by more than
        :data:`DRIFT` (and the noise of the pairs), else None."""
        watched, self.watched = self.watched, []
        predicted = self.predicted_s or (self.step_s(self.chosen) if self.decided else None)
        if not watched or not predicted or len(watched) < 3 or predicted < JUDGED_S:
            return None
        ratios = self.ratios()
        noise = (max(ratios) - min(ratios)) / statistics.median(ratios) if len(ratios) > 1 else 0.0
        now = statistics.median(watched)
        other = self.step_s(1 - self.chosen) if self.decided and len(self.candidates) > 1 else None
        if now > predicted * (1 + max(DRIFT, 2 * noise)):
            self.drift = (f"epoch {epoch}: its steps took {now * 1e3:.1f} ms, {now / predicted:.2f}x the "
                          f"{predicted * 1e3:.1f} ms measured")
        elif other and now > other * (1 + self.margin):
            self.drift = (f"epoch {epoch}: its steps took {now * 1e3:.1f} ms, slower than the "
                          f"{other * 1e3:.1f} ms measured for {'float32' if self.chosen else 'mixed precision'}")
        return self.drift
