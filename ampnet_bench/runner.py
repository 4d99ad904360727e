"""Interleaved rounds of runs, per-round ratios and the results document.

Within a workload, round ``r`` runs every contender once (by default each
run in a fresh Python process, see :mod:`ampnet_bench.worker`), in the order of
:data:`ampnet_bench.contenders.CONTENDERS` on even rounds and in the
reverse order on odd rounds (A B C, C B A, A B C, ...), so that no contender
always runs first or right after the same neighbour.
Each run builds a fresh model from the same seed, trains ``warmup +
epochs`` epochs and keeps the median of the measured epochs as that
round's time. Ratios are computed inside each round (so slow drifts of the
machine cancel) and summarized by their median over rounds.

The A/A control runs one contender twice under two keys (``raw-amp`` and
``raw-amp-aa``, or ``ampnet-fp32`` and ``ampnet-fp32-aa`` where the AMP loop
does not run): their per-round ratio would be 1 on a noiseless machine.
Its largest deviation over the rounds is the *A/A spread*; a comparison
whose median differs from 1 by no more than that is reported "within
noise", never as a difference.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import tempfile
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ampnet_bench.config import BenchConfig
from ampnet_bench.contenders import (
    CONTENDERS,
    Contender,
    ContenderUnavailable,
    RunOutcome,
    run_contender,
    train_reference_weights,
)
from ampnet_bench.machine import describe_machine
from ampnet_bench.memory import MemoryMeter, MemoryReading, describe_method, probe_in_subprocess
from ampnet_bench.workloads import Workload
from ampnet_bench.worker import run_in_subprocess

__all__ = ["AA_PAIRS", "Comparison", "COMPARISONS", "FASTEST_LOOPS", "PEERS", "SCHEMA_VERSION", "aa_control",
           "run_benchmark", "run_workload", "verdict"]

#: Version of the JSON results layout.
SCHEMA_VERSION = 2

#: The A/A controls, each the same contender under two keys; the first pair
#: that ran gives the A/A spread.
AA_PAIRS = (("raw-amp", "raw-amp-aa"), ("ampnet-fp32", "ampnet-fp32-aa"), ("raw-careful", "raw-careful-aa"))

#: The peers in their default configuration (time of the fastest per round).
PEERS = ("raw-amp", "skorch-accelerate", "lightning")

#: The hand-written loops auto is held to: float32, and autocast with a fused optimizer (the
#: fastest of the two per round).
FASTEST_LOOPS = ("raw-fp32", "raw-amp-fused")

Logger = Callable[[str], None]


@dataclass(frozen=True)
class Comparison:
    """A per-round ratio between two contenders.

    Attributes
    ----------
    key : str
      Identifier (JSON, targets).

    label : str
      Description for the report.

    a, b : str
      Contender keys; ``b`` may be a tuple of keys, whose fastest time in
      each round is used.

    kind : str
      ``'speedup'``: time(b) / time(a), how many times faster ``a`` is;
      ``'time_ratio'``: time(a) / time(b), ``a``'s time relative to ``b``'s.
    """

    key: str
    label: str
    a: str
    b: str | tuple[str, ...]
    kind: str

    def value(self, time_a: float, time_b: float) -> float:
        """The ratio for one round."""
        return time_b / time_a if self.kind == "speedup" else time_a / time_b


#: The comparisons reported for every workload (where both contenders ran).
COMPARISONS: tuple[Comparison, ...] = (
    Comparison("ampnet_mixed_speedup", "AmpNet mixed: speed-up over AmpNet fp32", "ampnet-mixed", "ampnet-fp32", "speedup"),
    Comparison("ampnet_pure_speedup", "AmpNet pure: speed-up over AmpNet fp32", "ampnet-pure", "ampnet-fp32", "speedup"),
    Comparison("raw_amp_speedup", "PyTorch loop: AMP speed-up over fp32", "raw-amp", "raw-fp32", "speedup"),
    Comparison("ampnet_mixed_vs_raw_amp", "AmpNet mixed time / PyTorch AMP loop time", "ampnet-mixed", "raw-amp", "time_ratio"),
    Comparison("ampnet_noguard_vs_raw_amp", "AmpNet mixed without the non-finite guard time / PyTorch AMP loop time",
               "ampnet-mixed-noguard", "raw-amp", "time_ratio"),
    Comparison("guard_cost_fp32", "AmpNet fp32 time / the same without the non-finite guard (its cost)",
               "ampnet-fp32", "ampnet-fp32-noguard", "time_ratio"),
    Comparison("guard_cost_mixed", "AmpNet mixed time / the same without the non-finite guard (its cost)",
               "ampnet-mixed", "ampnet-mixed-noguard", "time_ratio"),
    Comparison("monitor_cost_fp32", "AmpNet fp32 with AmpMonitor time / without (the flight recorder's cost)",
               "ampnet-fp32-monitor", "ampnet-fp32", "time_ratio"),
    Comparison("monitor_cost_mixed", "AmpNet mixed with AmpMonitor time / without (the flight recorder's cost)",
               "ampnet-mixed-monitor", "ampnet-mixed", "time_ratio"),
    Comparison("ampnet_fp32_vs_raw_fp32", "AmpNet fp32 time / PyTorch fp32 loop time", "ampnet-fp32", "raw-fp32", "time_ratio"),
    Comparison("ampnet_fp32_vs_skorch", "AmpNet fp32 time / skorch time", "ampnet-fp32", "skorch-fp32", "time_ratio"),
    Comparison("skorch_vs_raw_fp32", "skorch time / PyTorch fp32 loop time", "skorch-fp32", "raw-fp32", "time_ratio"),
    Comparison("pure_vs_mixed", "AmpNet pure time / AmpNet mixed time", "ampnet-pure", "ampnet-mixed", "time_ratio"),
    Comparison("pure_nomw_vs_mixed", "AmpNet pure without master weights time / AmpNet mixed time",
               "ampnet-pure-nomw", "ampnet-mixed", "time_ratio"),
    Comparison("pure_comp_vs_mixed", "AmpNet pure compensated time / AmpNet mixed time",
               "ampnet-pure-comp", "ampnet-mixed", "time_ratio"),
    Comparison("pure_comp_fused_vs_mixed", "AmpNet pure compensated, fused optimizer time / AmpNet mixed time",
               "ampnet-pure-comp-fused", "ampnet-mixed", "time_ratio"),
    Comparison("mixed_fused_vs_mixed", "AmpNet mixed, fused optimizer time / AmpNet mixed time",
               "ampnet-mixed-fused", "ampnet-mixed", "time_ratio"),
    Comparison("accelerate_vs_raw_amp", "skorch + accelerate time / PyTorch AMP loop time",
               "skorch-accelerate", "raw-amp", "time_ratio"),
    Comparison("lightning_vs_raw_amp", "Lightning time / PyTorch AMP loop time",
               "lightning", "raw-amp", "time_ratio"),
    Comparison("pure_comp_fused_vs_fastest_peer",
               "AmpNet pure compensated, fused: speed-up over the fastest peer (AMP loop, skorch + accelerate, Lightning)",
               "ampnet-pure-comp-fused", PEERS, "speedup"),
    Comparison("mixed_fused_vs_fastest_peer",
               "AmpNet mixed, fused: speed-up over the fastest peer (AMP loop, skorch + accelerate, Lightning)",
               "ampnet-mixed-fused", PEERS, "speedup"),
    Comparison("raw_amp_fused_vs_raw_amp", "PyTorch AMP loop with a fused optimizer time / PyTorch AMP loop time",
               "raw-amp-fused", "raw-amp", "time_ratio"),
    Comparison("ampnet_mixed_vs_best_loop",
               "AmpNet mixed (default settings) time / best hand-written loop (autocast + fused optimizer) time",
               "ampnet-mixed", "raw-amp-fused", "time_ratio"),
    Comparison("ampnet_mixed_vs_fastest_peer",
               "AmpNet mixed (default settings): speed-up over the fastest peer (AMP loop, skorch + accelerate, "
               "Lightning)", "ampnet-mixed", PEERS, "speedup"),
    Comparison("ampnet_auto_vs_best_loop",
               "AmpNet auto (probe included) time / best hand-written loop (autocast + fused optimizer) time",
               "ampnet-auto", "raw-amp-fused", "time_ratio"),
    Comparison("ampnet_auto_vs_fastest_peer",
               "AmpNet auto (probe included): speed-up over the fastest peer (AMP loop, skorch + accelerate, "
               "Lightning)", "ampnet-auto", PEERS, "speedup"),
    Comparison("ampnet_auto_vs_fp32", "AmpNet auto (probe included) time / AmpNet fp32 time",
               "ampnet-auto", "ampnet-fp32", "time_ratio"),
    Comparison("ampnet_auto_vs_fastest_loop",
               "AmpNet auto (probe included): speed-up over the fastest of the float32 loop and the fused "
               "autocast loop", "ampnet-auto", FASTEST_LOOPS, "speedup"),
    # issue 37: the careful loop (data on the device, fused optimizer, loss read once an epoch)
    Comparison("ampnet_mixed_vs_careful", "AmpNet default (amp_enabled=True) time / careful loop (autocast) time",
               "ampnet-mixed", "raw-careful", "time_ratio"),
    Comparison("ampnet_fp32_vs_careful", "AmpNet amp_enabled=False time / careful loop (autocast) time",
               "ampnet-fp32", "raw-careful", "time_ratio"),
    Comparison("ampnet_auto_vs_careful", "AmpNet amp_enabled='auto' time / careful loop (autocast) time",
               "ampnet-auto", "raw-careful", "time_ratio"),
    Comparison("skorch_vs_careful", "skorch (float32) time / careful loop (autocast) time",
               "skorch-fp32", "raw-careful", "time_ratio"),
    Comparison("item_amp_vs_careful", "DataLoader loop reading loss.item(), autocast, time / careful loop time",
               "raw-item-amp", "raw-careful", "time_ratio"),
    Comparison("item_fp32_vs_careful", "DataLoader loop reading loss.item(), float32, time / careful loop time",
               "raw-item-fp32", "raw-careful", "time_ratio"),
    Comparison("careful_fp32_vs_careful", "careful loop float32 (IEEE) time / careful loop (autocast) time",
               "raw-careful-fp32", "raw-careful", "time_ratio"),
    Comparison("ampnet_mixed_vs_skorch", "AmpNet default: speed-up over skorch (float32)",
               "ampnet-mixed", "skorch-fp32", "speedup"),
    Comparison("careful_amp_vs_ieee", "careful loop: autocast speed-up over float32 IEEE (TF32 off)",
               "raw-careful", "raw-careful-fp32", "speedup"),
    Comparison("careful_amp_vs_tf32", "careful loop: autocast speed-up over float32 with TF32",
               "raw-careful", "raw-careful-tf32", "speedup"),
    Comparison("careful_tf32_vs_ieee", "careful loop: TF32 speed-up over float32 IEEE",
               "raw-careful-tf32", "raw-careful-fp32", "speedup"),
    Comparison("ampnet_mixed_vs_careful_ieee", "AmpNet default: speed-up over the careful loop in float32 IEEE "
               "(TF32 off)", "ampnet-mixed", "raw-careful-fp32", "speedup"),
    Comparison("ampnet_float8_vs_mixed", "AmpNet float8 (compile=True) time / AmpNet default time",
               "ampnet-float8", "ampnet-mixed", "time_ratio"),
)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class _Record:
    """Everything measured for one contender on one workload."""

    contender: Contender
    round_times: list[float | None] = field(default_factory=list)
    outcomes: list[RunOutcome] = field(default_factory=list)
    memory: list[MemoryReading] = field(default_factory=list)
    error: str | None = None


def _selected(cfg: BenchConfig) -> list[Contender]:
    if cfg.contenders is None:
        return list(CONTENDERS)
    return [c for c in CONTENDERS if c.key in cfg.contenders]


def _memory_summary(readings: list[MemoryReading]) -> dict[str, Any] | None:
    if not readings:
        return None
    deltas = [r.delta_mb for r in readings if r.delta_mb is not None]
    return {
        "method": readings[0].method,
        "peak_mb": statistics.median(r.peak_mb for r in readings),
        "delta_mb": statistics.median(deltas) if deltas else None,
    }


def _final_loss(rec: _Record | None) -> float | None:
    if rec is None or not rec.outcomes:
        return None
    return _median([o.final_loss for o in rec.outcomes])


def _loss_ratio(rec: _Record, other: _Record | None) -> float | None:
    mine, theirs = _final_loss(rec), _final_loss(other)
    if mine is None or not theirs or not math.isfinite(mine) or not math.isfinite(theirs):
        return None
    return mine / theirs


def _contender_summary(
    rec: _Record, wl: Workload, ref: _Record | None, n_rounds: int,
    records: dict[str, _Record] | None = None,
) -> dict[str, Any]:
    records = records or {}
    c = rec.contender
    times = [t for t in rec.round_times if t is not None]
    all_epochs = [t for o in rec.outcomes for t in o.epoch_times]
    median = _median(times)
    ratios: list[float | None] = []
    if ref is not None:
        for r in range(n_rounds):
            mine = rec.round_times[r] if r < len(rec.round_times) else None
            theirs = ref.round_times[r] if r < len(ref.round_times) else None
            ratios.append(mine / theirs if mine and theirs else None)
    ratio_values = [x for x in ratios if x is not None]
    notes = []
    if rec.error is not None and times:
        notes.append(f"failed after {len(times)} round(s), later rounds skipped: {rec.error}")
    if c.level == "pure" and rec.outcomes and not any(
        d in ("bfloat16", "float16") for o in rec.outcomes for d in o.param_dtypes
    ):
        notes.append(
            "amp_level='pure' ran, but the module's parameters stayed "
            f"{'/'.join(rec.outcomes[-1].param_dtypes)}: pure low-precision weights seem "
            "not implemented yet, so this measures the mixed path."
        )
    return {
        "key": c.key,
        "label": c.label,
        "framework": c.framework,
        "amp": c.amp,
        "level": c.level if c.framework == "ampnet" and c.amp else None,
        "available": bool(times),
        "error": rec.error,
        "round_times_s": rec.round_times,
        "epoch_times_s": [o.epoch_times for o in rec.outcomes],
        "median_s": median,
        "min_epoch_s": min(all_epochs) if all_epochs else None,
        "max_epoch_s": max(all_epochs) if all_epochs else None,
        "samples_per_s": wl.n_samples / median if median else None,
        "ms_per_batch": 1000.0 * median / wl.n_batches if median else None,
        "ratio_to_reference": {
            "median": _median(ratio_values),
            "per_round": ratios,
        },
        "memory": _memory_summary(rec.memory),
        "final_loss": _final_loss(rec),
        "loss_vs_fp32": _loss_ratio(rec, records.get("raw-fp32")),
        "loss_vs_raw_amp": _loss_ratio(rec, records.get("raw-amp")),
        "state_bytes": next((o.state_bytes for o in reversed(rec.outcomes) if o.state_bytes), None),
        "accuracy": _median([o.accuracy for o in rec.outcomes]),
        "param_dtypes": rec.outcomes[-1].param_dtypes if rec.outcomes else None,
        "auto_choice": _auto_choice(rec),
        "warnings": list(dict.fromkeys(w for o in rec.outcomes for w in o.warnings)),
        "notes": notes,
    }


def _auto_choice(rec: _Record) -> dict[str, Any] | None:
    """What ``amp_enabled='auto'`` chose over the rounds: the choice most
    rounds made (``chosen``, ``params``), how many rounds made it, and
    every round's choice; None for other contenders."""
    choices = [o.auto_choice for o in rec.outcomes if o.auto_choice]
    if not choices:
        return None
    words = [c["chosen"] for c in choices]
    top = max(dict.fromkeys(words), key=words.count)
    first = next(c for c in choices if c["chosen"] == top)
    return {"chosen": top, "params": first.get("params"), "rounds": words.count(top),
            "per_round": words, "cost_s": [c.get("cost_s", c.get("probe_s")) for c in choices]}


def _round_time(rec: _Record | None, r: int) -> float | None:
    if rec is None or r >= len(rec.round_times):
        return None
    return rec.round_times[r]


def _round_times(records: dict[str, _Record], keys: str | tuple[str, ...], r: int) -> float | None:
    """A contender's time in round ``r``; for several keys the fastest of
    those that ran (None if none ran)."""
    if isinstance(keys, str):
        return _round_time(records.get(keys), r)
    times = [t for t in (_round_time(records.get(k), r) for k in keys) if t]
    return min(times) if times else None


def aa_control(records: dict[str, _Record], n_rounds: int) -> dict[str, Any] | None:
    """The A/A control: per-round time ratios of the two copies of the same
    contender, their median, and the spread (largest deviation from 1 over
    the rounds, as a fraction), for the first pair of :data:`AA_PAIRS` whose
    copies both ran. None when no pair ran."""
    pairs = [(a, b) for a, b in AA_PAIRS if a in records and b in records]
    if not pairs:
        return None
    a, b = pairs[0]
    per_round = []
    for r in range(n_rounds):
        ta, tb = _round_time(records[a], r), _round_time(records[b], r)
        per_round.append(ta / tb if ta and tb else None)
    values = [v for v in per_round if v is not None]
    if not values:
        return None
    spread = max(math.exp(abs(math.log(v))) - 1.0 for v in values)
    return {"a": a, "b": b, "per_round": per_round, "median": _median(values), "spread": spread}


def verdict(median: float | None, spread: float | None) -> str | None:
    """``'within noise'`` when ``median`` differs from 1 by no more than the
    A/A ``spread`` (compared as ratios: 1.05 and 1/1.05 are the same
    distance), else ``'differs'``; None without a median or a spread."""
    if median is None or spread is None or median <= 0:
        return None
    return "within noise" if abs(math.log(median)) <= math.log1p(spread) else "differs"


def _comparisons(
    records: dict[str, _Record], wl: Workload, n_rounds: int, quick: bool = False,
    spread: float | None = None,
) -> list[dict[str, Any]]:
    # quick mode runs tiny sizes: a speed target says nothing about them
    targets = {} if quick else {t.comparison: t for t in wl.targets}
    out = []
    for comp in COMPARISONS:
        b_keys = (comp.b,) if isinstance(comp.b, str) else comp.b
        if comp.a not in records or not any(k in records for k in b_keys):
            continue
        per_round: list[float | None] = []
        for r in range(n_rounds):
            ta, tb = _round_times(records, comp.a, r), _round_times(records, comp.b, r)
            per_round.append(comp.value(ta, tb) if ta and tb else None)
        values = [v for v in per_round if v is not None]
        median = _median(values)
        target = targets.get(comp.key)
        out.append(
            {
                "key": comp.key,
                "label": comp.label,
                "kind": comp.kind,
                "a": comp.a,
                "b": comp.b if isinstance(comp.b, str) else list(comp.b),
                "median": median,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "per_round": per_round,
                "verdict": verdict(median, spread),
                "target": target.text() if target else None,
                "met": (target.met(median) if target and median is not None else None),
            }
        )
    return out


def _fp32_consistency(records: dict[str, _Record]) -> str | None:
    losses = {
        k: _median([o.final_loss for o in records[k].outcomes])
        for k in ("raw-fp32", "skorch-fp32", "ampnet-fp32")
        if k in records and records[k].outcomes
    }
    if len(losses) < 2:
        return None
    values = list(losses.values())
    spread = (max(values) - min(values)) / max(abs(min(values)), 1e-12)
    text = ", ".join(f"{k} {v:.6g}" for k, v in losses.items())
    if spread <= 1e-3:
        return (
            f"Fairness check: the float32 contenders reach the same final loss ({text}; "
            f"relative spread {spread:.1e}): same data, initial weights and batch order."
        )
    return (
        f"Fairness check FAILED: the float32 contenders' final losses differ ({text}; "
        f"relative spread {spread:.1e}); they should train identically."
    )


def run_workload(
    wl: Workload, cfg: BenchConfig, log: Logger = _stderr
) -> dict[str, Any]:
    """Run all selected contenders on one workload in interleaved rounds.

    Parameters
    ----------
    wl : Workload
      The workload.

    cfg : BenchConfig
      Rounds, epochs, warm-up, device, ... .

    log : callable
      Receives one progress line per run.

    Returns
    -------
    dict
      The workload's section of the results document (see :func:`run_benchmark`).
    """
    started = time.perf_counter()
    data = wl.make_data(cfg.seed)
    weights = train_reference_weights(wl, data, cfg) if wl.task == "predict" else None
    contenders = _selected(cfg)
    records = {c.key: _Record(c) for c in contenders}
    memory = cfg.memory_method
    isolated = cfg.isolation_method == "process"
    weights_file = None
    if isolated and weights is not None:
        fd, weights_file = tempfile.mkstemp(suffix=".pt", prefix="ampnet-bench-")
        os.close(fd)
        torch.save(weights, weights_file)
    try:
        for r in range(cfg.rounds):
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                rec = records[c.key]
                if rec.error is not None:
                    rec.round_times.append(None)
                    continue
                gc.collect()
                meter = MemoryMeter(cfg.device) if memory == "inprocess" and not isolated else None
                reading = None
                try:
                    if isolated:
                        outcome, reading = run_in_subprocess(cfg, wl.name, c.key, weights_file)
                    else:
                        outcome = run_contender(c, wl, data, cfg, weights=weights, meter=meter)
                        reading = meter.reading if meter is not None else None
                except Exception as exc:  # a contender that cannot run is reported, not fatal
                    plain = isolated or isinstance(exc, ContenderUnavailable)
                    rec.error = str(exc) if plain else f"{type(exc).__name__}: {exc}"
                    rec.round_times.append(None)
                    log(f"[{wl.name}] round {r + 1}/{cfg.rounds} {c.key}: not available ({rec.error})")
                    continue
                seconds = statistics.median(outcome.epoch_times)
                rec.round_times.append(seconds)
                rec.outcomes.append(outcome)
                if reading is not None and memory != "off":
                    rec.memory.append(reading)
                log(f"[{wl.name}] round {r + 1}/{cfg.rounds} {c.key}: {seconds * 1000:.1f} ms")
    finally:
        if weights_file is not None:
            os.unlink(weights_file)
    if memory == "subprocess" and not isolated:
        for c in contenders:
            rec = records[c.key]
            if rec.error is not None:
                continue
            try:
                rec.memory.append(probe_in_subprocess(cfg.to_dict(), wl.name, c.key))
                log(f"[{wl.name}] memory {c.key}: {rec.memory[-1].peak_mb:.0f} MB")
            except Exception as exc:
                log(f"[{wl.name}] memory {c.key}: probe failed ({exc})")

    ref_key = next((k for k in ("raw-fp32", "raw-careful") if k in records), contenders[0].key)
    ref = records[ref_key]
    summaries = [
        _contender_summary(records[c.key], wl, ref, cfg.rounds, records) for c in contenders
    ]
    aa = aa_control(records, cfg.rounds)
    notes = [describe_method(memory, cfg.device_type)]
    if isolated:
        notes.append("Every run (one contender, one round) ran in a fresh Python process.")
    if wl.task == "predict":
        notes.append(
            "Every contender predicts with the same weights (one untimed float32 epoch "
            "of the PyTorch loop); final loss is the cross-entropy of the predicted "
            "probabilities and accuracy is over the predicted rows."
        )
    check = _fp32_consistency(records)
    if check:
        notes.append(check)
    return {
        "name": wl.name,
        "title": wl.title,
        "task": wl.task,
        "unit": "predict_proba call" if wl.task == "predict" else "epoch",
        "batch_size": wl.batch_size,
        "n_samples": wl.n_samples,
        "n_batches": wl.n_batches,
        "reference": ref_key,
        "contenders": summaries,
        "aa_control": aa,
        "comparisons": _comparisons(records, wl, cfg.rounds, quick=cfg.quick,
                                    spread=None if aa is None else aa["spread"]),
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }


def run_benchmark(cfg: BenchConfig, log: Logger = _stderr) -> dict[str, Any]:
    """Run every workload of ``cfg`` and return the results document.

    Parameters
    ----------
    cfg : BenchConfig
      What to run.

    log : callable
      Receives progress lines.

    Returns
    -------
    dict
      ``{"schema_version", "machine", "config", "workloads": [...],
      "elapsed_s"}``; each workload holds ``contenders`` (with
      ``median_s``, ``samples_per_s``, ``ms_per_batch``,
      ``ratio_to_reference``, ``memory``, ``final_loss``, ``accuracy``,
      ``available``/``error``) and ``comparisons`` (per-round ratios,
      their median and, outside quick mode, the speed target where one
      applies).
    """
    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    machine = describe_machine()
    workloads = [run_workload(cfg.workload(name), cfg, log) for name in cfg.workloads]
    return {
        "schema_version": SCHEMA_VERSION,
        "machine": machine,
        "config": {**cfg.to_dict(), "memory_method": cfg.memory_method,
                   "isolation_method": cfg.isolation_method},
        "workloads": workloads,
        "elapsed_s": time.perf_counter() - started,
    }
