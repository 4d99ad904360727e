"""Draw the docs' headline benchmark figure from the published tables.

The figures of ``docs/user_guide/performance.md`` (section "Memory and speed") are kept in
``docs/_data/benchmark.json``; this script draws them as ``docs/_static/benchmark.png``, the picture the
performance page and the README show. ``tests/test_docs.py`` checks that the JSON holds the numbers of the
page's tables, so the picture and the tables cannot drift apart.

    python tools/benchmark_figure.py            # rewrite the PNG from the JSON
    python tools/benchmark_figure.py --tables   # print the JSON the page's tables give (to update it)

A fresh ``python -m ampnet.benchmark`` run writes its own ``results.png``; after such a run, update the
page's tables, then the JSON (``--tables``), then the PNG.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "user_guide" / "performance.md"
DATA = ROOT / "docs" / "_data" / "benchmark.json"
PNG = ROOT / "docs" / "_static" / "benchmark.png"

#: The two tables of the page's "Memory and speed" section: the paragraph line that opens each.
TABLES = {
    "MLP 1024-2048-2048-10, batch 256": "MLP 1024-2048-2048-10, batch 256, 8192 rows per epoch",
    "CNN, 3x64x64 images, batch 64": "CNN (3 conv-BN-ReLU-maxpool blocks",
}


def _seconds(cell: str) -> float:
    value, unit = re.match(r"([\d.]+) (ms|s)\b", cell.replace("*", "")).groups()
    return float(value) / 1000 if unit == "ms" else float(value)


def _number(cell: str) -> float:
    return float(re.match(r"([\d.]+)", cell.replace("*", "")).group(1))


def read_tables(page: Path = PAGE) -> dict:
    """The figures of the page's two "Memory and speed" tables, in the layout of the JSON file."""
    lines = page.read_text(encoding="utf-8").splitlines()
    workloads = []
    for name, opener in TABLES.items():
        start = next(i for i, line in enumerate(lines) if line.startswith(opener))
        head = next(i for i in range(start, len(lines)) if lines[i].startswith("| contender"))
        rows = []
        for line in lines[head + 2:]:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append({"contender": cells[0], "epoch_s": _seconds(cells[1]),
                         "x_amp_loop": _number(cells[2]), "state_mib": _number(cells[3])})
        workloads.append({"name": name, "contenders": rows})
    return {"source": json.loads(DATA.read_text(encoding="utf-8"))["source"] if DATA.exists() else "",
            "workloads": workloads}


def _framework(contender: str) -> str:
    for key in ("AmpNet", "Lightning", "accelerate", "PyTorch", "same"):
        if key in contender:
            return key
    return "other"


def draw(data: dict, path: Path = PNG) -> Path:
    """Write the figure: one panel per workload, one bar per contender (epoch time, lower is faster),
    labelled with the time and the training state's size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = {"AmpNet": "#d62728", "Lightning": "#9467bd", "accelerate": "#2ca02c", "PyTorch": "#7f7f7f",
              "same": "#bfbfbf", "other": "#1f77b4"}
    workloads = data["workloads"]
    fig = Figure(figsize=(9, 1.2 + 3.0 * len(workloads)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(workloads), 1, squeeze=False)[:, 0]
    for ax, w in zip(axes, workloads):
        rows = w["contenders"][::-1]
        right = max(r["epoch_s"] for r in rows)
        for i, r in enumerate(rows):
            ax.barh(i, r["epoch_s"], color=colors[_framework(r["contender"])])
            ax.text(r["epoch_s"], i, f"  {r['epoch_s']:.3g} s, {r['x_amp_loop']:.2f}x loop, "
                    f"{r['state_mib']:g} MiB", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r["contender"].replace("`", "") for r in rows], fontsize=8)
        ax.set_xlim(0, right * 1.6)
        ax.set_title(w["name"], fontsize=10)
        ax.set_xlabel("seconds per epoch, median over rounds (lower is faster)\n"
                      "label: time, ratio to the autocast loop (per round), training state", fontsize=8)
    fig.suptitle("ampnet against a hand-written AMP loop, skorch + accelerate and Lightning "
                 "(bf16, AdamW, 2-core Xeon CPU)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", action="store_true", help="print the JSON the page's tables give")
    args = parser.parse_args(argv)
    if args.tables:
        json.dump(read_tables(), sys.stdout, indent=1, ensure_ascii=False)
        print()
        return 0
    print(draw(json.loads(DATA.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
