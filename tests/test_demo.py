"""``python -m ampnet``: the demo runs and reports what each run did."""

import subprocess
import sys


def test_demo_prints_table():
    out = subprocess.run(
        [sys.executable, "-m", "ampnet", "--epochs", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("run"))
    for column in ("precision used", "test acc", "median epoch ms", "loss scale", "skipped"):
        assert column in header
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(("float32", "AMP"))}
    assert "float32 (AMP off)" in rows and "bfloat16 (mixed)" in rows["AMP, amp_dtype='auto'"]
    assert "65536" in rows["AMP, float16 + loss scaling"]
