"""The notebooks run top to bottom on CPU, with the tools the dev extra
installs, and show what they claim; their plots are titled, labelled and
readable."""

import base64
import json
import os
import shlex
import re
import struct
import subprocess
import sys

import pytest

from repo_paths import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = ROOT / "notebooks"

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


#: AmpWarnings about the machine, not about the notebook's code.
HARDWARE_NOTICES = ("this CPU has no native bfloat16", "float16 autocast on CPU")


def own_amp_warnings(text):
    """AmpWarnings the notebook's own code caused (the notebook shows good use)."""
    return [line for line in text.splitlines()
            if "AmpWarning:" in line and not any(n in line for n in HARDWARE_NOTICES)]


def readme_command():
    """The ``jupyter nbconvert`` command of the notebooks' README."""
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    (line,) = [s for s in readme.splitlines() if s.startswith("jupyter nbconvert")]
    return shlex.split(line)


def run_with_nbconvert(name, tmp_path):
    """Execute a copy of the notebook with the notebooks' README's command
    (in a copy of the repository's layout), plus the figure report; the
    notebooks folder must stay as it was."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(FIGURE_REPORT))
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / name)
    command = readme_command()
    *options, notebook = command[2:]
    assert notebook.startswith("notebooks/") and notebook.endswith(".ipynb"), command
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", *options,
         "--ExecutePreprocessor.timeout=300", f"notebooks/{name}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(tmp_path / "notebooks") == [name]  # no executed copy beside the notebooks
    output_dir = options[options.index("--output-dir") + 1]
    top = output_dir.split("/")[0] + "/"
    gitignore = (NOTEBOOKS.parent / ".gitignore").read_text(encoding="utf-8").split()
    assert top in gitignore or "/" + top in gitignore, f"{output_dir} is not ignored by git"
    return nbformat.read(tmp_path / output_dir / name, as_version=4)


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
    assert own_amp_warnings(text) == []
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
    assert own_amp_warnings(text) == []  # it said: amp_dtype='bfloat16' has no effect
    assert "Recommended amp_fp32_modules: ['big']" in text
    assert "head (input, output): (torch.float32, torch.float32)" in text
    assert "same predicted class: 1.0" in text
    # the flight recorder: SGD updates round away in bfloat16 without master weights, not with them
    lost = {m: float(v) for m, v in re.findall(r"master weights (\w+) *: lost updates per epoch \[([\d.]+)", text)}
    assert lost["False"] > 0.5 and lost["True"] < 0.01, lost
