"""``python -m ampnet.benchmark``: the benchmark lives in the separate
top-level package :mod:`ampnet_bench` (installed with ampnet), so that
``import ampnet`` loads no benchmark code. This module only forwards to it."""


def main(argv=None) -> int:
    """Run the benchmark (see ``ampnet_bench.cli.main``)."""
    # a separate top-level package: import ampnet loads no benchmark code
    from ampnet_bench.cli import main as bench_main

    return bench_main(argv)


__all__ = ["main"]
