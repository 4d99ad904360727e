"""Peak-memory measurement of one run.

- CUDA: ``torch.cuda.max_memory_allocated`` after
  ``torch.cuda.reset_peak_memory_stats``; exact per run, in process.
- CPU: the resident-set high-water mark (``VmHWM`` in
  ``/proc/self/status``), reset before the run by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux >= 4.0). Reported as the peak and as the
  increase over the RSS just before the model was built.

  In a fresh subprocess per contender (``--memory subprocess``) this is an
  honest per-contender number: the process holds only the data and torch.
  In process (``--memory inprocess``) memory that earlier runs freed but
  the allocator kept (glibc free lists; always so with
  ``MALLOC_TRIM_THRESHOLD_`` set high) is reused without raising the RSS,
  so the increase understates a run's needs; treat it as a rough figure.
  Where the reset is not possible the process-lifetime ``ru_maxrss`` is
  reported instead, which says that in its note.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["MemoryReading", "MemoryMeter", "probe_in_subprocess", "describe_method", "subprocess_env"]

_MB = 1024.0 * 1024.0


@dataclass
class MemoryReading:
    """Peak memory of one run.

    Attributes
    ----------
    method : str
      ``'cuda_max_allocated'``, ``'rss_hwm'`` (reset before the run) or
      ``'ru_maxrss'`` (process lifetime).

    peak_mb : float
      Peak: allocated CUDA memory, or the process's resident set size.

    delta_mb : float or None
      Peak minus the value just before the run (None for ``'ru_maxrss'``).
    """

    method: str
    peak_mb: float
    delta_mb: float | None

    def to_dict(self) -> dict[str, Any]:
        """As a JSON-serializable dict."""
        return asdict(self)


def _status_kb(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def _ru_maxrss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MB if sys.platform == "darwin" else peak / 1024.0


class MemoryMeter:
    """Context manager measuring the peak memory of its body.

    Parameters
    ----------
    device : str
      The run's device; CUDA devices use the caching allocator's statistics.

    Attributes
    ----------
    reading : MemoryReading or None
      Set on exit.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.reading: MemoryReading | None = None
        self._base = 0.0
        self._method = ""

    def __enter__(self) -> "MemoryMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device) / _MB
            self._method = "cuda_max_allocated"
        elif _reset_hwm():
            self._base = (_status_kb("VmRSS") or 0.0) / 1024.0
            self._method = "rss_hwm"
        else:
            self._method = "ru_maxrss"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._method == "cuda_max_allocated":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / _MB
            self.reading = MemoryReading(self._method, peak, peak - self._base)
        elif self._method == "rss_hwm":
            peak = (_status_kb("VmHWM") or 0.0) / 1024.0
            self.reading = MemoryReading(self._method, peak, peak - self._base)
        else:
            self.reading = MemoryReading(self._method, _ru_maxrss_mb(), None)


def describe_method(memory: str, device_type: str) -> str:
    """One sentence on what the reported memory means, for the report."""
    if memory == "off":
        return "Peak memory not measured (--memory off)."
    if device_type == "cuda":
        return (
            "Peak memory: torch.cuda.max_memory_allocated over the run (model "
            "construction, warm-up and measured epochs), reset before each run; "
            "in parentheses the increase over the allocation before the run. "
            "Median over rounds."
        )
    if memory == "subprocess":
        return (
            "Peak memory: resident-set high-water mark (VmHWM) of a fresh Python "
            "process per contender that generates the same data, then builds the "
            "model and runs warm-up and measured epochs once; the mark is reset "
            "after data generation. In parentheses the increase over the RSS just "
            "before the model was built (what the model, optimizer state, "
            "activations and precision copies cost)."
        )
    return (
        "Peak memory (approximate): resident-set high-water mark (VmHWM), reset "
        "before each run in this process; in parentheses the increase over the "
        "RSS before the run, median over rounds. Memory freed by earlier runs and "
        "kept by the allocator is reused without raising the RSS, so the increase "
        "understates a run's needs; use --memory subprocess for per-contender "
        "numbers."
    )


def subprocess_env() -> dict[str, str]:
    """This process's environment, with the folders holding the imported
    ``ampnet`` and ``ampnet_bench`` first on ``PYTHONPATH``, so that a child
    interpreter runs the same code (a source checkout as well as an install)."""
    import ampnet
    import ampnet_bench

    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (ampnet_bench, ampnet)]
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + rest))
    return env


def probe_in_subprocess(
    cfg_dict: dict[str, Any], workload: str, contender: str, timeout: float | None = None
) -> MemoryReading:
    """Run one contender once in a fresh interpreter and return its
    :class:`MemoryReading` (see :mod:`ampnet_bench.memprobe`).

    Raises
    ------
    RuntimeError
      The subprocess failed; the message holds the end of its stderr.
    """
    payload = json.dumps({"config": cfg_dict, "workload": workload, "contender": contender})
    proc = subprocess.run(
        [sys.executable, "-m", "ampnet_bench.memprobe", payload],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"memory probe for {contender} on {workload} failed (exit {proc.returncode}): "
            + " | ".join(tail)
        )
    result = json.loads(lines[-1])
    return MemoryReading(result["method"], result["peak_mb"], result["delta_mb"])
