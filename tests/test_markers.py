"""The test selection the README promises: ``python -m pytest`` and
``python -m pytest -m "not slow"`` leave out the tests marked ``gpu``;
``-m gpu`` runs only those."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def collected(*args):
    """The test ids that ``python -m pytest --collect-only`` selects from test_scaler.py, which
    has a cpu and a cuda (gpu) case of the device x dtype fixture."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args, "tests/test_scaler.py"],
        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_gpu_tests_are_deselected_unless_asked_for():
    default = collected()
    assert any("[cpu-float16]" in t for t in default)
    assert not [t for t in default if "[cuda-" in t]
    assert collected("-m", "not slow") == [t for t in default if "slow" not in t]  # no slow test there
    gpu = collected("-m", "gpu")
    assert gpu and not set(gpu) & set(default)
    cuda = [t for t in gpu if "[cuda-" in t]  # the device x dtype fixture's cuda cases
    assert cuda and {t.replace("[cuda-", "[cpu-") for t in cuda} <= set(default)
