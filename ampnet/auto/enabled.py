"""``amp_enabled='auto'``: train in float32 or in mixed precision, whichever
is faster for this model on this machine, measured in the fit's own steps.

The candidates are float32 and mixed precision in the dtype that
``amp_dtype`` names (``'auto'``: bfloat16 on CPUs and on GPUs that compute
it, else float16), both in the net's ``memory_format``
(:func:`candidate_params`). Both keep float32 weights and optimizer state,
so the fit switches between them from one step to the next: its first
steps are the measurement (:mod:`ampnet.auto.trial`), where the fit has
``amp_autotune__min_steps`` (64) or more; a shorter one decides without a
training step (:func:`device_choice`). Settings that cannot
be switched per step (``amp_level='pure'``, master-weight settings,
``amp_modules``) are refused with ``'auto'``
(:func:`ampnet.auto.unswitchable.refuse_unswitchable`): pin them with
``amp_enabled=True``. What is decided once is remembered on disk
(:mod:`ampnet.auto.cache`). The user guide's precision page tells the
whole story; :class:`AutotuneResult` is the record.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ampnet.config.params import PARAMS, auto_inputs, pending_params, parsed
from ampnet.precision import cpu_has_native_bf16, dtype_name, parse_amp_dtype, resolve_precision

__all__ = ["AutotuneResult", "CHOICE_KEYS", "SETTINGS", "settings_of", "candidate_params", "label",
           "device_choice", "table_of"]

#: The constructor parameters that a choice sets: the inputs of the choice in
#: the parameter table, but the device.
CHOICE_KEYS = tuple(name for name in PARAMS if name in auto_inputs() and name != "device")

#: The ``amp_autotune__*`` settings (rows of the parameter table), without the prefix.
SETTINGS = tuple(name.split("__", 1)[1] for name in PARAMS if name.startswith("amp_autotune__"))

#: Where each choice came from (``AutotuneResult.source``).
SOURCES = {
    "measured": "measured in this fit's first steps",
    "measuring": "measuring: the fit's first steps alternate float32 and mixed precision",
    "cache": "stored by an earlier fit of this model on this machine; nothing measured",
    "checkpoint": "read from the checkpoint this fit resumes; nothing measured",
    "loaded": "read by load_params; nothing measured",
    "device": "decided without a training step",
}


@dataclass
class AutotuneResult:
    """What ``amp_enabled='auto'`` measured and chose (fitted attribute ``amp_autotune_``).

    Attributes
    ----------
    params : dict
      The chosen constructor parameters (``amp_enabled``, ``amp_dtype``,
      ``amp_level``, ``amp_master_weights``, ``memory_format``): pin the
      choice with ``AmpNet(..., **result.params)``, which trains bitwise as a
      fit that starts from this choice.
    source : str
      Where the choice came from: ``'measured'``, ``'measuring'``,
      ``'cache'``, ``'checkpoint'``, ``'loaded'`` or ``'device'`` (decided
      without a training step).
    table : list of dict
      One row per candidate: ``params``, ``step_s`` (the median of its timed
      steps, None where none was timed), ``timed`` (how many), ``reason``
      (why it was not measured, or None).
    steps_run : list of str
      The precision of each measured step of the fit, in order (the first
      ``len(steps_run)`` steps); every later step ran in the choice.
    cost_s : float
      What the measurement cost: the time its timed steps in the setting
      not chosen took beyond the chosen setting's median step.
    note : str or None
      Why it chose as it did, in words.
    check : str or None
      Set when the chosen setting's epochs ran slower than measured (the
      machine got busy, the first batches were unrepresentative): the
      stored entry is then dropped, and the next fit measures again.
    cache : str or None
      What the cache did, in words, naming the entry's file (in the cache
      folder: ``AMPNET_CACHE_DIR``, the user's cache folder or
      ``amp_autotune__cache``): read from it, stored in it, or not kept;
      or why nothing was stored. None where the cache was not used.
    device : str
      The device it chose for.
    """

    params: dict[str, Any]
    source: str = "measured"
    table: list[dict[str, Any]] = field(default_factory=list)
    steps_run: list[str] = field(default_factory=list)
    cost_s: float = 0.0
    note: str | None = None
    check: str | None = None
    cache: str | None = None
    device: str = "cpu"

    @property
    def chosen(self) -> str:
        """The chosen candidate, in words."""
        return label(self.params)

    def __str__(self) -> str:
        lines = [f"amp_enabled='auto' on {self.device}: {self.chosen} ({SOURCES.get(self.source, self.source)})"]
        for row in self.table if any(r.get("timed") or r.get("reason") for r in self.table) else ():
            step = None if row.get("step_s") is None else f"{row['step_s'] * 1e3:.2f} ms a step"
            what = row.get("reason") or (f"{step}, {row.get('timed', 0)} timed" if step else "not measured")
            lines.append(f"  {label(row['params']):<22} {what}{'  <- chosen' if row['params'] == self.params else ''}")
        if self.steps_run:
            shown = ", ".join(_short(s) for s in self.steps_run)
            lines.append(f"Steps 1-{len(self.steps_run)} ran in: {shown}; the rest in {_short(self.chosen)}. "
                         f"Cost: {duration(self.cost_s)}.")
        for text in (self.note, self.check, self.cache):
            if text:
                lines.append(_sentence(text))
        return "\n".join(lines)


def duration(seconds: float) -> str:
    """``seconds`` in words a reader takes in: milliseconds under a second
    (``'3 ms'``, not ``'0.00 s'``), else seconds with two decimals."""
    if seconds < 1.0:
        return f"{seconds * 1e3:.0f} ms" if seconds >= 0.0005 or seconds == 0 else "under 1 ms"
    return f"{seconds:.2f} s"


def _sentence(text: str) -> str:
    """``text`` as a sentence: a first word of plain letters capitalised (not
    a name from code, such as ``f_params='...'``), a full stop at the end."""
    first = text.split(" ", 1)[0]
    head = text[:1].upper() + text[1:] if first.isalpha() and first.islower() else text
    return head + ("" if text.endswith(".") else ".")


def _short(text: str) -> str:
    return "float32" if text.startswith("float32") else text


def label(params: Mapping[str, Any]) -> str:
    """``'float32 (AMP off)'``, ``'bfloat16 mixed'``, ``'bfloat16 pure
    (compensated)'``, with ``' + channels_last'`` where it applies."""
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


def settings_of(net: Any) -> dict[str, Any]:
    """The net's ``amp_autotune__*`` settings (checked by the parameter
    table when they were set), the table's defaults for the others; without
    the prefix."""
    given = net.get_params_for("amp_autotune")
    return {name: given.get(name, PARAMS[f"amp_autotune__{name}"].default) for name in SETTINGS}


def candidate_params(net: Any) -> tuple[list[dict[str, Any]], str | None]:
    """float32's and mixed precision's constructor parameters for an
    initialized ``'auto'`` net, and why mixed precision is not worth a
    training step here (None when it is to be measured)."""
    device = torch.device(net.device or "cpu")
    memory_format = parsed(net, "memory_format")
    float32 = pending_params(memory_format)
    dtype = parse_amp_dtype(parsed(net, "amp_dtype"))
    try:
        dtype = dtype or resolve_precision(True, "auto", device).compute_dtype
    except ValueError as exc:  # no autocast for this device
        return [float32], f"mixed precision not measured: {exc}"
    mixed = {**float32, "amp_enabled": True, "amp_dtype": dtype_name(dtype)}
    reason = None
    if device.type == "cpu" and dtype == torch.float16:
        reason = ("float16 autocast on a CPU is correct but often slower than float32 (few CPUs compute float16 "
                  "natively)")
    elif device.type == "cpu" and not cpu_has_native_bf16():
        reason = "this CPU has no native bfloat16 (AVX512-BF16 or AMX): it is emulated, many times slower"
    return [float32, mixed], (f"mixed precision not measured: {reason}" if reason else None)


def device_choice(candidates: list[dict[str, Any]], device: torch.device,
                  machine: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The choice where no step is measured (a fit too short to pay for a
    measurement), and why, from the machine alone (never from what other
    models stored, nor any file): mixed precision on a GPU and on the CPUs
    where bfloat16 was measured faster than float32 (AMX; AMD with
    AVX512-BF16), float32 on the others (an Intel CPU with AVX512-BF16 and
    no AMX trained the benchmark's MLP 1.5x slower in bfloat16)."""
    if len(candidates) < 2:
        return candidates[0], "float32, the only candidate"
    flags = set(machine.get("flags", ()))
    if device.type == "cuda":
        return candidates[1], f"{label(candidates[1])}, on a GPU (tensor cores)"
    if "amx_bf16" in flags:
        return candidates[1], f"{label(candidates[1])}, on a CPU with AMX"
    if "avx512_bf16" in flags and machine.get("vendor") == "AuthenticAMD":
        return candidates[1], f"{label(candidates[1])}, on an AMD CPU with AVX512-BF16"
    return candidates[0], "float32, on this CPU (bfloat16 is faster on some CPUs and slower on others)"


def table_of(candidates: list[dict[str, Any]], times: list[list[float]] | None,
             reason: str | None = None) -> list[dict[str, Any]]:
    """The record's rows for ``candidates`` and their timed steps."""
    rows = []
    for i, params in enumerate(candidates):
        timed = times[i] if times is not None and i < len(times) else []
        rows.append({"params": params, "step_s": statistics.median(timed) if timed else None,
                     "timed": len(timed), "reason": reason if i > 0 else None})
    return rows
