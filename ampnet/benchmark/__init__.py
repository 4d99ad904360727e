"""Benchmark of ampnet against a hand-written PyTorch loop and skorch.

Run ``python -m ampnet.benchmark --help``. Modules:

- :mod:`~ampnet.benchmark.workloads`: models and synthetic data;
- :mod:`~ampnet.benchmark.contenders`: the raw loop, skorch and AmpNet runs;
- :mod:`~ampnet.benchmark.runner`: interleaved rounds and per-round ratios;
- :mod:`~ampnet.benchmark.memory`: peak-memory measurement;
- :mod:`~ampnet.benchmark.report`: Markdown, JSON and PNG output;
- :mod:`~ampnet.benchmark.cli`: the command line.

The memory-probe subprocess entry point, :mod:`ampnet.benchmark.memprobe`,
is deliberately not imported here.
"""

from ampnet.benchmark.cli import main
from ampnet.benchmark.config import BenchConfig
from ampnet.benchmark.runner import run_benchmark

__all__ = ["main", "BenchConfig", "run_benchmark"]
