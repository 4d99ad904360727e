"""``python -m ampnet``: the demo reports progress per run, then what each
run did."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_prints_progress_and_table(tmp_path):
    err_file = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampnet", "--epochs", "1"],
        stdout=subprocess.PIPE, stderr=err_file, text=True,
    )
    # progress appears while the demo runs, not only at the end
    first = proc.stdout.readline()
    assert first.startswith("ampnet demo: scikit-learn digits")
    assert proc.stdout.readline() == "\n"
    progress = proc.stdout.read(len("[1/3] float32 (AMP off): training ..."))
    assert progress == "[1/3] float32 (AMP off): training ..."
    assert proc.poll() is None  # flushed while the first run trains
    rest = proc.stdout.read()
    proc.wait(timeout=180)
    err_file.seek(0)
    assert proc.returncode == 0, err_file.read()
    err_file.close()
    lines = (progress + rest).splitlines()
    done = [line for line in lines if line.startswith("[")]
    assert [line.split(":")[0] for line in done] == ["[1/3] float32 (AMP off)",
                                                    "[2/3] AMP, amp_dtype='auto'",
                                                    "[3/3] AMP, float16 + loss scaling"]
    assert all(" done in " in line and "(test accuracy 0." in line for line in done)
    header = next(line for line in lines if line.startswith("run"))
    columns = ("precision used", "test acc", "median epoch ms", "loss scale", "skipped")
    assert all(column in header for column in columns)
    start = header.index("loss scale")
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("float32", "AMP"))}
    scale = {label: row[start:].split()[0] for label, row in rows.items()}
    # a loss scale only where loss scaling runs
    assert scale == {"float32 (AMP off)": "-", "AMP, amp_dtype='auto'": "-",
                     "AMP, float16 + loss scaling": "65536"}
    assert "bfloat16 (mixed)" in rows["AMP, amp_dtype='auto'"]
