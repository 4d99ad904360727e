"""The notebooks run top to bottom on CPU, with the tools the dev extra
installs, and show what they claim; their plots are titled, labelled and
readable."""

import base64
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

#: Appended to a notebook under test: describes every figure it left in its namespace.
FIGURE_REPORT = """\
import json as _json, matplotlib.figure as _mfig
print("FIGURES " + _json.dumps([
    {"size_px": [float(v) for v in _f.get_size_inches() * _f.dpi],
     "axes": [{"title": _a.get_title(), "xlabel": _a.get_xlabel(), "ylabel": _a.get_ylabel()}
              for _a in _f.axes]}
    for _f in list(globals().values()) if isinstance(_f, _mfig.Figure)
]))
"""


def stream_text(nb):
    return "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.get("outputs", []) if out.get("output_type") == "stream"
    )


def png_sizes(nb):
    sizes = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {}).get("image/png")
            if data:
                png = base64.b64decode(data)
                sizes.append(struct.unpack(">II", png[16:24]))  # IHDR width, height
    return sizes


def run_with_nbconvert(name, tmp_path):
    """Execute a copy of the notebook with ``jupyter nbconvert --execute``, as
    the notebooks' README says, plus the figure report."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(FIGURE_REPORT))
    path = tmp_path / name
    nbformat.write(nb, path)
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--inplace", "--ExecutePreprocessor.timeout=300", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return nbformat.read(path, as_version=4)


def run_notebook(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return stream_text(nb)


@pytest.mark.slow
def test_quickstart(tmp_path):
    nb = run_with_nbconvert("01_quickstart.ipynb", tmp_path)
    text = stream_text(nb)
    assert "bfloat16 (mixed)" in text
    assert "best:" in text
    # a crash after epoch 3, then the same call again finishes the 6 epochs exactly
    assert "crashed: simulated crash after epoch 3" in text
    assert "epochs in resumed history: 6" in text
    assert "bitwise identical weights: True" in text
    figures = json.loads(text.split("FIGURES ", 1)[1].splitlines()[0])
    assert figures, "the quickstart plots the loss scale"
    for fig in figures:
        width, height = fig["size_px"]
        assert width >= 600 and height >= 300
        for ax in fig["axes"]:
            assert ax["title"] and ax["xlabel"] and ax["ylabel"], ax
    shown = png_sizes(nb)
    assert shown and all(w >= 600 and h >= 300 for w, h in shown), shown


@pytest.mark.slow
def test_precision_control(tmp_path):
    text = run_notebook("02_precision_control.ipynb", tmp_path)
    assert "Recommended amp_fp32_modules: ['big']" in text
    assert "head (input, output): (torch.float32, torch.float32)" in text
    assert "same predicted class: 1.0" in text
