"""Description of the machine and environment a benchmark ran on."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["describe_machine", "load_warning", "usable_cores", "MALLOC_ENV", "RECOMMENDED_MALLOC_ENV"]

#: Environment variables that change glibc malloc's behaviour (and timings).
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")

#: The setting that stops glibc returning buffers to the OS after each step.
RECOMMENDED_MALLOC_ENV = "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184"

_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx512_fp16")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_warning(load_average: Any, cores: int) -> str | None:
    """A warning when the 1-minute load average is at or above ``cores``
    (other processes compete for the CPU), else None."""
    if not load_average or not cores:
        return None
    load = float(load_average[0])
    if load < cores:
        return None
    return (
        f"Warning: the load average is {load:.2f} on {cores} usable core(s): other processes "
        "are competing for the CPU, so these timings are slower and noisier than on an idle "
        "machine. Rerun on an idle machine before comparing them."
    )


def describe_machine() -> dict[str, Any]:
    """CPU, cores, library versions, threads, bf16 support, GPU and the
    malloc environment.

    Returns
    -------
    dict
      JSON-serializable description.
    """
    import skorch

    import ampnet

    model, flags = _cpuinfo()
    usable = usable_cores()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    gpu = None
    if torch.cuda.is_available():
        gpu = {
            "name": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_model": model,
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "cpu_flags": {flag: flag in flags for flag in _CPU_FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "skorch": skorch.__version__,
        "ampnet": ampnet.__version__,
        "ampnet_commit": _git_commit(),
        "gpu": gpu,
        "malloc_env": {name: os.environ.get(name) for name in MALLOC_ENV},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": load,
    }
