"""The probe of ``amp_enabled='auto'``: a copy of the net per candidate
(:func:`probe_copy`), warmed up and timed in interleaved rounds on the first
training batch, after the screen (:mod:`ampnet.auto.screen`); the
candidates, the choice and the result are in :mod:`ampnet.auto.enabled`,
whose docstring describes the method and its cost.

Nothing of the user's net is touched: every forward pass, the screen's
included, runs on copies; the random streams are put back
(:func:`ampnet.random_state.kept_random_state`), and every candidate's
health step starts from the same random state, so that dropout draws the
same masks for each and the gradients differ by precision only. ampnet's
own warnings raised by the copies are dropped (:func:`ampnet.exceptions.run_quietly`,
in this thread only: the process's warning filters are left alone)."""

from __future__ import annotations

import gc
import statistics
import time
import weakref
from typing import Any, Callable, Mapping

import torch

from sklearn.base import clone

from ampnet.auto.enabled import (
    _EXTRA_WARMUP, MIN_ROUNDS, SETTLED, SLOWER, AutotuneResult, candidate_params, choose, complexity,
    probe_settings,
)
from ampnet.auto.budget import FORWARD_SHARE, Budget
from ampnet.auto.screen import SCREEN_SLOWER, float32_forward, screen_dtypes
from ampnet._tree import has_nonfinite, iter_tensors
from ampnet.dtypes import LOW_PRECISION_DTYPES
from ampnet.exceptions import run_quietly
from ampnet.precision import module_root, remove_regions, remove_state_hooks
from ampnet.random_state import capture_random_state, kept_random_state

__all__ = ["run_probe", "probe_copy", "spread", "wall_timer", "cpu_clocks", "CopyFailed"]


# ---- the probe ----------------------------------------------------------------------


class _Refused(Exception):
    """A candidate this net cannot train with (its settings are refused)."""


class _GradCapture:
    """A stand-in callback list entry: at the first training step whose
    gradients are all finite, either keeps them as float32 by name (the
    baseline's, ``reference=None``) or computes their cosine similarity
    with ``reference`` on the fly (an AMP candidate's: no copy of its
    gradients is kept). Later steps cost nothing."""

    def __init__(self, reference: Mapping[str, torch.Tensor] | None = None) -> None:
        self.reference = reference
        self.grads: dict[str, torch.Tensor] | None = None
        self.cosine: float | None = None
        self.captured = False
        self.nonfinite = False

    def on_grad_computed(self, net: Any, named_parameters: Any, **kwargs: Any) -> None:
        if self.captured:
            return
        named = [(n, p.grad) for n, p in named_parameters if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for _, g in named):
            self.nonfinite = True
            return
        self.captured = True
        if self.reference is None:
            self.grads = {n: g.detach().float().flatten().clone() for n, g in named}
            return
        dot = nx = ny = 0.0  # per parameter in float32 (no float64 copies), summed in Python floats
        common = False
        for n, g in named:
            ref = self.reference.get(n)
            if ref is None or ref.numel() != g.numel():
                continue
            common = True
            x = g.detach().flatten().to(device=ref.device, dtype=torch.float32)
            dot, nx, ny = dot + float(x @ ref), nx + float(x @ x), ny + float(ref @ ref)
        if not common or (nx == 0.0 and ny == 0.0):
            self.cosine = 1.0
        elif nx == 0.0 or ny == 0.0:
            self.cosine = 0.0
        else:
            self.cosine = dot / (nx ** 0.5 * ny ** 0.5)


def wall_timer(device: torch.device) -> Callable[[dict, Callable[[], Any]], float]:
    """The default timer: wall-clock seconds of one step, synchronized on CUDA."""

    def timer(params: dict, step: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return timer


def cpu_clocks() -> tuple[float, float]:
    """(wall-clock seconds, this thread's CPU seconds) now. The probe reads
    both around its timed steps to tell a busy machine (the thread that
    runs the steps gets the CPU much less than the wall clock runs, see
    :data:`BUSY_CPU_SHARE`); the tests replace it."""
    return time.perf_counter(), time.thread_time()


#: A probe whose timed steps got less than this share of the wall clock as
#: the stepping thread's CPU time ran on a busy machine. (The main thread
#: computes its share of every intra-op parallel region and sleeps only
#: while waiting for a descheduled worker, so torch's own threads do not
#: make a quiet machine look busy; a GPU's waits do, so only CPU probes are
#: judged.)
BUSY_CPU_SHARE = 0.5

#: Timed steps shorter than this in all are not judged (the scheduler's granularity).
BUSY_MIN_S = 0.2

#: The rounds' float32 forward passes this many times slower (or faster)
#: than the screen's: the machine's load changed during the probe.
DRIFT = 2.5

#: Forward passes shorter than this are not compared (caches and the
#: allocator alone move them by 2x on a quiet machine).
DRIFT_MIN_S = 2e-3


def _first_batch(net: Any, X: Any, y: Any, epochs: int | None = None, **fit_params: Any) -> tuple[Any, int | None]:
    """The first ``batch_size`` rows of the training split, not shuffled,
    and the fit's training steps: ``epochs`` (``max_epochs`` when None)
    times the batches of the training split (None where its length is
    unknown, e.g. an iterable dataset)."""
    dataset, _ = net.get_split_datasets(X, y, **fit_params)
    kwargs = net.get_params_for("iterator_train")
    for key in ("shuffle", "generator", "sampler", "batch_sampler"):
        kwargs.pop(key, None)
    if "batch_size" not in kwargs:
        kwargs["batch_size"] = net.batch_size
    if kwargs["batch_size"] == -1:
        kwargs["batch_size"] = len(dataset)
    try:
        rows = len(dataset)
    except TypeError:
        rows = None
    epochs = net.max_epochs if epochs is None else epochs
    fit_steps = None
    if rows is not None and isinstance(kwargs["batch_size"], int) and kwargs["batch_size"] > 0:
        batches = -(-rows // kwargs["batch_size"]) if not kwargs.get("drop_last") else rows // kwargs["batch_size"]
        fit_steps = max(int(epochs), 0) * batches
    try:
        return next(iter(net.iterator_train(dataset, **kwargs))), fit_steps
    except StopIteration:
        raise ValueError(
            "amp_enabled='auto' needs at least one training sample to measure, but the "
            "training split is empty. Fix: pass training data, or set amp_enabled to True or False."
        ) from None


#: The reason of every candidate when the probe's batch holds NaN or inf.
NONFINITE_BATCH = (
    "not measured: the first training batch holds NaN or inf, so every candidate's loss would be "
    "NaN whatever its precision (the data is not finite). Fix: clean the data (e.g. drop or impute "
    "the NaN/inf rows), or pin amp_enabled=True or False")


def _refuse_low_precision_inputs(batch: Any) -> None:
    """Refuse a batch whose inputs are float16 or bfloat16: float32, the
    baseline that ``'auto'`` measures and may choose, cannot take them."""
    inputs = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch
    low = sorted({str(t.dtype).replace("torch.", "") for t in iter_tensors(inputs)
                  if t.dtype in LOW_PRECISION_DTYPES})
    if low:
        raise ValueError(
            f"amp_enabled='auto' got {' and '.join(low)} inputs, which float32 (the baseline it measures, "
            "and may choose) cannot take: torch refuses them with float32 weights. Fix: pass float32 "
            "inputs (e.g. X.astype(np.float32)), or pin amp_enabled=True, which runs them under autocast.")


class CopyFailed(Exception):
    """The net could not be copied for the probe (a module or criterion that
    cannot be deep-copied: one holding a lock or an open file)."""


#: What a probe copy sets differently from the net: it trains one batch at a
#: time, alone, silently, in this process.
_COPY_OVERRIDES = {"callbacks": [], "verbose": 0, "distributed": False, "gradient_accumulation_steps": 1,
                   "warm_start": False}


def probe_copy(net: Any, params: dict[str, Any]) -> Any:
    """A net that trains copies of ``net``'s modules with the precision
    ``params``: ``sklearn.base.clone(net)`` with ``params`` set (a pinned
    precision, so it never probes itself), no callbacks, no output, no data
    parallelism and a step per batch, initialized, then given ``net``'s
    module and criterion weights. ``net`` is unchanged, and so are the
    random streams.

    Raises
    ------
    CopyFailed
      ``net``'s parameters cannot be deep-copied (``clone`` deep-copies a
      module or criterion passed as an instance).
    ValueError, TypeError
      ``params`` are settings this net cannot train with.
    """
    # sklearn's clone, parameter by parameter, without the user's callbacks (the
    # probe runs none; a callback that does not clone must not stop it)
    params_ = {**net.get_params(deep=False), **_COPY_OVERRIDES}
    try:
        probe = type(net)(**{name: clone(value, safe=False) for name, value in params_.items()})
    except (TypeError, AttributeError, RuntimeError) as exc:  # copy.deepcopy's errors
        raise CopyFailed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    for value in probe.get_params(deep=False).values():
        if isinstance(value, torch.nn.Module):  # a copy of an instance that carried the net's layout
            remove_regions(module_root(value))
            remove_state_hooks(module_root(value))
    with kept_random_state():
        probe.set_params(**_COPY_OVERRIDES, **params)
        probe.initialize()
    for name in [*net._modules, *net._criteria]:
        source, target = net.__dict__.get(name + "_"), probe.__dict__.get(name + "_")
        if isinstance(source, torch.nn.Module) and isinstance(target, torch.nn.Module):
            module_root(target).load_state_dict(module_root(source).state_dict())
    probe.amp_step_state_.check_loss_inputs = False  # the net's own first batch checks them
    return probe


class _Candidate:
    """A candidate in the probe: a copy of the net trained with ``params`` on
    the probe's batch, its losses, timed steps (each after a timed float32
    forward pass, the round's reference) and its first gradients (kept for
    the baseline, ``reference=None``; else compared with ``reference`` on
    the fly). ``restore_rng`` puts the random streams back to where the
    probe started, before each step until the first finite gradients are
    captured."""

    def __init__(self, net: Any, params: dict[str, Any], batch: Any, restore_rng: Callable[[], None],
                 reference: Mapping[str, torch.Tensor] | None = None) -> None:
        try:
            self.probe = probe_copy(net, params)
        except (ValueError, TypeError) as exc:  # settings this net cannot train with
            raise _Refused(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        self.params = params
        self.batch = batch
        self.restore_rng = restore_rng
        self.capture = _GradCapture(reference)
        self.probe.__dict__["callbacks_"] = [("ampnet_autotune", self.capture)]
        self.probe.history.new_epoch()
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []
        self.refs: list[float] = []  # the round's float32 forward pass, timed just before each step
        self.wall = self.cpu = 0.0  # real seconds of the timed steps: wall clock, this thread's CPU

    def step(self) -> None:
        if not self.capture.captured:  # the health step: the same dropout masks as float32's
            self.restore_rng()
        self.probe.history.new_batch()
        self.losses.append(self.probe.train_step(self.batch)["loss"].detach())

    def warm_up(self, warmup: int) -> None:
        """``warmup`` untimed steps, and up to ``_EXTRA_WARMUP`` more while a
        loss-scaled candidate has had no finite gradients yet."""
        i = 0
        while i < warmup or (self.capture.nonfinite and not self.capture.captured and i < warmup + _EXTRA_WARMUP
                             and self.probe.precision_.scaling):
            self.step()
            i += 1

    def time_step(self, timer: Callable[[dict, Callable[[], Any]], float], reference: float) -> None:
        wall, cpu = cpu_clocks()
        self.times.append(float(timer(dict(self.params), self.step)))
        now_wall, now_cpu = cpu_clocks()
        self.wall, self.cpu = self.wall + now_wall - wall, self.cpu + now_cpu - cpu
        self.refs.append(reference)

    def per_reference(self) -> list[float]:
        """Each timed step over its round's float32 forward pass."""
        return [t / r for t, r in zip(self.times, self.refs) if r > 0]

    def health(self) -> tuple[bool, str | None]:
        finite = bool(torch.isfinite(torch.stack([loss.float().reshape(-1)[0] for loss in self.losses])).all())
        if not finite:
            return False, "unhealthy: the loss is not finite"
        if not self.capture.captured and self.capture.nonfinite:
            return False, "unhealthy: the gradients are not finite"
        return True, None

    def release(self) -> None:
        """Free the copy's gradients and optimizer state (the baseline's
        module stays: its forward pass is the rounds' reference)."""
        for name in self.probe._optimizers:
            opt = self.probe.__dict__.get(name + "_")
            if isinstance(opt, torch.optim.Optimizer):
                opt.state.clear()
        for name in self.probe._modules:
            module = self.probe.__dict__.get(name + "_")
            if isinstance(module, torch.nn.Module):
                module.zero_grad(set_to_none=True)


def spread(ratios: list[float]) -> float:
    """The noise of a list of timing ratios: their interquartile range (0
    with fewer than 2)."""
    if len(ratios) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q3 - q1


def _relative_spread(values: list[float]) -> float:
    middle = statistics.median(values) if values else 0.0
    return spread(values) / middle if middle > 0 else 0.0


def _time_rounds(candidate: _Candidate, timer: Callable[[dict, Callable[[], Any]], float],
                 reference: Callable[[], float], settings: Mapping[str, Any], base_level: float | None,
                 budget: Budget, next_ratio: float | None = None) -> None:
    """Up to ``settings['steps']`` rounds of (float32 forward pass, timed step);
    after :data:`MIN_ROUNDS` rounds, stop once the candidate is clearly slower
    than float32 in every round (:data:`SLOWER`), its timings have settled
    (their relative spread at most :data:`SETTLED` x the margin), or one
    more round would overrun the probe's budget or leave no room for the
    next candidate (whose steps take about ``next_ratio`` x float32's)."""
    for k in range(settings["steps"]):
        if k >= MIN_ROUNDS and not budget.room_for_round(candidate, next_ratio):
            return
        candidate.time_step(timer, reference())
        if k + 1 < MIN_ROUNDS:
            continue
        levels = candidate.per_reference()
        if base_level and levels and min(levels) / base_level > SLOWER:
            return
        if levels and _relative_spread(levels) <= SETTLED * settings["margin"]:
            return


def _record(row: dict[str, Any], candidate: _Candidate, settings: Mapping[str, Any],
            base_level: float | None, base_spread: float) -> None:
    """``row``'s time, health, gain over float32 (None ``base_level``: the
    baseline itself) and gradient agreement."""
    healthy, reason = candidate.health()
    row.update(step_time_s=statistics.median(candidate.times) if candidate.times else None, healthy=healthy,
               reason=reason, steps=len(candidate.losses))
    if base_level is None:
        row["grad_cosine"] = 1.0 if candidate.capture.grads is not None else None
        return
    levels = [v / base_level for v in candidate.per_reference()]
    if levels:
        row.update(gain=1 - statistics.median(levels), spread=spread(levels) + base_spread)
    cos = candidate.capture.cosine
    if healthy and cos is not None:
        row["grad_cosine"] = cos
        if cos < settings["min_cosine"]:
            row.update(healthy=False, reason=(
                f"unhealthy: gradient cosine similarity with float32 {cos:.4f} < {settings['min_cosine']:g}"))


def _error_text(exc: BaseException) -> str:
    return f"unhealthy: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_probe(net: Any, X: Any, y: Any = None, epochs: int | None = None, **fit_params: Any) -> AutotuneResult:
    """Measure the candidates of an initialized ``'auto'`` net (see
    :mod:`ampnet.auto.enabled`) and return the result; nothing of ``net``
    changes, nor do the random streams. ampnet's warnings from the copies
    are dropped. ``epochs``: the epochs of the fit about to run
    (``max_epochs`` when None), for the probe's budget.

    Raises
    ------
    CopyFailed
      The net cannot be copied (see :func:`probe_copy`).
    """
    return run_quietly(_run_probe, net, X, y, epochs, **fit_params)


def _run_probe(net: Any, X: Any, y: Any = None, epochs: int | None = None, **fit_params: Any) -> AutotuneResult:
    settings = probe_settings(net)
    device = torch.device(net.device or "cpu")
    timer = wall_timer(device)
    started = time.perf_counter()
    table: list[dict[str, Any]] = []
    clocks: dict[str, float] = {}
    spent: dict[str, Any] = {}
    with kept_random_state():
        restore_rng = capture_random_state()
        note = _measure(net, X, y, epochs, fit_params, settings, timer, restore_rng, table, clocks, spent)
    best = choose(table, settings["margin"])
    return AutotuneResult(note=note,
        params=dict(table[best]["params"]), table=table, device=str(device),
        steps=settings["steps"], warmup=settings["warmup"], margin=settings["margin"],
        min_cosine=settings["min_cosine"], probe_s=time.perf_counter() - started,
        disturbed=_disturbed(clocks, device), budget=settings["budget"], fit_steps=spent.get("fit_steps"),
        budget_spent=spent.get("spent"),
    )


def _disturbed(clocks: Mapping[str, float], device: torch.device) -> str | None:
    """Why the probe's timings may not hold for the fit (the machine was
    busy), in words; None where nothing says so."""
    wall, cpu = clocks.get("wall", 0.0), clocks.get("cpu", 0.0)
    if device.type == "cpu" and wall >= BUSY_MIN_S and cpu < BUSY_CPU_SHARE * wall:
        return (f"the thread that ran the timed steps got the CPU only {cpu / wall:.0%} of their wall-clock time "
                "(another process was competing for the cores)")
    screen, rounds = clocks.get("screen"), clocks.get("rounds")
    if not screen or screen < DRIFT_MIN_S:
        return None  # too short to judge: a small forward pass varies with the caches alone
    if rounds and not 1 / DRIFT <= rounds / screen <= DRIFT:
        return (f"the same float32 forward pass took {rounds / screen:.1f}x as long during the timed rounds as "
                "in the screen just before them (the machine's load changed during the probe)")
    return None


#: The fix of a probe cut short by its budget.
_BUDGET_FIX = ("Fix: pin amp_enabled=True to train with AMP, or pass a larger amp_autotune__budget (or None, to "
               "measure whatever the fit's length) at construction or with set_params before the next fit")


def _too_short(budget: Budget) -> str:
    return (f"this fit is too short for measuring to pay off: the cheapest probe takes about "
            f"{budget.minimal():.1f} float32 training steps, over {budget.describe()}, so float32 is kept "
            f"without measuring. {_BUDGET_FIX}")


def _spent_before_amp(budget: Budget) -> str:
    return (f"the probe's budget ({budget.describe()}) was spent on float32's own measurement and the screen "
            f"({budget.spent:.1f} float32 steps), before any AMP candidate was timed: float32 is kept without a "
            f"verdict on AMP. {_BUDGET_FIX}")


def _measure(net: Any, X: Any, y: Any, epochs: int | None, fit_params: dict[str, Any], settings: dict[str, Any],
             timer: Callable[[dict, Callable[[], Any]], float], restore_rng: Callable[[], None],
             table: list[dict[str, Any]], clocks: dict[str, float], spent: dict[str, Any]) -> str | None:
    """Fill ``table`` (one row per candidate), ``clocks`` (the timed
    steps' wall and CPU seconds, the screen's and the rounds' float32
    forward pass) and ``spent`` (the fit's steps and the float32 steps the
    probe spent); return why nothing was measured where it is the data's
    fault or the fit is too short (the result's ``note``), else None.

    One candidate after the other, float32's first, then from the simplest
    to the most complex (:func:`ampnet.auto.enabled.complexity`) while the
    budget lasts: a copy is built, warmed up and timed, each timed step
    after a timed float32 forward pass (the round's reference), then freed
    before the next is built; float32's copy keeps only its module (for
    the reference) and its first gradients."""
    batch, fit_steps = _first_batch(net, X, y, epochs, **fit_params)
    spent["fit_steps"] = fit_steps
    _refuse_low_precision_inputs(batch)
    candidates = candidate_params(net)
    measurable = [p for p, skip in candidates if not skip]
    rows = []
    for params, skip in candidates:
        rows.append({"params": params, "step_time_s": None, "healthy": None, "grad_cosine": None,
                     "steps": 0, "gain": None, "spread": None, "reason": skip})
    table.extend(rows)
    if has_nonfinite(batch):  # every candidate's loss would be NaN: the data's, not the precision's
        for row in rows:
            row["reason"] = NONFINITE_BATCH
        return NONFINITE_BATCH.split(": ", 1)[1]
    if len(measurable) < 2:  # float32 alone: nothing to compare it with
        return None
    budget = Budget(settings["budget"], fit_steps, settings["warmup"])
    if budget.too_short():  # no copy built, nothing run
        spent["spent"] = 0.0
        for row, (params, skip) in zip(rows, candidates):
            if not skip:
                row["reason"] = "not measured: the fit is too short for the probe's budget"
        return _too_short(budget)
    # 0. float32's copy first; on it, a forward pass per low-precision dtype against
    # float32's: leave out the dtypes that cannot pay off here (emulated ones)
    first = next(i for i, (p, skip) in enumerate(candidates) if not skip)
    baseline = _Candidate(net, candidates[first][0], batch, restore_rng)
    screen, screen_s, budget.screen_s = screen_dtypes(baseline.probe, batch, measurable, timer, **fit_params)
    measured = [p for p in measurable
                if not (p["amp_enabled"] and screen.get(str(p["amp_dtype"]), 0.0) > SCREEN_SLOWER)]
    for row, (params, skip) in zip(rows, candidates):
        if params["amp_enabled"] and str(params["amp_dtype"]) in screen:
            row["forward_ratio"] = screen[str(params["amp_dtype"])]
        if not skip and params not in measured:
            row["reason"] = (
                f"not measured: its forward pass took {row['forward_ratio']:.1f}x as long as float32's "
                f"(over {SCREEN_SLOWER:g}x: it cannot pay off here)")
    if len(measured) < 2:  # the screen left float32 alone: no copy more, nothing timed
        spent["spent"] = FORWARD_SHARE * budget.screen_s / screen_s if screen_s else None
        return None
    # 1. the rounds' reference: float32's forward pass, timed before each timed step, so
    # that a change of the machine's load between (and within) the candidates cancels out
    forward = float32_forward(baseline.probe, batch, **fit_params)
    ref_params = {**candidates[first][0], "autotune_screen": True}

    def reference() -> float:
        return float(timer(dict(ref_params), forward)) if forward is not None else 1.0

    base_level: float | None = None  # float32's median step over its reference
    base_spread = 0.0
    reference_grads = None
    all_refs: list[float] = []
    cut = False  # a candidate was left out for the budget
    order = [i for i in sorted(range(len(candidates)), key=lambda i: (i != first, complexity(candidates[i][0])))
             if not candidates[i][1] and candidates[i][0] in measured]
    for n, i in enumerate(order):
        row, params = rows[i], candidates[i][0]
        next_ratio = (rows[order[n + 1]].get("forward_ratio") or 1.0) if n + 1 < len(order) else None
        is_baseline = base_level is None
        if not is_baseline and not budget.room_for(row.get("forward_ratio") or 1.0,
                                                   statistics.median(all_refs) if all_refs else 0.0):
            row["reason"] = f"not measured: the probe's budget was spent ({budget.describe()})"
            cut = True
            continue
        candidate = None
        try:
            candidate = baseline if is_baseline else _Candidate(net, params, batch, restore_rng, reference_grads)
            candidate.warm_up(settings["warmup"])
            _time_rounds(candidate, timer, reference, settings, base_level, budget, next_ratio)
        except _Refused as exc:
            if is_baseline:
                raise exc.__cause__ from None
            row["reason"] = f"not possible: {exc}"
        except Exception as exc:
            if is_baseline:
                raise
            row.update(healthy=False, reason=_error_text(exc), steps=len(candidate.losses) if candidate else 0)
        else:  # 2. time, health and agreement with float32's first gradients
            _record(row, candidate, settings, base_level, base_spread)
            if is_baseline:
                levels = baseline.per_reference()
                base_level, base_spread = statistics.median(levels), _relative_spread(levels)
                reference_grads = baseline.capture.grads
        finally:
            if candidate is not None:
                budget.done(candidate, baseline=is_baseline)
                clocks["wall"] = clocks.get("wall", 0.0) + candidate.wall
                clocks["cpu"] = clocks.get("cpu", 0.0) + candidate.cpu
                all_refs += candidate.refs
                candidate.release()
                if candidate is not baseline:  # freed before the next copy is built
                    gone = weakref.ref(candidate.probe)
                    candidate = None
                    if gone() is not None:  # held by a reference cycle
                        gc.collect()
    spent["spent"] = budget.spent
    clocks["screen"] = screen_s or 0.0
    clocks["rounds"] = statistics.median(all_refs) if all_refs and forward is not None else 0.0
    if cut and not any(rows[i].get("steps") for i in order if i != first):
        return _spent_before_amp(budget)
    return None
