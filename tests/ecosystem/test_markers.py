"""The test selection the README promises: ``python -m pytest`` and
``python -m pytest -m "not slow"`` leave out the tests marked ``gpu``;
``-m gpu`` runs only those."""

import os
import subprocess
import sys

import pytest

from repo_paths import ROOT


#: test_scaler.py has a cpu and a cuda (gpu) case of the device x dtype fixture; test_devices.py has slow tests.
FILES = ("tests/precision/test_scaler.py", "tests/net/test_devices.py")


def collected(*args):
    """The test ids that ``python -m pytest --collect-only`` selects from :data:`FILES`."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *args, *FILES],
        cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: none selected
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_gpu_tests_are_deselected_unless_asked_for():
    default = collected()
    assert any("[cpu-float16]" in t for t in default)
    assert not [t for t in default if "test_scaler.py" in t and "[cuda-" in t]
    slow = collected("-m", "slow")
    assert slow and set(slow) <= set(default)  # the files hold slow tests, which the default run keeps
    assert collected("-m", "not slow") == [t for t in default if t not in slow]  # "not slow" leaves them out
    gpu = collected("-m", "gpu")
    assert gpu and not set(gpu) & set(default)
    cuda = [t for t in gpu if "test_scaler.py" in t and "[cuda-" in t]  # the device x dtype fixture's cuda cases
    assert cuda and {t.replace("[cuda-", "[cpu-") for t in cuda} <= set(default)
