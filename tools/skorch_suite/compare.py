"""Compare the JUnit results of run.sh's modes.

    python tools/skorch_suite/compare.py [RESULTS_DIR] [-v]   # default results/worktree

Prints passed/failed/skipped per mode and the tests that fail (or error)
with ampnet (modes ``off`` and ``on``) but pass with plain skorch, each
labelled with its classification from ``known.py`` (a bug, b intended,
c implementation detail; -v adds the explanation). Exit status 1 when an
ampnet-only failure is unclassified or a bug (a), else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from known import classify  # noqa: E402

MODES = ("skorch", "off", "on")
KINDS = ("passed", "failed", "error", "skipped", "xfailed")


def outcomes(path: Path) -> dict[str, str]:
    """Test id -> passed | failed | error | skipped | xfailed."""
    result: dict[str, str] = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        children = {child.tag: child for child in case}
        if "failure" in children:
            outcome = "failed"
        elif "error" in children:
            outcome = "error"
        elif "skipped" in children:
            xfail = children["skipped"].get("type") == "pytest.xfail"
            outcome = "xfailed" if xfail else "skipped"
        else:
            outcome = "passed"
        # a test can appear twice (a call failure plus a teardown error): keep the worst
        if result.get(name) in ("failed", "error"):
            continue
        result[name] = outcome
    return result


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv[1:] if a != "-v"]
    folder = Path(args[0]) if args else Path(__file__).parent / "results" / "worktree"
    runs = {m: outcomes(folder / f"{m}.xml") for m in MODES if (folder / f"{m}.xml").exists()}
    if not runs:
        print(f"no results in {folder}; run tools/skorch_suite/run.sh MODE first")
        return 2
    for mode, res in runs.items():
        counts = "  ".join(f"{k} {sum(v == k for v in res.values())}" for k in KINDS)
        print(f"{mode:7s} {counts}  (total {len(res)})")
    base = runs.get("skorch")
    if base is None:
        print("no baseline (skorch.xml): run tools/skorch_suite/run.sh skorch")
        return 0
    status = 0
    for mode in ("off", "on"):
        if mode not in runs:
            continue
        bad = sorted(
            name for name, o in runs[mode].items()
            if o in ("failed", "error") and base.get(name) == "passed"
        )
        labels = {name: classify(name, mode) for name in bad}
        tally = {}
        for label in labels.values():
            key = label[0] if label else "UNCLASSIFIED"
            tally[key] = tally.get(key, 0) + 1
        summary = ", ".join(f"{k}: {n}" for k, n in sorted(tally.items()))
        print(f"\nampnet-only failures, mode {mode}: {len(bad)}" + (f" ({summary})" if bad else ""))
        for name in bad:
            label = labels[name]
            tag = label[0] if label else "UNCLASSIFIED"
            print(f"  [{tag}] {runs[mode][name]:6s} {name}")
            if verbose and label:
                print(f"        {label[1]}")
            if not label or label[0] == "a":
                status = 1
        other = sorted(
            f"{n} ({base.get(n)} -> {o})" for n, o in runs[mode].items()
            if o != base.get(n) and n not in bad
        )
        if other:
            print(f"  other outcome changes: {', '.join(other)}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
