"""Measure the overhead regime on the CPU and regenerate the performance page's table.

The overhead workload (``python -m ampnet.benchmark --workload overhead``: an MLP 20-32-2, batch 32,
400 steps an epoch, SGD with momentum, one torch thread) times the trainer, not the compute. This script
runs it with every contender in a fresh process per round (``ampnet_bench.overhead_table.OVERHEAD_RUN``),
writes what the page shows to ``docs/_data/benchmark_overhead_cpu.json`` and rewrites the table of
``docs/user_guide/performance.md`` between its ``overhead-cpu`` markers (both files atomically):

    python tools/overhead_benchmark.py                        # measure, then write the JSON and the table
    python tools/overhead_benchmark.py --from DIR/results.json   # the same from an earlier run's results
    python tools/overhead_benchmark.py --page                 # the table from the JSON as it is
    python tools/overhead_benchmark.py --placeholder          # back to "not yet measured"

Run it on a quiet machine: its figures are only as good as the machine is idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ampnet_bench.files import write_text_atomic  # noqa: E402
from ampnet_bench.overhead_table import (  # noqa: E402
    OVERHEAD_RUN,
    placeholder_overhead,
    summarize_overhead,
    update_overhead_section,
)

PAGE = ROOT / "docs" / "user_guide" / "performance.md"
DATA = ROOT / "docs" / "_data" / "benchmark_overhead_cpu.json"


def measure(out: Path) -> Path:
    """Run the overhead benchmark (fresh processes, one thread) into ``out``; return its results.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "ampnet.benchmark", *OVERHEAD_RUN, "--out", str(out)],
                   check=True, cwd=ROOT, env=env)
    return out / "results.json"


def write(data: dict, page: Path = PAGE, path: Path = DATA) -> None:
    """Write ``data`` to the JSON file and its table to the page (the page first checked for its markers)."""
    text = update_overhead_section(page.read_text(encoding="utf-8"), data)
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
    write_text_atomic(page, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--from", dest="source", type=Path, metavar="RESULTS_JSON",
                       help="an earlier run's results.json instead of measuring")
    group.add_argument("--page", action="store_true", help="regenerate the table from the JSON as it is")
    group.add_argument("--placeholder", action="store_true", help="reset the JSON and the table to placeholders")
    args = parser.parse_args(argv)
    if args.placeholder:
        data = placeholder_overhead()
    elif args.page:
        data = json.loads(DATA.read_text(encoding="utf-8"))
    elif args.source is not None:
        data = summarize_overhead(json.loads(args.source.read_text(encoding="utf-8")))
    else:
        with tempfile.TemporaryDirectory(prefix="ampnet-overhead-") as tmp:
            data = summarize_overhead(json.loads(measure(Path(tmp)).read_text(encoding="utf-8")))
    write(data)
    print(f"Wrote {DATA.relative_to(ROOT)} and the table of {PAGE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
