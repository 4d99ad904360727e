"""The budget of ``amp_enabled='auto'``'s probe (``amp_autotune__budget``):
the probe measures only as much as the fit can pay for, at most a share of
the fit's float32 training time, counted in float32 training steps. The
probe (:mod:`ampnet.auto.probe`) asks it whether to run at all, whether a
candidate fits in what is left, and whether one more timed round does;
:mod:`ampnet.auto.enabled`'s docstring says how the cost is counted."""

from __future__ import annotations

import statistics
from typing import Any

from ampnet.auto.enabled import MIN_ROUNDS
from ampnet.auto.screen import SCREEN_REPEATS

__all__ = ["Budget", "FORWARD_SHARE"]


#: A forward pass without gradients, as a share of a training step's time
#: (the backward pass costs about two forward passes): how the budget
#: counts the screen's and the rounds' float32 reference passes before they
#: are timed.
FORWARD_SHARE = 1 / 3


class Budget:
    """What the probe may spend (``amp_autotune__budget``): ``share`` of the
    fit's ``fit_steps`` training steps, counted in float32 training steps,
    i.e. the timer's seconds over float32's median step once float32's
    copy is timed. ``share`` None, or a fit of unknown length: no limit.

    The probe is skipped when even its cheapest form does not fit
    (:meth:`too_short`); an AMP candidate is not measured when its cheapest
    estimate does not fit in what is left (:meth:`room_for`); a candidate's
    rounds stop early when one more would not (:meth:`room_for_round`)."""

    def __init__(self, share: float | None, fit_steps: int | None, warmup: int) -> None:
        self.share, self.fit_steps, self.warmup = share, fit_steps, warmup
        self.allowance = None if share is None or fit_steps is None else share * fit_steps
        self.spent = 0.0  # float32 training steps: the screen and the candidates done
        self.step_s: float | None = None  # float32's median step, in the timer's seconds
        self.screen_s = 0.0  # the screen's passes, in the timer's seconds

    def minimal(self) -> float:
        """The cheapest probe that can choose AMP, in float32 steps: float32
        and one AMP candidate, each warmed up and timed in
        :data:`MIN_ROUNDS` rounds, and the screen of one dtype."""
        per_candidate = self.warmup + MIN_ROUNDS * (1 + FORWARD_SHARE)
        return 2 * per_candidate + (1 + SCREEN_REPEATS) * 2 * FORWARD_SHARE

    def too_short(self) -> bool:
        return self.allowance is not None and self.allowance < self.minimal()

    def cost(self, candidate: Any) -> float:
        """What ``candidate`` has cost so far, in float32 steps (the screen's
        passes included while float32's step is not known yet)."""
        step_s = self.step_s or (statistics.median(candidate.times) if candidate.times else None)
        if not step_s:
            return float(len(candidate.losses)) + FORWARD_SHARE * len(candidate.refs)
        own = statistics.median(candidate.times) if candidate.times else step_s
        warm = len(candidate.losses) - len(candidate.times)
        total = warm * own + sum(candidate.times) + sum(candidate.refs)
        return total / step_s + (self.screen_s / step_s if self.step_s is None else 0.0)

    def need(self, ratio: float, reference_s: float, step_s: float) -> float:
        """The cheapest measurement of a candidate whose steps take about
        ``ratio`` x float32's (``step_s``), in float32 steps: warmed up and
        timed in :data:`MIN_ROUNDS` rounds, each after a reference pass of
        ``reference_s``."""
        return (self.warmup + MIN_ROUNDS) * max(ratio, 0.0) + MIN_ROUNDS * reference_s / step_s

    def room_for_round(self, candidate: Any, next_ratio: float | None = None) -> bool:
        """Whether ``candidate`` may run one more timed round: it fits, and
        leaves room for the cheapest measurement of the next candidate (whose
        steps take about ``next_ratio`` x float32's; None: none is left)."""
        if self.allowance is None or not candidate.times:
            return True
        step_s = self.step_s or statistics.median(candidate.times)
        reference_s = statistics.median(candidate.refs)
        one_more = (statistics.median(candidate.times) + reference_s) / step_s
        reserve = 0.0 if next_ratio is None else self.need(next_ratio, reference_s, step_s)
        return self.spent + self.cost(candidate) + one_more + reserve <= self.allowance

    def room_for(self, ratio: float, reference_s: float) -> bool:
        """Whether an AMP candidate whose steps take about ``ratio`` x
        float32's fits in what is left (:meth:`need`)."""
        if self.allowance is None or not self.step_s:
            return True
        return self.spent + self.need(ratio, reference_s, self.step_s) <= self.allowance

    def done(self, candidate: Any, baseline: bool) -> None:
        """Count ``candidate`` as spent; float32's (``baseline``) sets the unit."""
        cost = self.cost(candidate)
        if baseline and candidate.times:
            self.step_s = statistics.median(candidate.times)
        self.spent += cost

    def describe(self) -> str:
        """The budget in words, for the table and the reasons."""
        return (f"amp_autotune__budget={self.share:g} of this fit's {self.fit_steps} training steps, "
                f"about {self.allowance:.1f} float32 steps")
