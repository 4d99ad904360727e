"""Subprocess entry point of ``--isolation process``: run one contender
once in a fresh interpreter and print its outcome and peak memory as one
JSON line.

Used as ``python -m ampnet_bench.worker '<json>'`` by
:func:`run_in_subprocess`; the JSON holds the benchmark config, the
workload name, the contender key and, for ``predict`` workloads, the path
of the weights to predict with. Not meant to be run by hand.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
from typing import Any

import torch

from ampnet_bench.config import BenchConfig
from ampnet_bench.contenders import CONTENDERS, ContenderUnavailable, RunOutcome, run_contender
from ampnet_bench.memory import MemoryMeter, MemoryReading, subprocess_env
from ampnet_bench.workloads import get_workload

__all__ = ["run_in_subprocess"]


def _run(payload: dict[str, Any]) -> dict[str, Any]:
    cfg = BenchConfig.from_dict(payload["config"])
    torch.set_num_threads(cfg.threads)
    wl = cfg.workload(payload["workload"])
    contender = next(c for c in CONTENDERS if c.key == payload["contender"])
    weights = None
    if payload.get("weights"):
        weights = torch.load(payload["weights"], weights_only=True)
    # prime on a miniature of the workload (two batches) so that lazily loaded
    # code and kernel caches are resident before the memory mark is reset
    mini = get_workload(wl.name, quick=True, n_samples=2 * wl.batch_size,
                        batch_size=wl.batch_size, channels_last=wl.channels_last)
    mini_cfg = dataclasses.replace(cfg, quick=True, warmup=0, epochs=1)
    mini_data = mini.make_data(cfg.seed)
    run_contender(contender, mini, mini_data, mini_cfg,
                  weights=None if weights is None else _mini_weights(mini, cfg))
    data = wl.make_data(cfg.seed)
    gc.collect()
    meter = MemoryMeter(cfg.device)
    outcome = run_contender(contender, wl, data, cfg, weights=weights, meter=meter)
    assert meter.reading is not None
    return {"outcome": dataclasses.asdict(outcome), "memory": meter.reading.to_dict()}


def _mini_weights(mini: Any, cfg: BenchConfig) -> dict[str, torch.Tensor]:
    return mini.build_module(cfg.seed).state_dict()


def run_in_subprocess(
    cfg: BenchConfig, workload: str, contender: str, weights: str | None = None
) -> tuple[RunOutcome, MemoryReading]:
    """Run one contender once in a fresh interpreter.

    Returns
    -------
    (RunOutcome, MemoryReading)

    Raises
    ------
    ContenderUnavailable
      The contender cannot run here; the message says why.
    RuntimeError
      The run failed; the message holds the last line of the child's error.
    """
    payload = json.dumps({"config": cfg.to_dict(), "workload": workload,
                          "contender": contender, "weights": weights})
    proc = subprocess.run([sys.executable, "-m", "ampnet_bench.worker", payload],
                          capture_output=True, text=True, env=subprocess_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"outcome"')]
    if proc.returncode != 0 or not lines:
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line]
        last = tail[-1] if tail else f"worker exited with {proc.returncode}"
        name, sep, reason = last.partition(": ")
        if sep and name.rsplit(".", 1)[-1] == ContenderUnavailable.__name__:
            raise ContenderUnavailable(reason)
        raise RuntimeError(last)
    result = json.loads(lines[-1])
    return RunOutcome(**result["outcome"]), MemoryReading(**result["memory"])


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))))
