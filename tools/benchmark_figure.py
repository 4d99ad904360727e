"""Draw the docs' benchmark figures, and measure and regenerate the per-workload sections.

The figures of ``docs/user_guide/performance.md`` (section "Memory and speed") are kept in
``docs/_data/benchmark.json``; this script draws them as ``docs/_static/benchmark.png``, the picture the
performance page and the README show. ``tests/ecosystem/test_docs.py`` checks that the JSON holds the numbers of the
page's tables, so the picture and the tables cannot drift apart.

    python tools/benchmark_figure.py            # rewrite the PNG from the JSON
    python tools/benchmark_figure.py --tables   # print the JSON the page's tables give (to update it)

The page's section "Every workload" (a table and a chart per model workload: MLP, CNN, transformer,
ResNet, RNN) is generated from ``docs/_data/benchmark_workloads.json`` (see ``ampnet_bench.docs_tables``):

    python tools/benchmark_figure.py --measure       # run every workload's benchmark (fresh processes,
                                                     # 3 rounds, tuned malloc; minutes per workload),
                                                     # then write the JSON, the tables and the charts
    python tools/benchmark_figure.py --measure --workload rnn    # one workload; the others are kept
    python tools/benchmark_figure.py --from DIR      # the same from earlier runs' DIR/<workload>/results.json
    python tools/benchmark_figure.py --workloads     # tables and charts from the JSON as it is
    python tools/benchmark_figure.py --placeholders  # back to "not yet measured" everywhere

A fresh ``python -m ampnet.benchmark`` run writes its own ``results.png``; after such a run, update the
page's tables, then the JSON (``--tables``), then the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "user_guide" / "performance.md"
DATA = ROOT / "docs" / "_data" / "benchmark.json"
PNG = ROOT / "docs" / "_static" / "benchmark.png"
WORKLOADS_DATA = ROOT / "docs" / "_data" / "benchmark_workloads.json"
STATIC = ROOT / "docs" / "_static"
#: glibc malloc settings of the measurement (set for the benchmark's processes where unset)
MALLOC = (("MALLOC_MMAP_MAX_", "0"), ("MALLOC_TRIM_THRESHOLD_", "17179869184"))

#: The figure's title: the machine of the page's "Memory and speed" section (0.3, November 2026).
TITLE = ("ampnet against a hand-written AMP loop, skorch + accelerate and Lightning (bf16, AdamW; 0.3 on a "
         "2-core Intel Xeon\nwith AVX512-BF16 and AMX, torch 2.13.0, November 2026)")

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
    fig.suptitle(TITLE, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


# ---- the per-workload sections ----------------------------------------------------------------------


def workload_png(name: str) -> Path:
    """The chart of one workload on the performance page."""
    return STATIC / f"benchmark-{name}.png"


def measure(out: Path, workloads: list[str]) -> Path:
    """Run the docs' benchmark of each workload (``python -m ampnet.benchmark``, fresh processes) into
    ``out/<workload>/``; returns ``out``."""
    from ampnet_bench.docs_tables import docs_command

    env = dict(os.environ)
    for key, value in MALLOC:
        env.setdefault(key, value)
    for name in workloads:
        command = [sys.executable, "-m", "ampnet.benchmark", *docs_command(name), "--out", str(out / name)]
        print("+ " + " ".join(["python", *command[1:]]), file=sys.stderr, flush=True)
        subprocess.run(command, check=True, env=env, cwd=ROOT)
    return out


def collect(out: Path, workloads: list[str], previous: dict | None = None) -> dict:
    """The page's data from ``out/<workload>/results.json`` of each workload; the workloads not named
    keep their entries of ``previous``."""
    from ampnet_bench.docs_tables import placeholder_data, summarize

    data = previous or placeholder_data()
    entries = {e["name"]: e for e in data["workloads"]}
    machine = data.get("machine")
    for name in workloads:
        results = json.loads((out / name / "results.json").read_text(encoding="utf-8"))
        entries[name] = summarize(next(w for w in results["workloads"] if w["name"] == name))
        machine = results["machine"]
    order = [e["name"] for e in placeholder_data()["workloads"]]
    return {**data, "measured": True, "source": "python -m ampnet.benchmark (results.json)", "machine": machine,
            "workloads": [entries[n] for n in order if n in entries]}


def regenerate(data: dict) -> list[Path]:
    """Write the JSON, rewrite the page's generated tables and draw each workload's chart."""
    from ampnet_bench.docs_tables import build_chart, update_page

    WORKLOADS_DATA.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    PAGE.write_text(update_page(PAGE.read_text(encoding="utf-8"), data), encoding="utf-8")
    paths = [WORKLOADS_DATA, PAGE]
    m = data.get("machine")
    subtitle = f"{m['cpu_model']}, {m['date_utc']} UTC" if data.get("measured") and m else ""
    for entry in data["workloads"]:
        path = workload_png(entry["name"])
        build_chart(entry, subtitle).savefig(path, dpi=100, metadata={"Software": None})
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", action="store_true", help="print the JSON the page's tables give")
    group = parser.add_argument_group("the per-workload sections")
    group.add_argument("--measure", action="store_true",
                       help="run every workload's benchmark, then regenerate the JSON, tables and charts")
    group.add_argument("--from", dest="from_dir", type=Path, default=None, metavar="DIR",
                       help="regenerate from DIR/<workload>/results.json of earlier runs")
    group.add_argument("--workloads", action="store_true", help="regenerate tables and charts from the JSON")
    group.add_argument("--placeholders", action="store_true", help="reset the JSON to 'not yet measured'")
    group.add_argument("--workload", nargs="+", default=None, metavar="NAME",
                       help="with --measure or --from: only these workloads (default: all model workloads)")
    group.add_argument("--out", type=Path, default=ROOT / "benchmark-results" / "docs", metavar="DIR",
                       help="with --measure: where each run writes its results (default: benchmark-results/docs)")
    args = parser.parse_args(argv)
    if args.measure or args.from_dir or args.workloads or args.placeholders:
        from ampnet_bench.docs_tables import placeholder_data
        from ampnet_bench.workloads import MODEL_WORKLOADS

        names = list(args.workload or MODEL_WORKLOADS)
        unknown = sorted(set(names) - set(MODEL_WORKLOADS))
        if unknown:
            parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(MODEL_WORKLOADS)}")
        previous = json.loads(WORKLOADS_DATA.read_text(encoding="utf-8")) if WORKLOADS_DATA.exists() else None
        if args.placeholders:
            data = placeholder_data()
        elif args.measure or args.from_dir:
            data = collect(measure(args.out, names) if args.measure else args.from_dir, names, previous)
        else:
            data = previous or placeholder_data()
        for path in regenerate(data):
            print(path)
        return 0
    if args.tables:
        json.dump(read_tables(), sys.stdout, indent=1, ensure_ascii=False)
        print()
        return 0
    print(draw(json.loads(DATA.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
