"""Benchmark of ampnet against a hand-written PyTorch loop and skorch.

Run ``python -m ampnet.benchmark --help`` (or ``python -m ampnet_bench --help``). Modules:

- :mod:`~ampnet_bench.workloads`: models (MLP, CNN, transformer encoder, ResNet-18, LSTM; the overhead MLP;
  the GPU workloads) and synthetic data;
- :mod:`~ampnet_bench.gpu_models`: the models sized for a GPU (ResNet-50, a GPT-2-small-sized decoder);
- :mod:`~ampnet_bench.careful_loop`: the careful hand-written loop (data on the device, fused optimizer,
  the loss read once an epoch);
- :mod:`~ampnet_bench.contenders`: the raw loops, skorch and AmpNet runs;
- :mod:`~ampnet_bench.runner`: interleaved rounds and per-round ratios;
- :mod:`~ampnet_bench.memory`: peak-memory measurement;
- :mod:`~ampnet_bench.report`: Markdown, JSON and PNG output;
- :mod:`~ampnet_bench.cli`: the command line;
- :mod:`~ampnet_bench.check`: the one-call GPU check (``--check``, ``--dry-run``);
- :mod:`~ampnet_bench.check_report`: its Markdown report, issue 37's targets first;
- :mod:`~ampnet_bench.docs_tables`: the performance page's per-workload tables and charts;
- :mod:`~ampnet_bench.overhead_table`: the performance page's overhead-regime table;
- :mod:`~ampnet_bench.files`: files written whole or not at all.

The memory-probe subprocess entry point, :mod:`ampnet_bench.memprobe`,
is deliberately not imported here.
"""

from ampnet_bench.check import CheckPlan, run_check
from ampnet_bench.cli import main
from ampnet_bench.config import BenchConfig
from ampnet_bench.runner import run_benchmark

__all__ = ["main", "BenchConfig", "run_benchmark", "CheckPlan", "run_check"]
