"""``amp_enabled='auto'``: measure which precision pays off for this model on
this machine, and train with it.

At the start of the first fit, before any callback's ``on_train_begin``, a
probe times each candidate setting on copies of the module and optimizers
(the net's own modules, optimizers, history, callbacks and random state are
left as they were), then the net takes the fastest healthy candidate exactly
as a net constructed with those settings would have it: pinning the choice,
``AmpNet(..., **net.amp_autotune_.params)``, trains bitwise the same.

Candidates
----------
- float32 (AMP off): the baseline, always measured first;
- ``amp_level='mixed'`` in the dtype that ``amp_dtype='auto'`` picks for the
  device (bfloat16 on CPUs and on CUDA GPUs of compute capability 8.0+,
  float16 on older GPUs and on MPS);
- ``amp_level='pure'`` with ``amp_master_weights='compensated'`` where every
  optimizer of the net supports it (:data:`ampnet.precision.compensated.SUPPORTED`),
  else with float32 master weights; only for nets with a ``module_``;
- for models with 4-D parameters, float32 and mixed again with
  ``memory_format='channels_last'``.

float16 on a CPU is never measured (it is emulated, many times slower than
float32): the table lists it as not measured. An AMP setting other than its
default narrows the candidates to those that honour it: ``amp_dtype`` fixes
the dtype, ``amp_level='pure'`` or ``amp_master_weights`` other than True
keep only pure candidates with that setting, ``memory_format='channels_last'``
keeps only channels_last candidates. float32 stays a candidate in every
case: it is what AMP must beat.

Measurement and choice
----------------------
First a screen (:mod:`ampnet.auto.screen`): one forward pass
per low-precision dtype against float32's, on the net's own module without
gradients, in eval mode; a dtype more than 1.5x slower than float32 (an
emulated one, or one this CPU computes slower) is not measured further, and when no AMP candidate is left,
no copy is built and nothing is timed. Then the candidates are measured one
after the other, float32's first: a copy of the net is built for the
candidate, trains ``warmup`` steps (default 1) on the first training batch
(the first ``batch_size`` rows of the training split, not shuffled)
through the net's own training step (:func:`ampnet.step.train_step`: the
non-finite guard, the loss scaler, the optimizer's kernel), without
callbacks, then up to ``steps`` timed steps (default 5). Each timed step
comes right after a timed float32 forward pass (the screen's, on float32's
copy: the round's reference), and a step counts as its time over that
reference: a change of the machine's load (another process, a frequency
change) hits both alike, so candidates timed at different moments compare
fairly. A candidate stops being timed after :data:`MIN_ROUNDS` rounds once
its timings have settled (their interquartile range at most
:data:`SETTLED` x ``margin`` of their median) or it was more than
:data:`SLOWER` x float32's in every round. A candidate's ``step_time_s`` is
the median of its timed steps; its ``gain`` over float32 is 1 minus the
median of its per-round ratios (step over reference) to float32's median
one, and its ``spread`` the interquartile range of those ratios plus
float32's own relative one (the noise of both; 0 with a single round).

A candidate is healthy when its loss and gradients are finite and the
gradients of its first step (from the same initial weights and batch as
float32's first step) have a cosine similarity of at least ``min_cosine``
(default 0.98) with float32's. A healthy AMP candidate qualifies when its
gain exceeds both ``margin`` (default 0.05: 5%) and its ``spread``. Ties go
to the simpler setting (:func:`complexity`: mixed before pure, float32
masters before compensated, contiguous before channels_last): a more
complex candidate wins over a simpler qualifying one only when its gain is
larger by more than half the spread of each (its row's reason says "within
noise of ..." otherwise). The net trains in float32 when none qualifies;
when a candidate was faster by more than the margin but not by more than
its spread, the timings were too noisy to decide: float32 is kept, and its
row's ``reason`` and ``str(amp_autotune_)`` say so (pin a choice, or probe
with more ``steps``).

A busy machine: on a CPU, when the thread that ran the timed steps got
less than half of their wall-clock time as CPU time (another process
competes for the cores; probes under 0.2 s are not judged), or when the
rounds' float32 forward pass took over 2x (or under half) as long as the
screen's, the result's ``disturbed`` says so, ``str(amp_autotune_)`` too,
and the fit warns (``AmpWarning``) with the fix: the choice is made once,
for the whole fit; re-run on a quiet machine, or pin a choice.

Budget
------
The probe measures only as much as the fit can pay for:
``amp_autotune__budget`` (default 0.03) is its budget, as a share of the
fit's float32 training time (:mod:`ampnet.auto.budget`). The fit's length
is its epochs (the ``epochs`` passed to ``fit``, else ``max_epochs``) times
the batches of the training split; the cost is counted in float32 training
steps (before float32 is timed, each training step as one and each forward
pass without gradients as a third of one; after, in the timer's seconds
over float32's median step). A fit too short for even the cheapest probe
(float32 and one AMP candidate, each warmed up and timed in
:data:`MIN_ROUNDS` rounds, and the screen: about 9 float32 steps, so fewer
than about 310 steps with the defaults) keeps float32 without building a
copy, and its note says so with the fix. Otherwise float32 is measured
first (its screen, warm-up and :data:`MIN_ROUNDS` rounds always run, so a
model whose forward pass is a large share of its step can overrun the
budget there), then the AMP candidates from the simplest to the most
complex: one whose cheapest estimate (its screen ratio to float32 for its
steps) does not fit in what is left is not measured (its reason says so),
and a candidate's rounds stop once another would overrun the budget or
leave no room for the next candidate's cheapest measurement (never before
:data:`MIN_ROUNDS`). When the budget runs out before any AMP candidate was
timed, the note says that float32 is kept without a verdict on AMP. The
fix, printed in both cases: pin ``amp_enabled=True``, or pass a larger
``amp_autotune__budget`` (None: whatever the fit's length) at construction
or with ``set_params`` before the next fit (a changed probe setting drops
the choice). A net trained by ``partial_fit`` one epoch at a time with
``max_epochs=1`` counts one epoch: pass ``amp_autotune__budget=None``, or
pin the choice.

Cost
----
The screen: 3 forward passes of float32 and 3 per low-precision dtype on
the first batch (about one training step's worth). Then per candidate
``warmup`` + 2 to ``steps`` training steps (3 with the defaults on a quiet
machine: 9 for an MLP, 15 for a convolutional model), each timed one after
a float32 forward pass, plus up to 8 extra warm-up steps for a float16
candidate whose loss scale is still settling; the table's ``steps`` column
says how many each ran. Memory: one training copy (module, gradients,
optimizer state) at a time, freed before the next is built; float32's copy
keeps only its module afterwards (for the reference forward pass) and its
first gradients (one float32 value per parameter) for the health check;
an AMP candidate's agreement with them is computed on the fly, without a
copy of its gradients. So the probe holds at most the net's own module, one
float32 module and one training copy: for AdamW about 1x the net's model +
optimizer state beyond the fit's own peak (``tools/probe_cost.py`` measures
it, and the extra wall time, on the benchmark MLP). Everything is freed
when the probe ends. The probe's wall time is ``amp_autotune_.probe_s``.

Settings (``amp_autotune__<name>``)
-----------------------------------
``steps`` (int in [1, 100]), ``warmup`` (int in [0, 100]), ``margin``
(float in [0, 1)), ``budget`` (None or a float in (0, 1]) and
``min_cosine`` (float in [-1, 1]): rows of the
parameter table (:mod:`ampnet.params`), checked whenever they are set, for
any ``amp_enabled``; an unknown ``amp_autotune__*`` name is an error. Steps
are timed by the wall clock (synchronized on CUDA): the probe's
``timer(params, step) -> seconds`` is :func:`ampnet.auto.probe.wall_timer`,
which the tests replace to make the choice deterministic.

The choice
----------
``net.amp_autotune_`` (:class:`AutotuneResult`) holds the chosen parameters
(``.params``), one row per candidate (``.table``) and prints as a table
(printed once when ``verbose``). ``get_params()['amp_enabled']`` stays
``'auto'``. The choice pickles with the net; ``save_params(f_params=...)``
and checkpoints keep it in the module file's metadata, and loading such a
file into an ``'auto'`` net that has not chosen yet makes it take that
choice (a ``LoadInitState`` resume reads it before the first fit, instead
of probing). ``partial_fit``, ``warm_start`` and a second ``fit`` reuse it; a
clone probes afresh, and so does the next fit after ``set_params`` changes
an AMP parameter, a probe setting (``amp_autotune__*``) or the device. Under ``torch.distributed``, rank 0's
choice is used on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ampnet.auto.screen import SCREEN_SLOWER
from ampnet.no_effect import is_default
from ampnet.params import PARAMS, auto_inputs, check, pending_params
from ampnet.precision import SUPPORTED_COMPENSATED, FLOAT16_SAFE_COMPENSATED, dtype_name, module_root
from ampnet.precision import parse_amp_dtype, resolve_precision

__all__ = [
    "AutotuneResult", "CHOICE_KEYS", "SETTINGS", "probe_settings", "candidate_params", "choose", "complexity",
    "label",
]

#: The constructor parameters that a choice sets: the inputs of the choice in
#: the parameter table, but the device.
CHOICE_KEYS = tuple(name for name in PARAMS if name in auto_inputs() and name != "device")

#: The ``amp_autotune__*`` settings (rows of the parameter table), without the prefix.
SETTINGS = tuple(name.split("__", 1)[1] for name in PARAMS if name.startswith("amp_autotune__"))

_EXTRA_WARMUP = 8  # steps a float16 candidate may take to reach finite gradients

#: A candidate whose timed steps were more than this many times slower than
#: float32's in each of the first :data:`MIN_ROUNDS` rounds or more stops
#: being timed: it cannot win.
SLOWER = 1.5

#: Rounds a candidate is always timed in before it may stop (one slow round
#: on a loaded machine does not rule it out).
MIN_ROUNDS = 2

#: A candidate stops being timed once the relative spread of its timings
#: (their interquartile range over their median) is at most this fraction
#: of the margin: more rounds would not change the choice.
SETTLED = 0.25

@dataclass
class AutotuneResult:
    """What the probe of ``amp_enabled='auto'`` measured and chose (fitted
    attribute ``amp_autotune_``).

    Attributes
    ----------
    params : dict
      The chosen constructor parameters (``CHOICE_KEYS``):
      ``AmpNet(..., **params)`` trains as the ``'auto'`` net does.

    table : list of dict
      One row per candidate, in the order measured: ``params``,
      ``step_time_s`` (median seconds per step; None if not measured),
      ``healthy`` (None if not measured), ``grad_cosine`` (with float32's
      gradients), ``steps`` (training steps run, warm-up included),
      ``forward_ratio`` (AMP candidates: the screen's forward-pass time
      in their dtype over float32's, see
      ``ampnet.auto.screen``; absent where the screen did
      not run), ``gain`` and ``spread`` (an AMP candidate's gain over float32 and
      the noise of that measurement, fractions; None if not measured or
      for float32), ``chosen`` and ``reason`` (why it is unhealthy, not
      measured or not chosen, e.g. too noisy to decide; None for the
      chosen one). The float32 row's ``noisy`` is True when float32 was
      kept because the timings were too noisy to decide.

    device : str
      The device measured on.

    steps, warmup : int
      Timed and warm-up steps per candidate.

    margin, min_cosine : float
      The noise margin and the gradient-agreement threshold used.

    probe_s : float
      Wall-clock seconds of the whole probe (0 for a loaded choice).

    source : str
      ``'probe'``; ``'loaded'`` for a choice read from a saved file;
      ``'fallback'`` for float32 kept because no probe could run.

    note : str or None
      Why no probe ran (``source='fallback'``), or why no candidate was
      measured (the first training batch is not finite, or the fit is too
      short for the probe's budget).

    disturbed : str or None
      Why the timings may not hold for the fit (a busy machine), in
      words; None where nothing says so.

    budget : float or None
      ``amp_autotune__budget``: the most the probe may cost, as a share
      of the fit's float32 training time (None: no limit).

    fit_steps : int or None
      The fit's training steps that the budget is a share of (its epochs
      times the batches of the training split; None where unknown).

    budget_spent : float or None
      What the probe cost, in float32 training steps (None where it ran
      no training step).
    """

    params: dict[str, Any]
    table: list[dict[str, Any]] = field(default_factory=list)
    device: str = "cpu"
    steps: int = PARAMS["amp_autotune__steps"].default
    warmup: int = PARAMS["amp_autotune__warmup"].default
    margin: float = PARAMS["amp_autotune__margin"].default
    min_cosine: float = PARAMS["amp_autotune__min_cosine"].default
    probe_s: float = 0.0
    source: str = "probe"
    note: str | None = None
    disturbed: str | None = None
    budget: float | None = PARAMS["amp_autotune__budget"].default
    fit_steps: int | None = None
    budget_spent: float | None = None

    @property
    def chosen(self) -> str:
        """The chosen candidate, in words."""
        return label(self.params)

    def __str__(self) -> str:
        head = f"amp_enabled='auto' on {self.device}: chose {self.chosen}"
        if self.source == "fallback":
            return head + f" (no probe ran: {self.note})"
        if self.source != "probe" or not self.table:
            return head + " (a saved choice; no probe ran)"
        header = ("candidate", "step ms", "per-round vs float32", "steps", "healthy", "grad cos", "note")
        rows = []
        for row in self.table:
            time_s, healthy, cos = row.get("step_time_s"), row.get("healthy"), row.get("grad_cosine")
            gain, noise = row.get("gain"), row.get("spread")
            rows.append((
                label(row["params"]),
                "-" if time_s is None else f"{time_s * 1000:.2f}",
                "-" if gain is None else f"{-gain:+.1%} \u00b1{(noise or 0) / 2:.1%}",
                str(row.get("steps") or "-"),
                "-" if healthy is None else ("yes" if healthy else "no"),
                "-" if cos is None else f"{cos:.4f}",
                "chosen" if row.get("chosen") else (row.get("reason") or ""),
            ))
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [head]
        for row in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        measured = sum(r.get("step_time_s") is not None for r in self.table)
        total = sum(r.get("steps") or 0 for r in self.table)
        screened: dict[str, float] = {}
        for r in self.table:
            if r.get("forward_ratio") is not None:
                screened.setdefault(str(r["params"].get("amp_dtype")), r["forward_ratio"])
        if screened:
            found = " and ".join(f"{ratio:.1f}x float32's time in {dtype}" for dtype, ratio in screened.items())
            lines.append(
                f"Screen: before any training step was timed, a forward pass took {found}; a dtype over "
                f"{SCREEN_SLOWER:g}x float32's (slower here) is not timed, as it cannot pay off.")
        if not total:
            why = ": no copy built" if self.note else " (nothing left to compare with float32)"
            lines.append(f"Probe: no training step timed{why}, {self.probe_s:.2f} s.")
            if self.note:
                lines.append(self.note[:1].upper() + self.note[1:] + ".")
            return "\n".join(lines)
        lines.append(
            "step ms: the median of a candidate's timed steps. per-round vs float32: the median, over the "
            "rounds, of its step time relative to float32's (each step taken over a float32 forward pass "
            "timed just before it, which cancels changes of the machine's load), \u00b1 half the spread of "
            "both; it may differ from the ratio of the step ms column.")
        lines.append(
            f"Probe: {total} training steps of {measured} candidate{'s' if measured != 1 else ''}, one after the "
            f"other ({self.warmup} "
            f"warm-up + up to {self.steps} timed each, fewer once the timings settle), on the first "
            f"training batch, {self.probe_s:.2f} s. AMP is chosen only when faster than float32 by more than "
            f"{self.margin:.0%} and by more than the spread of its timings, with gradients agreeing with "
            f"float32's (cosine >= {self.min_cosine:g}); a more complex setting (pure over mixed, "
            "compensated over float32 masters, channels_last) only when faster than a simpler one by more "
            "than the spread of both."
        )
        if self.budget is not None and self.fit_steps is not None and self.budget_spent is not None:
            lines.append(
                f"Budget: the probe is budgeted at {self.budget:.0%} of this fit's {self.fit_steps} training steps "
                f"(amp_autotune__budget={self.budget:g}: about {self.budget * self.fit_steps:.1f} float32 steps); "
                f"it cost about {self.budget_spent:.1f}.")
        if self.note:
            lines.append(self.note[:1].upper() + self.note[1:] + ".")
        if self.table[0].get("noisy"):
            lines.append(
                "The timings were too noisy to decide (the machine is busy?): float32 was kept. Fix: "
                "pin a choice (amp_enabled=True or False), or probe longer (amp_autotune__steps).")
        if self.disturbed:
            lines.append(
                f"The machine was busy during the probe: {self.disturbed}. The choice is made once, for the "
                f"whole fit, so {self.chosen} may not be the fastest here. Fix: re-run the fit on a quiet "
                "machine, or pin a choice (amp_enabled=True or False).")
        return "\n".join(lines)


def label(params: Mapping[str, Any]) -> str:
    """``'float32'``, ``'bfloat16 mixed'``, ``'bfloat16 pure (compensated)'``,
    ``' + channels_last'`` where it applies."""
    if not params.get("amp_enabled"):
        text = "float32 (AMP off)"
    else:
        dtype = str(params.get("amp_dtype", "auto")).replace("torch.", "")
        text = f"{dtype} {params.get('amp_level', 'mixed')}"
        if params.get("amp_level") == "pure":
            masters = params.get("amp_master_weights", True)
            text += {True: " (float32 masters)", False: " (no masters)"}.get(masters, f" ({masters})")
    if params.get("memory_format") == "channels_last":
        text += " + channels_last"
    return text


# ---- candidates ---------------------------------------------------------------------


def _default_of(net: Any, name: str) -> bool:
    return is_default(net, name)


def probe_settings(net: Any) -> dict[str, Any]:
    """The probe's settings: the net's ``amp_autotune__*`` parameters
    (checked by the parameter table when they were set), the table's
    defaults for the others; without the prefix."""
    given = net.get_params_for("amp_autotune")
    return {name: check(f"amp_autotune__{name}", given.get(name, PARAMS[f"amp_autotune__{name}"].default))
            for name in SETTINGS}


def _optimizers(net: Any) -> list[torch.optim.Optimizer]:
    return [o for o in (net.__dict__.get(n + "_") for n in net._optimizers) if isinstance(o, torch.optim.Optimizer)]


def candidate_params(net: Any) -> list[tuple[dict[str, Any], str | None]]:
    """The candidates for an initialized ``'auto'`` net, as (constructor
    parameters, reason not to measure or None); float32 first."""
    device = torch.device(net.device or "cpu")
    own = {name: check(name, getattr(net, name)) for name in CHOICE_KEYS}
    module = net.__dict__.get("module_")
    has_module = isinstance(module, torch.nn.Module)
    four_d = has_module and any(t.dim() == 4 for t in [*module_root(module).parameters(), *module_root(module).buffers()])
    if own["memory_format"] == "channels_last":
        formats = ["channels_last"]
    else:
        formats = ["preserve", "channels_last"] if four_d else ["preserve"]
    out: list[tuple[dict[str, Any], str | None]] = [
        (pending_params(f), None) for f in formats
    ]
    dtype = parse_amp_dtype(own["amp_dtype"])
    if dtype is None:
        try:
            dtype = resolve_precision(True, "auto", device).compute_dtype
        except ValueError as exc:  # no autocast for this device
            out.append(({"amp_enabled": True, "amp_dtype": "auto"}, f"not measured: {exc}"))
            return out
    masters = own["amp_master_weights"]
    levels = ["pure"] if (own["amp_level"] == "pure" or not _default_of(net, "amp_master_weights")) else ["mixed", "pure"]
    amp = []
    for level in levels:
        if level == "mixed":
            amp += [{"amp_level": "mixed", "amp_master_weights": True, "memory_format": f} for f in formats]
            continue
        if not has_module:
            continue
        if _default_of(net, "amp_master_weights"):
            fit = all(isinstance(o, SUPPORTED_COMPENSATED) and (dtype != torch.float16 or isinstance(o, FLOAT16_SAFE_COMPENSATED))
                      for o in _optimizers(net))
            chosen_masters = "compensated" if fit and _optimizers(net) else True
        else:
            chosen_masters = masters
        amp.append({"amp_level": "pure", "amp_master_weights": chosen_masters, "memory_format": formats[0]})
    for extra in amp:
        params = {"amp_enabled": True, "amp_dtype": dtype_name(dtype), **extra}
        reason = None
        if device.type == "cpu" and dtype == torch.float16:
            reason = ("not measured: float16 on a CPU is emulated, many times slower than "
                      "float32")
        out.append((params, reason))
    return out


# ---- the choice ---------------------------------------------------------------------


def complexity(params: Mapping[str, Any]) -> int:
    """How far a candidate's settings are from the simplest, float32: 1 for
    AMP (mixed), 1 more for ``amp_level='pure'`` and 1 more again for
    compensated weights, 1 more for ``memory_format='channels_last'``. Of
    two healthy candidates within each other's noise, the less complex one
    is chosen (see :func:`choose`)."""
    score = 0
    if params.get("amp_enabled"):
        score += 1
        if params.get("amp_level") == "pure":
            score += 2 if params.get("amp_master_weights") == "compensated" else 1
    if params.get("memory_format") == "channels_last":
        score += 1
    return score


def choose(table: list[dict[str, Any]], margin: float) -> int:
    """Pick a row of ``table`` (rows as in :attr:`AutotuneResult.table`,
    the float32 baseline first); set each row's ``chosen`` and, for those
    not chosen, a ``reason``. Returns the chosen row's index.

    A row's gain over float32 is its ``gain`` (1 minus the median of its
    per-round time ratios to float32's), or, without one, ``1 -
    step_time_s / float32's``. A row other than the baseline qualifies when
    it is healthy and its gain exceeds both ``margin`` (a fraction) and its
    ``spread`` (the timings' noise; 0 when absent).

    Ties go to the simpler setting (:func:`complexity`): the qualifying rows
    are taken from the least to the most complex, and a more complex row
    replaces the one chosen so far only when its gain exceeds that row's by
    more than the spread of both (half of each row's spread, the ``±`` of
    the table: their intervals do not overlap); a row that does not gets
    the reason "within noise of <the simpler one>". The baseline wins when
    no row qualifies (its ``noisy`` is then True when a row was faster by
    more than ``margin`` but not by more than its spread: too noisy to
    decide).
    """
    base = table[0]
    base_time = base.get("step_time_s")

    def gain_of(row: dict[str, Any]) -> float | None:
        if row.get("gain") is not None:
            return float(row["gain"])
        if row.get("step_time_s") is None or not base_time or base_time <= 0:
            return None
        return 1 - row["step_time_s"] / base_time

    best, noisy, qualified, too_noisy = 0, False, [], []
    if base.get("healthy") and base_time is not None:
        for i, row in enumerate(table[1:], start=1):
            gain = gain_of(row)
            if not row.get("healthy") or row.get("step_time_s") is None or gain is None:
                continue
            noise = float(row.get("spread") or 0.0)
            if gain <= margin:
                row["reason"] = (f"{gain:.1%} faster than float32, within the {margin:.0%} noise margin: "
                                 "not worth it") if gain > 0 else None
            elif gain <= noise:
                too_noisy.append((i, gain, noise))
            else:
                qualified.append((complexity(row["params"]), -gain, i))
        noisy = bool(too_noisy)
        held: tuple[int, float] | None = None  # (row, gain) chosen so far
        for level, neg_gain, i in sorted(qualified):
            gain, row = -neg_gain, table[i]
            if held is None:
                held = (i, gain)
                continue
            j, held_gain = held
            both = (float(row.get("spread") or 0.0) + float(table[j].get("spread") or 0.0)) / 2
            if complexity(table[j]["params"]) < level and held_gain < gain <= held_gain + both:
                row["reason"] = (f"within noise of {label(table[j]['params'])} ({gain:.1%} against "
                                 f"{held_gain:.1%} faster than float32, spreads ±{both:.1%} together): "
                                 "the simpler setting is kept")
            elif gain > held_gain:
                held = (i, gain)
        best = held[0] if held is not None else 0
    elif not base.get("healthy"):
        healthy = [i for i, row in enumerate(table) if row.get("healthy") and row.get("step_time_s") is not None]
        best = min(healthy, key=lambda i: (table[i]["step_time_s"], i)) if healthy else 0
    for i, gain, noise in too_noisy:
        tail = ("too noisy to decide, float32 kept" if best == 0 else
                f"too noisy to count (it was not needed: {label(table[best]['params'])} won clearly)")
        table[i]["reason"] = (f"{gain:.1%} faster than float32, but its timings spread by {noise:.1%} "
                              f"across the rounds: {tail}")
    base["noisy"] = noisy and best == 0
    for i, row in enumerate(table):
        row["chosen"] = i == best
        if i == best:  # a reason why it was not measured stays (the data is not finite)
            row["reason"] = None if row.get("step_time_s") is not None else row.get("reason")
        elif not row.get("reason"):
            faster = table[best]["step_time_s"]
            row["reason"] = (f"slower than {label(table[best]['params'])}"
                             if faster is not None and row.get("step_time_s") is not None else "not chosen")
    return best
