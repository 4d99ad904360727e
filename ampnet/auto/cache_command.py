"""``python -m ampnet cache``: the folder where ``amp_enabled='auto'``
stores its choices and the entries in it; ``--clear`` removes those
entries, and nothing else of the folder.

An entry is a file that ampnet wrote (:mod:`ampnet.auto.cache`): its name
is ``auto-`` and 40 hexadecimal digits, ``.json``, and it holds a JSON
object with ampnet's ``version``, ``key`` and ``params``. A file with
another name, or another content under such a name (a folder given as
``amp_autotune__cache`` may hold the user's own files), is listed as
"not ampnet's" and kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ampnet.auto import cache
from ampnet.auto.enabled import label

__all__ = ["Entry", "entries", "clear", "main"]

#: The name of a file that ampnet's cache writes.
ENTRY_NAME = re.compile(r"auto-[0-9a-f]{40}\.json")


@dataclass(frozen=True)
class Entry:
    """A file of the cache folder that ampnet wrote.

    Attributes
    ----------
    path : str
      The file.
    params : dict
      The stored choice's constructor parameters.
    step_s : float or None
      The chosen setting's measured step, in seconds (None where unreadable).
    written : float or None
      When it was written (seconds since the epoch; None where unreadable).
    """

    path: str
    params: dict[str, Any]
    step_s: float | None
    written: float | None


def _read_entry(path: str) -> Entry | None:
    """The entry in ``path``: None where it is not a regular file that holds
    one of ampnet's entries (at most :data:`ampnet.auto.cache.MAX_BYTES`)."""
    try:
        raw = cache.read_bytes(path)  # a regular file only, no link followed, MAX_BYTES + 1 bytes at most
    except (OSError, ValueError):
        return None
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode("utf-8")) if len(raw) <= cache.MAX_BYTES else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("version"), int) and isinstance(data.get("key"), dict)
            and isinstance(data.get("params"), dict)):
        return None
    number = (lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
    try:
        step, written = number(data.get("step_s")), number(data.get("written"))
    except OverflowError:
        step = written = None
    return Entry(path, data["params"], step, written)


def entries(folder: str) -> tuple[list[Entry], list[str]]:
    """ampnet's entries in ``folder``, oldest first, and the names of the
    other files there (kept by :func:`clear`); both empty where there is
    no such folder.

    Parameters
    ----------
    folder : str
      The cache folder (:func:`ampnet.auto.cache.cache_dir`).
    """
    try:
        with os.scandir(folder) as it:
            names = sorted(e.name for e in it)
    except OSError:
        return [], []
    found, others = [], []
    for name in names:
        entry = _read_entry(os.path.join(folder, name)) if ENTRY_NAME.fullmatch(name) else None
        if entry is None:
            others.append(name)
        else:
            found.append(entry)
    found.sort(key=lambda e: (e.written or 0.0, e.path))
    return found, others


def clear(folder: str) -> tuple[list[str], list[str]]:
    """Remove ampnet's entries from ``folder`` (see the module's docs);
    every other file stays.

    Parameters
    ----------
    folder : str
      The cache folder.

    Returns
    -------
    removed : list of str
      The files removed.
    failed : list of str
      ``'<file>: <why>'`` for each entry that could not be removed.
    """
    removed, failed = [], []
    for entry in entries(folder)[0]:
        try:
            os.remove(entry.path)
        except FileNotFoundError:
            continue  # removed by another process meanwhile
        except OSError as exc:
            failed.append(f"{entry.path}: {exc.strerror or exc}")
        else:
            removed.append(entry.path)
    return removed, failed


def _where(folder: str | None) -> str:
    if folder:
        return "the folder given with --folder"
    if os.environ.get("AMPNET_CACHE_DIR"):
        return "AMPNET_CACHE_DIR"
    return "the user's cache folder; set AMPNET_CACHE_DIR for another"


def _describe(entry: Entry) -> str:
    step = f"{entry.step_s * 1e3:.2f} ms a step" if entry.step_s is not None else "step time unreadable"
    when = (datetime.datetime.fromtimestamp(entry.written, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if entry.written is not None and 0 <= entry.written < 1e11 else "written: unknown")
    return f"  {os.path.basename(entry.path)}  {label(entry.params)}, {step}, {when}"


def main(argv: list[str] | None = None) -> int:
    """``python -m ampnet cache [--clear] [--folder FOLDER]``: print the
    cache folder and its entries, or remove the entries.

    Returns
    -------
    int
      The exit status: 0, or 1 where an entry could not be removed.
    """
    parser = argparse.ArgumentParser(
        prog="python -m ampnet cache",
        description="Show the folder where amp_enabled='auto' stores its choices and the entries in it; "
                    "--clear removes the entries (ampnet's files only), so that the next fits measure again.")
    parser.add_argument("--clear", action="store_true", help="remove ampnet's entries from the folder")
    parser.add_argument("--folder", default=None,
                        help="a folder given to a net as amp_autotune__cache (default: AMPNET_CACHE_DIR, else the "
                             "user's cache folder)")
    args = parser.parse_args(argv)
    folder = cache.cache_dir(args.folder)
    print(f"ampnet cache folder: {folder} ({_where(args.folder)})")
    if args.clear:
        removed, failed = clear(folder)
        kept = len(entries(folder)[1])
        print(f"Removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}"
              + (f"; {kept} other file{'' if kept == 1 else 's'} (not ampnet's) kept" if kept else "") + ".")
        for problem in failed:
            print(f"Could not remove {problem}")
        return 1 if failed else 0
    found, others = entries(folder)
    if not found:
        print("No entries: the next fit of an amp_enabled='auto' net measures.")
    else:
        print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, oldest first:")
        for entry in found:
            print(_describe(entry))
        print("Remove them with: python -m ampnet cache --clear"
              + (f" --folder {args.folder}" if args.folder else "") + " (the next fits measure again).")
    if others:
        print(f"{len(others)} other file{'' if len(others) == 1 else 's'} (not ampnet's): left as they are.")
    return 0
