"""``python -m ampnet.benchmark``: see :mod:`ampnet_bench.cli`."""

from ampnet.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
