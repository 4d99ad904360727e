"""Benchmark of ampnet against a hand-written PyTorch loop and skorch.

Run ``python -m ampnet.benchmark --help`` (or ``python -m ampnet_bench --help``). Modules:

- :mod:`~ampnet_bench.workloads`: models (MLP, CNN, transformer encoder, ResNet-18, LSTM) and synthetic data;
- :mod:`~ampnet_bench.contenders`: the raw loop, skorch and AmpNet runs;
- :mod:`~ampnet_bench.runner`: interleaved rounds and per-round ratios;
- :mod:`~ampnet_bench.memory`: peak-memory measurement;
- :mod:`~ampnet_bench.report`: Markdown, JSON and PNG output;
- :mod:`~ampnet_bench.cli`: the command line;
- :mod:`~ampnet_bench.check`: the one-call GPU check (``--check``, ``--dry-run``);
- :mod:`~ampnet_bench.docs_tables`: the performance page's per-workload tables and charts.

The memory-probe subprocess entry point, :mod:`ampnet_bench.memprobe`,
is deliberately not imported here.
"""

from ampnet_bench.check import CheckPlan, run_check
from ampnet_bench.cli import main
from ampnet_bench.config import BenchConfig
from ampnet_bench.runner import run_benchmark

__all__ = ["main", "BenchConfig", "run_benchmark", "CheckPlan", "run_check"]
