"""``amp_enabled='auto'``'s measurement: the fit's own first steps.

The net trains its first steps alternately in float32 and in mixed
precision (float32 first; both keep float32 weights and optimizer state, so
switching between two steps costs nothing and every step is a real, kept
training step). A float32 step runs as a float32 net runs it: autocast off,
no loss scaling, and the optimizer kernel a float32 net uses (skorch's
default, or the user's ``fused``/``foreach``); a mixed step runs with mixed
precision's. Each candidate's first ``warmup`` steps are not timed, nor is a
step that was skipped (an overflow, a non-finite loss: no optimizer step);
then each timed pair (a float32 step and the mixed step after it) gives a
ratio, mixed over float32. :func:`decide` reads the ratios after every pair;
once it has decided, the rest of the fit trains in the choice. A
:class:`Trial` also watches the chosen setting for the rest of the fit
(:meth:`Trial.end_epoch`): its steps' time against what was measured, and
its health (skipped steps, a non-finite loss), on a CPU and on CUDA alike.

A step is timed from the start of its first micro-batch to the end of its
last (the whole accumulated step), by a :class:`Clock`: the wall clock on a
CPU, CUDA events on a GPU (no host synchronization per step: a step's time
is read once its end event has completed, and the watch reads its steps'
at the epoch's end).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

from ampnet.config.reconfigure import ampnet_kernels
from ampnet.precision import KERNEL_KEYS, GradScaler, dtype_name, set_kernels
from ampnet.utils.dtypes import LOW_PRECISION_DTYPES
from ampnet.utils.tree import iter_tensors

__all__ = ["Trial", "decide", "Clock", "WallClock", "EventClock", "clock_for", "MIN_PAIRS", "DRIFT", "UNHEALTHY"]

#: The fewest timed pairs that decide (or ``amp_autotune__steps``, where it
#: asks for fewer): one pair, however far apart, never decides alone.
MIN_PAIRS = 3

#: How much slower than measured the chosen setting's epoch may run before the record says so.
DRIFT = 0.25

#: Steps shorter than this are not judged by the watch on time: their time is Python's overhead and its noise.
JUDGED_S = 0.002

#: Skipped steps in a row after which a candidate's turn passes to the other one.
RETRIES = 3

#: A measurement gives up after this many times the steps a full one takes.
LONGEST = 2

#: The most steps of an epoch the watch reads (its latest).
WATCHED = 256

#: The share of an epoch's steps that, skipped, makes the chosen setting unhealthy.
UNHEALTHY = 0.5


def decide(ratios: list[float], margin: float, pairs: int) -> tuple[int | None, str]:
    """The choice after the timed pairs' ``ratios`` (mixed step time over
    float32's): 1 (mixed), 0 (float32) or None (measure another pair), and
    why. Mixed precision wins when it is faster than float32 by more than
    ``margin``. Nothing is decided before :data:`MIN_PAIRS` pairs (or
    ``pairs``, where fewer); then pairs that all agree decide, and pairs
    that disagree are confirmed by more pairs, up to ``pairs``, whose
    median decides: one slow step (a preempted one) decides nothing."""
    least = max(min(MIN_PAIRS, pairs), 1)
    if len(ratios) < least:
        return None, ""
    threshold = 1 - margin
    median = statistics.median(ratios)
    pairs_said = f"{len(ratios)} timed pair{'s' if len(ratios) != 1 else ''}"
    said = f"mixed took {median:.2f}x float32's step time (median of {pairs_said})"
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


# ---- clocks -------------------------------------------------------------------------------------


class Clock:
    """How a step is timed: :meth:`start` before its first micro-batch,
    :meth:`stop` after its last gives a reading; :meth:`read` is its
    seconds where known without waiting (None: not yet), :meth:`wait` its
    seconds, waiting where it must."""

    def start(self) -> Any:
        raise NotImplementedError

    def stop(self, mark: Any) -> Any:
        raise NotImplementedError

    def read(self, reading: Any) -> float | None:
        raise NotImplementedError

    def wait(self, reading: Any) -> float:
        raise NotImplementedError


class WallClock(Clock):
    """The host's wall clock (a CPU's steps end when their call returns)."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float) -> float:
        return time.perf_counter() - mark

    def read(self, reading: float) -> float:
        return reading

    def wait(self, reading: float) -> float:
        return reading


class EventClock(Clock):
    """CUDA events on the current stream of ``device``: recorded without a
    synchronization; a reading is known once its end event has completed
    (:meth:`read` asks without waiting)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, mark: Any) -> Any:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        return mark, end

    def read(self, reading: Any) -> float | None:
        start, end = reading
        return start.elapsed_time(end) / 1e3 if end.query() else None

    def wait(self, reading: Any) -> float:
        start, end = reading
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device) -> Clock:
    """CUDA events on a CUDA device, else the wall clock."""
    return EventClock(device) if device.type == "cuda" else WallClock()


# ---- the trial ----------------------------------------------------------------------------------


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
      Where the net trains.
    timer : callable or None
      ``amp_autotune__timer``: ``timer(params, seconds) -> seconds`` turns a
      step's measured time into the one counted (tests use it to stand
      for another machine); None counts the measured time.
    chosen : int or None
      The candidate already chosen (a stored choice): the trial then only watches.
    predicted_s : float or None
      The chosen setting's step time when the choice is already made.
    clock : Clock or None
      How steps are timed (:func:`clock_for` the device where None).
    """

    def __init__(self, candidates: list[dict[str, Any]], margin: float, pairs: int, warmup: int,
                 device: torch.device, timer: Callable[[dict, float], float] | None = None,
                 chosen: int | None = None, predicted_s: float | None = None, clock: Clock | None = None) -> None:
        self.candidates, self.margin, self.pairs, self.warmup = candidates, margin, pairs, warmup
        self.device, self.timer = device, timer
        self.clock = clock if clock is not None else clock_for(device)
        self.times: list[list[float]] = [[] for _ in candidates]  # timed steps, per candidate
        self.log: list[int] = []  # the candidate of each measured step, in order
        self.seconds: list[tuple[int, float]] = []  # (candidate, seconds) of each timed measured step
        self.key: dict[str, Any] | None = None  # the cache key of the choice (None: no cache)
        self.folder: str | None = None  # the cache folder
        self.unhealthy = False  # a mixed step's loss went non-finite where float32's did not
        self.chosen, self.reason = chosen, ""
        self.measured = False  # decided by the measurement (not by the fit's end)
        self.predicted_s = predicted_s
        self.watched: list[Any] = []  # the chosen setting's readings this epoch
        self.drift: str | None = None
        self._current: int | None = None
        self._mark: Any = None
        self._pending: list[tuple[int, Any]] = []  # (candidate, reading) of ended steps not yet read
        self._runs = [0 for _ in candidates]  # the steps each candidate applied (not skipped)
        self._turn = 0  # the candidate of the next measured step
        self._retries = 0  # skipped steps in a row
        self._nonfinite = [False for _ in candidates]  # a step's loss went non-finite, per candidate
        self._float32_time: float | None = None  # the float32 step waiting for its mixed step
        self._kept: list[tuple[torch.optim.Optimizer, dict[str, Any]]] = []  # kernels of a float32 step
        self._scaler: Any = None  # the loss scaler a float32 step set aside

    @property
    def decided(self) -> bool:
        return self.chosen is not None

    def __getstate__(self) -> dict[str, Any]:
        # readings in flight (CUDA events) do not pickle: a copy starts its watch afresh
        state = dict(self.__dict__)
        state.update(watched=[], _pending=[], _mark=None)
        return state

    def run(self, net: Any, step: Callable[..., dict], batch: Any, **fit_params: Any) -> dict:
        """One micro-batch through ``step`` (:func:`ampnet.training.step.train_step`),
        in the candidate of its step, timed from its step's first micro-batch
        to its last; a step's end is recorded."""
        state, prec = net.amp_step_state_, net.precision_
        if state.micro_batches == 0:  # a step begins
            low = "" if self.decided else _low_precision_inputs(batch)
            if low:
                self.chosen, self.reason, self.measured = 1, f"the fit has {low} inputs, which float32 cannot take", True
            self._current = self.chosen if self.decided else self._next()
            if not self.decided and self._current == 0:
                self._float32_setting(net)
            self._mark = self.clock.start()
        float32 = not self.decided and self._current == 0
        state.float32_step = float32  # the fit's state, not the component's
        try:
            out = step(net, batch, **fit_params)
        except BaseException:  # the step failed: mixed precision's setting back, whatever the micro-batch
            state.float32_step = False
            self._mixed_setting(net)
            raise
        state.float32_step = False
        if state.micro_batches == 0 and float32:  # the step ended: mixed precision's setting back
            self._mixed_setting(net)
        if state.micro_batches == 0:  # the step ended
            reading = self.clock.stop(self._mark)
            if self.decided:
                self.watch(reading)
            else:
                self._end_step(net, self._current, reading)
        return out

    def watch(self, reading: Any) -> None:
        """Keep a step's ``reading`` of the chosen setting (the epoch's
        latest :data:`WATCHED`), for the watch at the epoch's end."""
        if len(self.watched) >= WATCHED:
            self.watched.pop(0)
        self.watched.append(reading)

    def _next(self) -> int:
        """The candidate of the next measured step: float32 and mixed
        precision in turn; a skipped step is taken again in its candidate."""
        return self._turn

    def _float32_setting(self, net: Any) -> None:
        """A float32 step as a float32 net takes it: the optimizers whose
        kernel ampnet chooses get a float32 net's (skorch's default), and
        the loss scaler is set aside (no scaling, no unscale)."""
        self._kept = []
        for name in ampnet_kernels(net):
            optimizer = net.__dict__.get(name + "_")
            if isinstance(optimizer, torch.optim.Optimizer):
                self._kept.append((optimizer, {k: optimizer.defaults[k] for k in KERNEL_KEYS
                                               if k in optimizer.defaults}))
                set_kernels(optimizer, {})
        prec = net.precision_
        if prec.scaling:
            self._scaler, prec.scaler = prec.scaler, GradScaler(str(self.device.type), enabled=False)

    def _mixed_setting(self, net: Any) -> None:
        """Mixed precision's kernels and loss scaler back after a float32 step
        (also where the fit ended inside one: nothing to do after it)."""
        for optimizer, kernels in self._kept:
            set_kernels(optimizer, kernels)
        self._kept = []
        if self._scaler is not None:
            net.precision_.scaler, self._scaler = self._scaler, None
            net.amp_step_state_.scale = None  # the live scaler's scale, read again

    def _end_step(self, net: Any, index: int, reading: Any) -> None:
        self.log.append(index)
        row = net.history[-1]["batches"][-1] if len(net.history) and net.history[-1]["batches"] else {}
        if row.get("skip_cause") == "nonfinite_loss":
            self._nonfinite[index] = True
            if index == 1 and not self._nonfinite[0]:
                self.unhealthy = True
        if self.unhealthy:
            self.chosen, self.measured = 0, True
            self.reason = "a mixed step's loss went non-finite (NaN/inf) where float32's steps' had not"
            return
        if row.get("step_skipped") is True:  # no optimizer step: no sample, and the candidate runs again
            self._retries += 1
            if self._retries >= RETRIES and len(self.candidates) > 1:  # but not for ever: the other's turn
                self._turn, self._retries = 1 - index, 0
            self._give_up()
            return
        self._retries = 0
        self._runs[index] += 1
        self._turn = 1 - index if len(self.candidates) > 1 else 0
        if self._runs[index] <= self.warmup:
            return
        self._pending.append((index, reading))
        self._take_readings(wait=False)
        self._give_up()

    def _give_up(self) -> None:
        """A measurement that has not decided after :data:`LONGEST` times
        the steps a full one takes (its steps skipped) decides with what it
        has, as a fit's end does: nothing of it is stored."""
        if not self.decided and len(self.log) >= LONGEST * 2 * (self.warmup + self.pairs):
            self.finish("the measurement's steps kept being skipped")

    def _take_readings(self, wait: bool) -> None:
        """Turn the ended steps' readings into timed steps and pairs (those
        known now; all, waiting for them, with ``wait``); decide after each pair."""
        while self._pending and not self.decided:
            index, reading = self._pending[0]
            seconds = self.clock.wait(reading) if wait else self.clock.read(reading)
            if seconds is None:
                return
            self._pending.pop(0)
            if self.timer is not None:
                seconds = float(self.timer(self.candidates[index], seconds))
            self.seconds.append((index, seconds))
            if index == 0:
                self._float32_time = seconds
                continue
            if self._float32_time is None:
                continue
            self.times[0].append(self._float32_time)
            self.times[1].append(seconds)
            self._float32_time = None
            chosen, reason = decide(self.ratios(), self.margin, self.pairs)
            if chosen is not None:
                self.chosen, self.reason, self.measured = chosen, reason, True

    def ratios(self) -> list[float]:
        """Each timed pair's mixed step time over its float32 step's."""
        return [a / f for f, a in zip(self.times[0], self.times[1]) if f > 0]

    def finish(self, cause: str = "the fit ended before the measurement did") -> None:
        """Decide with what was measured, where the measurement could not
        end (``cause``): its choice is this fit's only (``measured`` stays False)."""
        self._take_readings(wait=True)
        if not self.decided:
            ratios = self.ratios()
            if ratios:
                median = statistics.median(ratios)
                self.chosen = 1 if median < 1 - self.margin else 0
                self.reason = (f"mixed took {median:.2f}x float32's step time (median of {len(ratios)} timed "
                               f"pair{'s' if len(ratios) != 1 else ''}: {cause})")
            else:
                self.chosen, self.reason = 0, f"{cause}, before a timed pair: float32 kept"

    def step_s(self, index: int) -> float | None:
        """A candidate's median timed step, in seconds."""
        return statistics.median(self.times[index]) if self.times[index] else None

    def end_epoch(self, epoch: int, rows: list[dict[str, Any]] | None = None,
                  loss: Any = None) -> str | None:
        """Judge the chosen setting over this epoch: its health (``rows``,
        the epoch's batch rows: at least :data:`UNHEALTHY` of its steps
        skipped; ``loss``, the epoch's training loss, non-finite), then its
        steps' time against what was measured (slower by more than
        :data:`DRIFT` and the noise of the pairs, or slower than the other
        setting measured). The finding, else None."""
        readings, self.watched = self.watched, []
        name = "float32" if self.chosen == 0 else "mixed precision"
        skipped = sum(1 for row in rows or () if row.get("step_skipped") is True)
        steps = sum(1 for row in rows or () if "step_skipped" in row) or len(rows or ())
        if steps and skipped and skipped >= UNHEALTHY * steps:
            self.drift = f"epoch {epoch}: {name} skipped {skipped} of its {steps} steps (non-finite gradients or loss)"
            return self.drift
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and not math.isfinite(loss):
            self.drift = f"epoch {epoch}: {name} trained to a non-finite loss ({loss})"
            return self.drift
        watched = [self._seconds(r) for r in readings]
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

    def _seconds(self, reading: Any) -> float:
        seconds = self.clock.wait(reading)
        return float(self.timer(self.candidates[self.chosen], seconds)) if self.timer is not None else seconds
