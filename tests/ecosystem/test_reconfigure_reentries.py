"""Configuration never climbs back up: no path of ``initialize()`` or
``set_params`` re-enters ``ampnet/config/reconfigure.py`` while it is on the
stack, the paths that rebuild the optimizers included (the count of
tools/structure_report.py, which docs/architecture.md quotes)."""

from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np
import pytest

from repo_paths import ROOT


def _report():
    spec = importlib.util.spec_from_file_location("structure_report", os.path.join(ROOT, "tools", "structure_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _report()


@pytest.mark.parametrize("path", report.REENTRY_PATHS, ids=[p[0] for p in report.REENTRY_PATHS])
def test_no_configuration_path_reenters_reconfigure(path):
    rng = np.random.RandomState(0)
    X = rng.randn(128, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ((label, count),) = report.reentries(X, y, paths=(path,))
    assert label == path[0] and count == 0
