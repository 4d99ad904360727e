"""The auto wing: ``amp_enabled='auto'`` and ``amp_fp32_modules='auto'``.

This package's one door. The net calls :func:`resolve` at the start of each
fit (it does nothing once both choices are made), :func:`train_step` for
each training micro-batch, :func:`end_epoch` and :func:`end_fit`;
persistence calls :func:`write_choices` and :func:`plan_choices`.

``amp_enabled='auto'`` takes, in this order, the choice of the checkpoint a
``LoadInitState`` resumes, the stored one (:mod:`ampnet.auto.cache`), the
device's where mixed precision cannot pay off or the fit is too short to
measure; else it measures in the fit's first steps (:mod:`ampnet.auto.trial`):
the net starts in mixed precision and its float32 steps pause autocast.
Once decided, a float32 choice switches the net in place
(:func:`ampnet.auto.switching.switch_in_fit`), and the choice is stored.

- :mod:`ampnet.auto.enabled`: candidates, :class:`AutotuneResult`;
- :mod:`ampnet.auto.trial`: the measurement and the watch over the choice;
- :mod:`ampnet.auto.cache`: the on-disk memory;
- :mod:`ampnet.auto.cache_command`: ``python -m ampnet cache [--clear]`` (:func:`manage_cache`);
- :mod:`ampnet.auto.fp32_modules`: ``amp_fp32_modules='auto'``'s probe;
- :mod:`ampnet.auto.switching`: a net switched to a choice;
- :mod:`ampnet.auto.unswitchable`: what ``'auto'`` may choose, checked (:func:`check_choosable`);
- :mod:`ampnet.auto.stale_choice`: the choice dropped where a change makes it stale (:func:`drop_stale_choice`);
- :mod:`ampnet.auto.saved`: both choices in checkpoints.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import torch
from skorch.callbacks import LoadInitState as SkorchLoadInitState

from ampnet.auto import cache
from ampnet.auto.cache_command import main as manage_cache
from ampnet.auto.enabled import (
    AutotuneResult, candidate_params, device_choice, duration, label, settings_of, table_of,
)
from ampnet.auto.fp32_modules import resolve_fp32_modules, split_params
from ampnet.auto.saved import enabled_choice, fp32_choice, plan_choices, write_choices
from ampnet.auto.stale_choice import drop_stale_choice
from ampnet.auto.switching import apply_choice, choice_problem, switch_in_fit
from ampnet.auto.unswitchable import check_choosable
from ampnet.auto.trial import MIN_PAIRS, Trial
from ampnet.exceptions import amp_warn
from ampnet.io.layout import checkpoint_files
from ampnet.io.state_files import read_params_file
from ampnet.config.net_state import all_or_nothing
from ampnet.config.params import is_auto
from ampnet.utils.random_state import kept_random_state

__all__ = ["resolve", "train_step", "end_epoch", "end_fit", "AutotuneResult", "write_choices", "plan_choices",
           "manage_cache", "check_choosable", "drop_stale_choice", "duration"]


def resolve(net: Any, X: Any, y: Any = None, **fit_params: Any) -> None:
    """Make the choices that this fit of ``net`` is waiting for:
    ``amp_enabled='auto'``'s (or start measuring it), then
    ``amp_fp32_modules='auto'``'s (which exists only once AMP is on)."""
    if not (_enabled_pending(net) or _fp32_pending(net)):
        return
    saved, source = _resume_state(net)
    epochs = fit_params.pop("epochs", None)  # fit(X, y, epochs=n): fit_loop's, not the data's
    if _enabled_pending(net):
        _resolve_enabled(net, X, y, saved, source, epochs, **fit_params)
    if _fp32_pending(net):
        names = None
        if saved is not None:
            names, problem = fp32_choice(saved, net.module_)
            if problem:
                amp_warn(f"{source} holds an amp_fp32_modules='auto' choice that this module cannot take "
                         f"({problem}); it was ignored, and the net probes its own.")
        with all_or_nothing(net):
            resolve_fp32_modules(net, X, y, saved=names, **fit_params)


def _enabled_pending(net: Any) -> bool:
    if not is_auto(net.amp_enabled):
        return False
    result = net.__dict__.get("amp_autotune_")
    state = net.__dict__.get("amp_step_state_")
    return result is None or (result.source == "measuring" and getattr(state, "trial", None) is None)


def _fp32_pending(net: Any) -> bool:
    prec = net.__dict__.get("precision_")
    return prec is not None and prec.auto_pending and isinstance(net.__dict__.get("module_"), torch.nn.Module)


def _resolve_enabled(net: Any, X: Any, y: Any, saved: Any, source: str | None, epochs: int | None,
                     **fit_params: Any) -> None:
    device = torch.device(net.device or "cpu")
    settings = settings_of(net)
    candidates, not_worth = candidate_params(net)
    if saved is not None:
        params, problem = enabled_choice(saved)
        problem = problem or (choice_problem(net, params) if params is not None else None)
        if problem:
            amp_warn(f"{source} holds an amp_enabled='auto' choice that this net cannot use ({problem}); "
                     "it was ignored.")
        elif params is not None:
            return _apply(net, AutotuneResult(params, source="checkpoint", device=str(device), note=source))
    if not_worth:
        return _apply(net, AutotuneResult(candidates[0], source="device", device=str(device),
                                          table=table_of(candidates, None, not_worth), note=not_worth))
    key = (cache.cache_key(net, candidates, X, clock=settings["timer"] is not None)
           if settings["cache"] is not False else None)
    folder = cache.cache_dir(None if settings["cache"] is True else settings["cache"])
    stored, expired = _stored(net, key, candidates, folder)
    if stored is not None:
        index, entry, where = stored
        _apply(net, AutotuneResult(candidates[index], source="cache", device=str(device), cache=where,
                                   table=table_of(candidates, None)))
        net.amp_step_state_.trial = _trial(net, candidates, settings, device, chosen=index, predicted=entry["step_s"],
                                           key=key, folder=folder)
        return None
    steps = _fit_steps(net, X, y, epochs, **fit_params)
    needed = max(2 * (settings["warmup"] + min(MIN_PAIRS, settings["steps"])), settings["min_steps"])
    if steps is not None and steps < needed:
        # the machine and the model decide, never what other models stored
        params, why = device_choice(candidates, device, cache.machine(device))
        note = (f"this fit has {steps} training step{'s' if steps != 1 else ''}, fewer than the {needed} a "
                f"measurement takes here (amp_autotune__min_steps={settings['min_steps']}); chose {why}")
        return _apply(net, AutotuneResult(params, source="device", device=str(device), note=note,
                                          table=table_of(candidates, None)))
    # measure: the fit starts in mixed precision, and its float32 steps pause autocast
    _apply(net, AutotuneResult(candidates[1], source="measuring", device=str(device),
                               table=table_of(candidates, None), note=expired))
    net.amp_step_state_.trial = _trial(net, candidates, settings, device, key=key, folder=folder)
    return None


def _trial(net: Any, candidates: list, settings: dict, device: torch.device, chosen: int | None = None,
           predicted: float | None = None, key: dict | None = None, folder: str | None = None) -> Trial:
    trial = Trial(candidates, settings["margin"], settings["steps"], settings["warmup"], device,
                  settings["timer"], chosen=chosen, predicted_s=predicted)
    trial.key, trial.folder = key, folder
    return trial


def _apply(net: Any, result: AutotuneResult) -> None:
    if net.parallel_.world_size > 1:  # every rank trains with rank 0's choice
        shared = [result]
        torch.distributed.broadcast_object_list(shared, src=0)
        result = shared[0]
    with all_or_nothing(net):
        apply_choice(net, result)
    if net.verbose and result.source not in ("measuring", "cache"):
        print(result, flush=True)


def _stored(net: Any, key: dict | None, candidates: list,
            folder: str) -> tuple[tuple[int, dict, str] | None, str | None]:
    """The stored choice for ``key`` as (its candidate's index, the entry,
    where it was read), where it is one of ``candidates``, the net can use
    it and it has not :func:`~ampnet.auto.cache.expired`; and why an
    entry that exists is measured again (None: no such entry). A malformed
    or untrusted entry warns once."""
    if key is None:
        return None, None
    entry, problem = cache.read_entry(key, folder)
    if problem is None and entry is not None:
        params = entry["params"]
        if params not in candidates:
            problem = f"{folder}: its choice {params!r} is not one of this net's candidates"
        else:
            problem = choice_problem(net, params)
    if problem:
        amp_warn(f"amp_enabled='auto' ignored a cache entry it cannot use ({problem}); it measures again and "
                 "replaces it. Fix: nothing to do; to stop reading the cache, pass amp_autotune__cache=False.")
        return None, None
    if entry is None:
        return None, None
    where = cache.entry_path(key, folder)
    if cache.expired(entry):
        days = cache.EXPIRES_S / 86400
        return None, (f"the choice stored in {where} is older than {days:g} days (or dated in the future): "
                      "measured again, so that a choice made once gets a chance to be proven wrong")
    return (candidates.index(entry["params"]), entry, f"read from {where}"), None


def _fit_steps(net: Any, X: Any, y: Any, epochs: int | None, **fit_params: Any) -> int | None:
    """The fit's training steps: its epochs times the batches of the
    training split (None where its length is unknown)."""
    with kept_random_state():
        dataset, _ = net.get_split_datasets(X, y, **split_params(net, fit_params))
    kwargs = net.get_params_for("iterator_train")
    size = cache.batch_size(net)
    try:
        rows = len(dataset)
    except TypeError:
        return None
    size = rows if size == -1 else size
    if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size <= 0:
        return None
    size = int(size)
    batches = rows // size if kwargs.get("drop_last") else -(-rows // size)
    steps = -(-batches // max(int(net.gradient_accumulation_steps), 1))
    return max(int(net.max_epochs if epochs is None else epochs), 0) * steps


# ---- the fit's steps ----------------------------------------------------------------------


def train_step(net: Any, step: Callable[..., dict], batch: Any, **fit_params: Any) -> dict:
    """One training micro-batch through ``step``: in the candidate of its
    step while ``'auto'`` measures, timed while it watches its choice."""
    state = net.__dict__.get("amp_step_state_")
    trial = getattr(state, "trial", None)
    if trial is None:
        return step(net, batch, **fit_params)
    measuring = not trial.decided
    out = trial.run(net, step, batch, **fit_params)
    if measuring and state.micro_batches == 0:
        if net.parallel_.world_size > 1:  # rank 0 decides for every rank
            shared = [trial.chosen, trial.reason]
            torch.distributed.broadcast_object_list(shared, src=0)
            trial.chosen, trial.reason = shared
        if trial.decided:
            _settle(net, trial)
    return out


def _settle(net: Any, trial: Trial, store: bool = True) -> None:
    """Switch to the trial's choice, record it and (``store``) store it."""
    chosen, candidates = trial.chosen, trial.candidates
    best = trial.step_s(chosen) or 0.0
    result = AutotuneResult(
        candidates[chosen], source="measured", device=str(trial.device), table=table_of(candidates, trial.times),
        steps_run=[label(candidates[i]) for i in trial.log], note=trial.reason,
        cost_s=sum(max(s - best, 0.0) for i, s in trial.seconds if i != chosen),
    )
    if chosen == 0:
        switch_in_fit(net, result)
    else:
        net.__dict__["amp_autotune_"] = result
    rank = torch.distributed.get_rank() if net.parallel_.world_size > 1 else 0
    if trial.key is not None and rank == 0 and store and trial.measured and trial.step_s(chosen):
        problem = cache.write_entry(trial.key, result.params, trial.step_s(chosen), trial.folder)
        result.cache = f"not stored: {problem}" if problem else (
            f"stored in {cache.entry_path(trial.key, trial.folder)}: the next fit of this model on this machine "
            "starts with it (`python -m ampnet cache --clear` removes it)")
    elif trial.key is not None and not store:
        result.cache = (f"not stored in {trial.folder}: the fit ended before the measurement did, so the next "
                        "fit measures")
    elif trial.key is not None and not trial.measured:
        result.cache = f"not stored in {trial.folder}: the measurement did not decide, so the next fit measures"
    if net.verbose:
        print(result, flush=True)


def end_epoch(net: Any) -> None:
    """At an epoch's end: the chosen setting's health and steps against what
    was measured (:meth:`Trial.end_epoch`); a finding drops the stored
    choice and is said in the record."""
    trial = getattr(net.__dict__.get("amp_step_state_"), "trial", None)
    result = net.__dict__.get("amp_autotune_")
    if trial is None or not trial.decided or result is None or result.check:
        return
    row = net.history[-1]
    finding = trial.end_epoch(len(net.history), rows=list(row.get("batches", ())), loss=row.get("train_loss"))
    if finding:
        result.check = finding + "; the next fit measures again"
        if trial.key is not None and (trial.measured or result.source == "cache"):  # an entry was stored
            cache.forget_entry(trial.key, trial.folder)
            result.cache = (f"not kept in {cache.entry_path(trial.key, trial.folder)}: the check dropped the "
                            "stored choice")


def end_fit(net: Any) -> None:
    """At a fit's end: a measurement the fit ended first (a short fit, an
    interruption) decides with what it has for this net, and stores nothing."""
    trial = getattr(net.__dict__.get("amp_step_state_"), "trial", None)
    if trial is not None and not trial.decided:
        trial._mixed_setting(net)  # a fit interrupted between a float32 step's micro-batches
        trial.finish()
        _settle(net, trial, store=False)


def _resume_state(net: Any) -> tuple[Any, str | None]:
    """The module state (and the file's description) of the checkpoint that
    a ``LoadInitState`` callback will load, read through the checked reader
    of every load (:func:`ampnet.io.state_files.read_params_file`); ``(None, None)``
    where there is none, or one that ``LoadInitState`` will refuse with its
    own error."""
    for _, cb in net.callbacks_:
        if not isinstance(cb, SkorchLoadInitState) or getattr(cb, "use_safetensors", False):
            continue
        try:
            path = checkpoint_files(cb.checkpoint, net).get("f_params")
            if path is None or not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
                continue
            source = f"f_params={str(path)!r}"
            state = read_params_file(path, source)
        except (OSError, ValueError):  # no checkpoint yet, or one LoadInitState will refuse
            continue
        return state, source
    return None, None

