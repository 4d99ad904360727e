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

import statistics
import time
from typing import Any, Callable, Mapping

import torch

from sklearn.base import clone

from ampnet.auto.enabled import (
    _EXTRA_WARMUP, MIN_ROUNDS, SLOWER, AutotuneResult, candidate_params, choose, probe_settings,
)
from ampnet.auto.screen import SCREEN_SLOWER, screen_dtypes
from ampnet._tree import has_nonfinite, iter_tensors
from ampnet.dtypes import LOW_PRECISION_DTYPES
from ampnet.exceptions import run_quietly
from ampnet.precision import module_root, remove_regions, remove_state_hooks
from ampnet.random_state import capture_random_state, kept_random_state

__all__ = ["run_probe", "probe_copy", "spread", "wall_timer", "CopyFailed"]


# ---- the probe ----------------------------------------------------------------------


class _Refused(Exception):
    """A candidate this net cannot train with (its settings are refused)."""


class _GradCapture:
    """A stand-in callback list entry: keeps the first finite gradients of
    the probe's training steps, as float32 by name."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None
        self.nonfinite = False

    def on_grad_computed(self, net: Any, named_parameters: Any, **kwargs: Any) -> None:
        grads = {n: p.grad.detach().float().flatten().clone() for n, p in named_parameters if p.grad is not None}
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        if not finite:
            self.nonfinite = True
        elif self.grads is None:
            self.grads = grads


def _cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    names = [n for n in a if n in b and a[n].numel() == b[n].numel()]
    if not names:
        return 1.0
    x = torch.cat([a[n].to(b[n].device) for n in names]).double()
    y = torch.cat([b[n] for n in names]).double()
    nx, ny = x.norm(), y.norm()
    if float(nx) == 0.0 and float(ny) == 0.0:
        return 1.0
    if float(nx) == 0.0 or float(ny) == 0.0:
        return 0.0
    return float(x @ y / (nx * ny))


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


def _first_batch(net: Any, X: Any, y: Any, **fit_params: Any) -> Any:
    """The first ``batch_size`` rows of the training split, not shuffled."""
    dataset, _ = net.get_split_datasets(X, y, **fit_params)
    kwargs = net.get_params_for("iterator_train")
    for key in ("shuffle", "generator", "sampler", "batch_sampler"):
        kwargs.pop(key, None)
    if "batch_size" not in kwargs:
        kwargs["batch_size"] = net.batch_size
    if kwargs["batch_size"] == -1:
        kwargs["batch_size"] = len(dataset)
    try:
        return next(iter(net.iterator_train(dataset, **kwargs)))
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
    the probe's batch, its losses, timed steps and first gradients.
    ``restore_rng`` puts the random streams back to where the probe started,
    before each step until the first finite gradients are captured."""

    def __init__(self, net: Any, params: dict[str, Any], batch: Any, restore_rng: Callable[[], None]) -> None:
        try:
            self.probe = probe_copy(net, params)
        except (ValueError, TypeError) as exc:  # settings this net cannot train with
            raise _Refused(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        self.params = params
        self.batch = batch
        self.restore_rng = restore_rng
        self.capture = _GradCapture()
        self.probe.__dict__["callbacks_"] = [("ampnet_autotune", self.capture)]
        self.probe.history.new_epoch()
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []
        self.rounds: list[int] = []  # the round of each timed step

    def step(self) -> None:
        if self.capture.grads is None:  # the health step: the same dropout masks as float32's
            self.restore_rng()
        self.probe.history.new_batch()
        self.losses.append(self.probe.train_step(self.batch)["loss"].detach())

    def warm_up(self, warmup: int) -> None:
        """``warmup`` untimed steps, and up to ``_EXTRA_WARMUP`` more while a
        loss-scaled candidate has had no finite gradients yet."""
        i = 0
        while i < warmup or (self.capture.nonfinite and self.capture.grads is None and i < warmup + _EXTRA_WARMUP
                             and self.probe.precision_.scaling):
            self.step()
            i += 1

    def time_step(self, timer: Callable[[dict, Callable[[], Any]], float], round_: int) -> None:
        self.times.append(float(timer(dict(self.params), self.step)))
        self.rounds.append(round_)

    def health(self) -> tuple[bool, str | None]:
        finite = bool(torch.isfinite(torch.stack([loss.float().reshape(-1)[0] for loss in self.losses])).all())
        if not finite:
            return False, "unhealthy: the loss is not finite"
        if self.capture.grads is None and self.capture.nonfinite:
            return False, "unhealthy: the gradients are not finite"
        return True, None


def _ratios(candidate: _Candidate, baseline: _Candidate) -> list[float]:
    """The candidate's step time over float32's, per round both were timed in."""
    base = dict(zip(baseline.rounds, baseline.times))
    return [t / base[r] for r, t in zip(candidate.rounds, candidate.times) if base.get(r, 0) > 0]


def spread(ratios: list[float]) -> float:
    """The noise of a candidate's timings relative to float32's: the
    interquartile range of its per-round ratios (0 with fewer than 2 rounds)."""
    if len(ratios) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q3 - q1


def _error_text(exc: BaseException) -> str:
    return f"unhealthy: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_probe(net: Any, X: Any, y: Any = None, **fit_params: Any) -> AutotuneResult:
    """Measure the candidates of an initialized ``'auto'`` net (see
    :mod:`ampnet.auto.enabled`) and return the result; nothing of ``net``
    changes, nor do the random streams. ampnet's warnings from the copies
    are dropped.

    Raises
    ------
    CopyFailed
      The net cannot be copied (see :func:`probe_copy`).
    """
    return run_quietly(_run_probe, net, X, y, **fit_params)


def _run_probe(net: Any, X: Any, y: Any = None, **fit_params: Any) -> AutotuneResult:
    settings = probe_settings(net)
    device = torch.device(net.device or "cpu")
    timer = wall_timer(device)
    started = time.perf_counter()
    table: list[dict[str, Any]] = []
    live: list[tuple[dict[str, Any], _Candidate]] = []  # rows still timed, float32's first
    note = None
    with kept_random_state():
        restore_rng = capture_random_state()
        try:
            note = _measure(net, X, y, fit_params, settings, timer, restore_rng, table, live)
        finally:
            live.clear()
    best = choose(table, settings["margin"])
    return AutotuneResult(note=note,
        params=dict(table[best]["params"]), table=table, device=str(device),
        steps=settings["steps"], warmup=settings["warmup"], margin=settings["margin"],
        min_cosine=settings["min_cosine"], probe_s=time.perf_counter() - started,
    )


def _measure(net: Any, X: Any, y: Any, fit_params: dict[str, Any], settings: dict[str, Any],
             timer: Callable[[dict, Callable[[], Any]], float], restore_rng: Callable[[], None],
             table: list[dict[str, Any]], live: list[tuple[dict[str, Any], _Candidate]]) -> str | None:
    """Fill ``table`` (one row per candidate) and ``live`` (the candidates
    built, float32's first); return why nothing was measured where it is
    the data's fault (the result's ``note``), else None."""
    batch = _first_batch(net, X, y, **fit_params)
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
    # 0. float32's copy first; on it, a forward pass per low-precision dtype against
    # float32's: leave out the dtypes that cannot pay off here (emulated ones)
    first = next(i for i, (p, skip) in enumerate(candidates) if not skip)
    baseline = _Candidate(net, candidates[first][0], batch, restore_rng)
    screen = screen_dtypes(baseline.probe, batch, measurable, timer, **fit_params)
    measured = [p for p in measurable
                if not (p["amp_enabled"] and screen.get(str(p["amp_dtype"]), 0.0) > SCREEN_SLOWER)]
    # 1. a copy of each candidate, warmed up (float32's first); none more when the
    # screen left float32 alone
    for row, (params, skip) in zip(rows, candidates):
        if params["amp_enabled"] and str(params["amp_dtype"]) in screen:
            row["forward_ratio"] = screen[str(params["amp_dtype"])]
        if skip:
            continue
        if params not in measured:
            row["reason"] = (
                f"not measured: its forward pass took {row['forward_ratio']:.1f}x as long as float32's "
                f"(over {SCREEN_SLOWER:g}x: it cannot pay off here)")
            continue
        if len(measured) < 2:
            continue
        is_baseline = not live
        try:
            candidate = baseline if is_baseline else _Candidate(net, params, batch, restore_rng)
            candidate.warm_up(settings["warmup"])
        except _Refused as exc:
            if is_baseline:
                raise exc.__cause__ from None
            row["reason"] = f"not possible: {exc}"
            continue
        except Exception as exc:
            if is_baseline:
                raise
            row.update(healthy=False, reason=_error_text(exc))
            continue
        live.append((row, candidate))
    del baseline
    # 2. timed in interleaved rounds (float32, mixed, pure, float32, ...), so that a
    # change of the machine's load hits every candidate alike
    timed = list(live)
    for round_ in range(settings["steps"]):
        for row, candidate in list(timed):
            try:
                candidate.time_step(timer, round_)
            except Exception as exc:
                if candidate is live[0][1]:
                    raise
                row.update(healthy=False, reason=_error_text(exc))
                timed.remove((row, candidate))
        if round_ + 1 >= MIN_ROUNDS:  # clearly slower than float32 in every round: it cannot win
            timed = [(row, c) for row, c in timed
                     if c is live[0][1] or min(_ratios(c, live[0][1]), default=0.0) <= SLOWER]
    # 3. times, health and agreement with float32's gradients
    base = live[0][1] if live else None
    reference = base.capture.grads if base else None
    for row, candidate in live:
        if row["healthy"] is False:  # failed while timed
            row["steps"] = len(candidate.losses)
            continue
        healthy, reason = candidate.health()
        row.update(step_time_s=statistics.median(candidate.times), healthy=healthy, reason=reason,
                   steps=len(candidate.losses))
        if candidate is base:
            row["grad_cosine"] = 1.0 if reference is not None else None
            continue
        ratios = _ratios(candidate, base)
        if ratios:
            row.update(gain=1 - statistics.median(ratios), spread=spread(ratios))
        if healthy and reference is not None and candidate.capture.grads is not None:
            cos = _cosine(candidate.capture.grads, reference)
            row["grad_cosine"] = cos
            if cos < settings["min_cosine"]:
                row.update(healthy=False, reason=(
                    f"unhealthy: gradient cosine similarity with float32 {cos:.4f} < "
                    f"{settings['min_cosine']:g}"))
    return None
