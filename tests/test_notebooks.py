"""The notebooks run top to bottom on CPU and show what they claim."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    return "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.get("outputs", []) if out.get("output_type") == "stream"
    )


def test_quickstart(tmp_path):
    text = run_notebook("01_quickstart.ipynb", tmp_path)
    assert "bfloat16 (mixed)" in text
    assert "bitwise identical weights: True" in text
    assert "best:" in text


def test_precision_control(tmp_path):
    text = run_notebook("02_precision_control.ipynb", tmp_path)
    assert "Recommended amp_fp32_modules: ['big']" in text
    assert "head (input, output): (torch.float32, torch.float32)" in text
    assert "same predicted class: 1.0" in text
