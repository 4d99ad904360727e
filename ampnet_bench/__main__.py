"""``python -m ampnet_bench`` (also ``python -m ampnet.benchmark``): see :mod:`ampnet_bench.cli`."""

from ampnet_bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
