"""``python -m ampnet.benchmark``: see :mod:`ampnet.benchmark.cli`."""

from ampnet.benchmark.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
