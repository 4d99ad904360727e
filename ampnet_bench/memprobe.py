"""Subprocess entry point of ``--memory subprocess``: run one contender once
in a fresh interpreter and print its peak memory as one JSON line.

Used as ``python -m ampnet_bench.memprobe '<json>'`` by
:func:`ampnet_bench.memory.probe_in_subprocess`; the JSON holds the
benchmark config, the workload name and the contender key. Not meant to be
run by hand.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys

import torch

from ampnet_bench.config import BenchConfig
from ampnet_bench.contenders import CONTENDERS, run_contender
from ampnet_bench.memory import MemoryMeter
from ampnet_bench.workloads import get_workload


def probe(payload: dict) -> dict:
    """Measure one contender on one workload; returns the reading as a dict.

    Parameters
    ----------
    payload : dict
      ``{"config": BenchConfig.to_dict(), "workload": name, "contender": key}``.
    """
    cfg = BenchConfig.from_dict(payload["config"])
    torch.set_num_threads(cfg.threads)
    wl = cfg.workload(payload["workload"])
    contender = next(c for c in CONTENDERS if c.key == payload["contender"])
    # prime: the same contender on a miniature of the workload (same layer
    # types, two batches), so that lazily loaded code, thread pools and
    # kernel caches are resident before the measurement and the increase
    # reflects the run itself rather than first use of torch
    mini = get_workload(wl.name, quick=True, n_samples=2 * wl.batch_size,
                        batch_size=wl.batch_size, channels_last=wl.channels_last)
    mini_cfg = dataclasses.replace(cfg, quick=True, warmup=0, epochs=1)
    run_contender(contender, mini, mini.make_data(cfg.seed), mini_cfg)
    data = wl.make_data(cfg.seed)
    gc.collect()
    meter = MemoryMeter(cfg.device)
    # predict workloads: the weights' values do not change the memory use,
    # so the (untimed) reference training is skipped here
    run_contender(contender, wl, data, cfg, weights=None, meter=meter)
    assert meter.reading is not None
    return meter.reading.to_dict()


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
