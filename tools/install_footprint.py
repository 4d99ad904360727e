"""Measure how much disk each optional group of ampnet's dependencies takes once installed.

Builds throw-away virtual environments: one with ampnet's core (torch, skorch, scikit-learn, numpy), then
one per group, which sees the core's packages (a ``.pth`` file) and so installs only what the group adds.
Prints a Markdown table of the sizes of the installed files (``site-packages`` and ``bin``), in MB (10**6
bytes), and the wheels downloaded. Needs the network (PyPI) or a local wheel index, and some minutes.

    python tools/install_footprint.py [--torch "torch==2.13.0"] [--keep DIR]

``--torch`` says which torch the core gets: where pip takes torch from PyPI on Linux, that is the CUDA
build, several GB; the default asks for the CPU build from PyTorch's CPU index.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The groups, as the ``dev``, ``test`` and ``docs`` extras of pyproject.toml list them.
GROUPS = {
    "test tools (`test` extra: pytest, hypothesis, safetensors)": ["pytest>=7", "hypothesis", "safetensors"],
    "matplotlib": ["matplotlib"],
    "Jupyter (nbformat, nbclient, nbconvert, ipykernel)": ["nbformat", "nbclient", "nbconvert", "ipykernel"],
    "TensorBoard": ["tensorboard"],
    "Dask (`dask` extra)": ["dask[distributed]"],
    "ONNX (`onnx` extra: onnx, onnxruntime, onnxscript)": ["onnx", "onnxruntime", "onnxscript"],
    "Sphinx (`docs` extra, without matplotlib and ipykernel)": ["sphinx>=7", "myst-nb>=1.1", "numpydoc>=1.6",
                                                               "furo"],
    "the whole `test` extra": ["pytest>=7", "hypothesis", "safetensors", "matplotlib"],
    "the whole `dev` extra": ["pytest>=7", "hypothesis", "safetensors", "tensorboard", "matplotlib", "nbformat",
                              "nbclient", "nbconvert", "ipykernel", "onnx", "onnxruntime", "onnxscript",
                              "dask[distributed]"],
}


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            p = Path(dirpath, name)
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def _make_env(where: Path) -> tuple[Path, Path]:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    python = where / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    return python, site


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True)


def _installed(where: Path, site: Path, empty: int) -> int:
    return _size(site) + _size(where / "bin") - empty


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", nargs="+", default=["torch", "--index-url",
                                                       "https://download.pytorch.org/whl/cpu"],
                        help="pip arguments that install the core's torch")
    parser.add_argument("--keep", type=Path, help="build the environments here and keep them")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="measure only the groups whose name holds one of these words")
    args = parser.parse_args(argv)
    top = args.keep or Path(tempfile.mkdtemp(prefix="ampnet-footprint-"))
    try:
        _empty_py, empty_site = _make_env(top / "empty")
        empty = _size(empty_site) + _size(top / "empty" / "bin")
        core_py, core_site = _make_env(top / "core")
        _pip(core_py, *args.torch)
        torch_size = _installed(top / "core", core_site, empty)
        _pip(core_py, str(ROOT))
        core_size = _installed(top / "core", core_site, empty)
        rows = [("torch (" + " ".join(args.torch) + ")", torch_size),
                ("ampnet's core: torch, skorch, scikit-learn, numpy", core_size)]
        for i, (name, packages) in enumerate(GROUPS.items()):
            if args.only and not any(word in name for word in args.only):
                continue
            where = top / f"group{i}"
            py, site = _make_env(where)
            (site / "_ampnet_core.pth").write_text(str(core_site) + "\n")
            _pip(py, *packages)
            rows.append((name + ", on top of the core", _installed(where, site, empty)))
        print("| what | installed size |")
        print("|---|---:|")
        for name, size in rows:
            print(f"| {name} | {size / 1e6:,.0f} MB |")
    finally:
        if args.keep is None:
            shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
