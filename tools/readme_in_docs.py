"""Check that every section of a README has a home in the documentation site.

Splits the README into sections (its headings) and each section into units: the sentences of its prose,
the rows of its tables and the lines of its code blocks. A unit is at home when the site's Markdown pages
(``docs/**/*.md``, the notebooks' README and the notebooks' Markdown cells) hold it, word for word after
the Markdown is stripped, or nearly so (an edited sentence: a similarity of at least ``--ratio``). Prints,
per section, the page that holds most of it and every unit that is nowhere; exits 1 if any unit is
nowhere.

    python tools/readme_in_docs.py                    # the README.md of this checkout
    python tools/readme_in_docs.py --readme OTHER.md  # e.g. a README merged from other branches
    python tools/readme_in_docs.py -v                 # also list the units found only nearly

Used when the README shrinks to its first screens: what it loses must be in the site first. A README
section holding the line ``<!-- readme-only -->`` (its links into the site, say) is not looked for.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Files of docs/ that are not pages of the site.
NOT_PAGES: set[str] = set()
MIN_CHARS = 25  # shorter units ("Tested.", a lone ``)``) say too little to be looked for
#: Units that the site words differently on purpose, one a line (normalized, as ``-v`` prints them),
#: each after a ``#`` comment that says why.
ACCEPTED = DOCS / "_readme_accepted.txt"
#: A line that marks a README section as the README's own (links into the site): not looked for.
READ_ME_ONLY = "<!-- readme-only -->"


def normalize(text: str) -> str:
    """Text without Markdown: links keep their text, emphasis and code marks go, spaces collapse."""
    text = re.sub(r"\{(?:doc|ref|class|meth|func)\}`([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)
    while True:  # links keep their text (twice for an image inside a link)
        text, n = re.subn(r"!?\[([^\]\[]*)\]\([^)]*\)", r"\1", text)
        if not n:
            break
    text = text.replace("**", "").replace("`", "").replace("*", "")
    text = re.sub(r"\s+", " ", text)
    return text.strip().lower()


def unit(text: str) -> str:
    """A normalized unit, without the punctuation around it."""
    return normalize(text).strip("()[].,:;!? ")


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph; a bold lead-in (``**Label.** Text``) is a unit of its own, as a
    heading of the site may hold it."""
    label = re.match(r"^\*\*([^*]+)\*\*\s*(.*)$", paragraph)
    head, paragraph = ([label[1]], label[2]) if label else ([], paragraph)
    parts = head + re.split(r"(?<=[.:;!?])\s+(?=[A-Z(`*\"])", paragraph)
    return [p for p in (unit(p) for p in parts) if p]


@dataclass
class Section:
    title: str
    line: int
    units: list[str] = field(default_factory=list)
    readme_only: bool = False


def parse(markdown: str) -> list[Section]:
    """The sections of a Markdown file (one per heading; the text before the first is the first) and
    their units."""
    sections = [Section("(top)", 1)]
    paragraph: list[str] = []
    fence = False

    def flush() -> None:
        if paragraph:
            sections[-1].units.extend(split_sentences(" ".join(paragraph)))
            paragraph.clear()

    for number, line in enumerate(markdown.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            fence = not fence
            continue
        if fence:
            code = unit(stripped.split("  #")[0])
            if code and not code.startswith("#"):
                sections[-1].units.append(code)
            continue
        if stripped == READ_ME_ONLY:
            sections[-1].readme_only = True
            continue
        if re.match(r"^#{1,6} ", line):
            flush()
            sections.append(Section(line.lstrip("#").strip(), number))
            sections[-1].units.append(unit(line.lstrip("#")))
        elif stripped.startswith("|"):
            flush()
            if not re.match(r"^\|[\s|:-]+\|$", stripped):
                sections[-1].units.append(unit(stripped))
        elif not stripped or re.match(r"^([-*+]|\d+\.) ", stripped) or stripped.startswith(("%", "(")) \
                and stripped.endswith(")="):
            flush()
            if stripped and not stripped.startswith("%"):
                paragraph.append(re.sub(r"^([-*+]|\d+\.) ", "", stripped))
        else:
            paragraph.append(stripped)
    flush()
    return [s for s in sections if s.units or s.title != "(top)"]


def site_pages(docs: Path = DOCS) -> dict[str, str]:
    """The site's text by page: its Markdown pages, and the notebooks' Markdown cells."""
    pages = {}
    for path in sorted(docs.rglob("*.md")):
        rel = path.relative_to(docs)
        if rel.parts[0].startswith("_build") or path.name in NOT_PAGES:
            continue
        pages[str(rel)] = path.read_text(encoding="utf-8")
    notebooks = docs.parent / "notebooks"
    if (notebooks / "README.md").exists():
        pages["notebooks/README.md"] = (notebooks / "README.md").read_text(encoding="utf-8")
    for path in sorted(notebooks.glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        pages[f"notebooks/{path.name}"] = "\n\n".join(
            "".join(c["source"]) if c["cell_type"] == "markdown" else "```\n" + "".join(c["source"]) + "\n```"
            for c in cells)
    return pages


def accepted(path: Path = ACCEPTED) -> set[str]:
    if not path.exists():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines()
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


def check(readme: Path, ratio: float = 0.85) -> tuple[list[dict], int]:
    pages = site_pages()
    known = accepted()
    units_by_page = {name: [u for s in parse(text) for u in s.units] for name, text in pages.items()}
    flat_by_page = {name: " \n ".join(units) for name, units in units_by_page.items()}
    all_units = [(name, u) for name, units in units_by_page.items() for u in units]
    report, missing_total = [], 0
    for section in parse(readme.read_text(encoding="utf-8")):
        homes: dict[str, int] = {}
        near, missing = [], []
        for text in section.units:
            if section.readme_only or len(text) < MIN_CHARS or text in known:
                continue
            page = next((name for name, flat in flat_by_page.items() if text in flat), None)
            if page is None:
                best, best_page = 0.0, None
                for name, candidate in all_units:
                    matcher = difflib.SequenceMatcher(None, text, candidate, autojunk=False)
                    if matcher.real_quick_ratio() >= ratio and matcher.quick_ratio() >= ratio:
                        r = matcher.ratio()
                        if r > best:
                            best, best_page = r, name
                if best >= ratio:
                    page = best_page
                    near.append((text, best_page, best))
            if page is None:
                missing.append(text)
            else:
                homes[page] = homes.get(page, 0) + 1
        missing_total += len(missing)
        if section.readme_only:
            report.append({"section": section.title, "line": section.line, "home": "(README only)",
                           "units": 0, "near": [], "missing": []})
            continue
        report.append({"section": section.title, "line": section.line,
                       "home": max(homes, key=homes.get) if homes else None,
                       "units": sum(homes.values()) + len(missing), "near": near, "missing": missing})
    return report, missing_total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--ratio", type=float, default=0.85, help="similarity that counts as found (0-1)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the units found only nearly")
    args = parser.parse_args(argv)
    report, missing_total = check(args.readme, args.ratio)
    for entry in report:
        status = "ok" if not entry["missing"] else f"{len(entry['missing'])} of {entry['units']} missing"
        print(f"{args.readme.name}:{entry['line']} {entry['section']!r} -> {entry['home'] or '-'} ({status})")
        for text in entry["missing"]:
            print(f"    missing: {text[:160]}")
        if args.verbose:
            for text, page, r in entry["near"]:
                print(f"    near ({r:.2f}, {page}): {text[:140]}")
    sections = len(report)
    homeless = sum(1 for e in report if e["missing"])
    print(f"{sections} sections, {sections - homeless} at home in docs/, {missing_total} units missing")
    return 1 if missing_total else 0


if __name__ == "__main__":
    sys.exit(main())
