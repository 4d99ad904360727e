"""pytest plugin: run skorch's own test suite with ampnet's nets swapped in.

Load it with ``-p tools.skorch_suite.plugin`` (the repository root on
``sys.path``) and pick a mode with ``--ampnet-mode`` (or the environment
variable ``AMPNET_SKORCH_MODE``):

``skorch``
  No swap: plain skorch, the baseline.
``off``
  ``ampnet.AmpNet*`` as they are (``amp_enabled=False`` by default).
``on``
  Subclasses of ``ampnet.AmpNet*`` whose defaults are
  ``amp_enabled=True, amp_dtype='bfloat16'`` (CPU autocast).

How skorch's tests get their classes, and what is swapped
---------------------------------------------------------
skorch's tests import the net classes *inside* fixtures and tests
(``from skorch import NeuralNetClassifier`` in ``net_cls`` fixtures,
``from skorch.net import NeuralNet``, ``from skorch.classifier import
NeuralNetBinaryClassifier``, ``patch('skorch.NeuralNet....')``), never at
module level of the test files. Replacing the attributes below in
``pytest_configure`` (before collection) is therefore enough:

* ``skorch.NeuralNet``, ``skorch.NeuralNetClassifier``,
  ``skorch.NeuralNetBinaryClassifier``, ``skorch.NeuralNetRegressor``
* ``skorch.net.NeuralNet``
* ``skorch.classifier.NeuralNetBinaryClassifier``

``skorch.classifier.NeuralNetClassifier`` and
``skorch.regressor.NeuralNetRegressor`` are deliberately *not* replaced:
these are module globals that skorch's own methods use in
``super(NeuralNetClassifier, self)`` / ``super(NeuralNetRegressor, self)``;
swapping them would send those calls round in circles. No test in the
selection imports them from those modules (the plugin warns if one does).
``skorch.net.NeuralNet`` is safe to swap: ``skorch/net.py`` never uses the
name in code.

As a guard, the plugin counts nets of the *original* skorch classes that
get initialized during a test while a swap is active, and lists those tests
in the terminal summary (they would be tests that escaped the swap).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

MODES = ("skorch", "off", "on")
ENV_VAR = "AMPNET_SKORCH_MODE"

# ---------------------------------------------------------------------------
# flaky: skorch's test_net.py does ``from flaky import flaky``. If the
# package is missing, provide a small stand-in that reruns the test function
# up to ``max_runs`` times (what flaky does, minus its reporting).
# ---------------------------------------------------------------------------
try:  # pragma: no cover - depends on the environment
    import flaky as _flaky  # noqa: F401

    FLAKY_SOURCE = "flaky package"
except ImportError:  # pragma: no cover
    def _flaky_stub(max_runs: int = 2, min_passes: int = 1, rerun_filter: Any = None):
        def deco(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                passes = 0
                for run in range(max_runs):
                    try:
                        func(*args, **kwargs)
                        passes += 1
                        if passes >= min_passes:
                            return None
                    except Exception:
                        if run == max_runs - 1:
                            raise
                return None

            return wrapper

        if callable(max_runs) and not isinstance(max_runs, int):  # bare @flaky
            func, max_runs = max_runs, 2
            return deco(func)
        return deco

    _mod = types.ModuleType("flaky")
    _mod.flaky = _flaky_stub
    sys.modules["flaky"] = _mod
    FLAKY_SOURCE = "stand-in from tools/skorch_suite/plugin.py (pip install flaky for the real one)"


import torch  # noqa: E402

import skorch  # noqa: E402
import skorch.classifier  # noqa: E402
import skorch.net  # noqa: E402
import skorch.regressor  # noqa: E402

import ampnet  # noqa: E402
from ampnet import AmpNet, AmpNetBinaryClassifier, AmpNetClassifier, AmpNetRegressor  # noqa: E402

ORIGINAL = {
    "NeuralNet": skorch.net.NeuralNet,
    "NeuralNetClassifier": skorch.classifier.NeuralNetClassifier,
    "NeuralNetBinaryClassifier": skorch.classifier.NeuralNetBinaryClassifier,
    "NeuralNetRegressor": skorch.regressor.NeuralNetRegressor,
}


# ---------------------------------------------------------------------------
# AMP-on classes: module-level so that pickle finds them by name.
# ---------------------------------------------------------------------------
class _AmpOnDefaults:
    """Defaults ``amp_enabled=True, amp_dtype='bfloat16'``; everything else
    as the ampnet class."""

    def __init__(self, *args: Any, amp_enabled: bool = True, amp_dtype: Any = "bfloat16", **kwargs: Any):
        super().__init__(*args, amp_enabled=amp_enabled, amp_dtype=amp_dtype, **kwargs)


class AmpOnNet(_AmpOnDefaults, AmpNet):
    pass


class AmpOnNetClassifier(_AmpOnDefaults, AmpNetClassifier):
    pass


class AmpOnNetBinaryClassifier(_AmpOnDefaults, AmpNetBinaryClassifier):
    pass


class AmpOnNetRegressor(_AmpOnDefaults, AmpNetRegressor):
    pass


REPLACEMENTS = {
    "off": {
        "NeuralNet": AmpNet,
        "NeuralNetClassifier": AmpNetClassifier,
        "NeuralNetBinaryClassifier": AmpNetBinaryClassifier,
        "NeuralNetRegressor": AmpNetRegressor,
    },
    "on": {
        "NeuralNet": AmpOnNet,
        "NeuralNetClassifier": AmpOnNetClassifier,
        "NeuralNetBinaryClassifier": AmpOnNetBinaryClassifier,
        "NeuralNetRegressor": AmpOnNetRegressor,
    },
}

#: (module, attribute) pairs that are swapped; see the module docstring.
TARGETS = [
    (skorch, "NeuralNet"),
    (skorch, "NeuralNetClassifier"),
    (skorch, "NeuralNetBinaryClassifier"),
    (skorch, "NeuralNetRegressor"),
    (skorch.net, "NeuralNet"),
    (skorch.classifier, "NeuralNetBinaryClassifier"),
]

#: Import forms that would escape the swap.
_UNSWAPPED = re.compile(
    r"from\s+skorch\.classifier\s+import\s+[^\n]*\bNeuralNetClassifier\b"
    r"|from\s+skorch\.regressor\s+import\s+[^\n]*\bNeuralNetRegressor\b"
    r"|skorch\.classifier\.NeuralNetClassifier\b(?!')"
    r"|skorch\.regressor\.NeuralNetRegressor\b(?!')"
)

_state: dict[str, Any] = {"mode": None, "saved": [], "escaped": {}, "current": None, "warned": set()}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ampnet-skorch-suite")
    group.addoption(
        "--ampnet-mode",
        choices=MODES,
        default=None,
        help=f"skorch (no swap), off (ampnet, AMP off), on (ampnet, bf16 AMP on); default ${ENV_VAR} or 'off'",
    )


def _mode(config: pytest.Config) -> str:
    mode = config.getoption("--ampnet-mode") or os.environ.get(ENV_VAR) or "off"
    if mode not in MODES:
        raise pytest.UsageError(f"{ENV_VAR}={mode!r}; expected one of {', '.join(MODES)}")
    return mode


def _wrap_initialize() -> None:
    """Count initializations of nets of the original skorch classes while a
    swap is active (tests that escaped the swap)."""
    original_initialize = ORIGINAL["NeuralNet"].initialize

    @functools.wraps(original_initialize)
    def initialize(self, *args, **kwargs):
        if not isinstance(self, ampnet.AmpNetMixin) and type(self) in ORIGINAL.values():
            node = _state["current"] or "<outside a test>"
            _state["escaped"][node] = _state["escaped"].get(node, 0) + 1
        return original_initialize(self, *args, **kwargs)

    _state["saved"].append((ORIGINAL["NeuralNet"], "initialize", original_initialize))
    ORIGINAL["NeuralNet"].initialize = initialize


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)
    mode = _mode(config)
    _state["mode"] = mode
    if mode == "skorch":
        return
    for module, name in TARGETS:
        _state["saved"].append((module, name, getattr(module, name)))
        setattr(module, name, REPLACEMENTS[mode][name])
    _wrap_initialize()


def pytest_unconfigure(config: pytest.Config) -> None:
    for module, name, value in reversed(_state["saved"]):
        setattr(module, name, value)
    _state["saved"].clear()


def pytest_report_header(config: pytest.Config) -> list[str]:
    mode = _state["mode"]
    lines = [
        f"ampnet skorch-suite mode: {mode}  (skorch {skorch.__version__}, ampnet {ampnet.__version__}, "
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()})",
        f"ampnet from {os.path.dirname(ampnet.__file__)}; flaky: {FLAKY_SOURCE}",
    ]
    if mode != "skorch":
        swapped = ", ".join(
            f"{m.__name__}.{n} -> {REPLACEMENTS[mode][n].__module__}.{REPLACEMENTS[mode][n].__name__}"
            for m, n in TARGETS
        )
        lines.append(f"swapped: {swapped}")
    return lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    # Warn about import forms that the swap does not reach.
    if _state["mode"] in (None, "skorch") or file_path.suffix != ".py":
        return None
    if not file_path.name.startswith("test_") or file_path in _state["warned"]:
        return None
    _state["warned"].add(file_path)
    try:
        text = file_path.read_text(encoding="utf-8")
    except OSError:
        return None
    for match in _UNSWAPPED.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        warnings.warn(
            pytest.PytestConfigWarning(
                f"{file_path.name}:{line}: {match.group(0)!r} is not swapped by the ampnet plugin"
            )
        )
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any):
    _state["current"] = item.nodeid
    try:
        return (yield)
    finally:
        _state["current"] = None


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _state["mode"] in (None, "skorch"):
        return
    escaped = _state["escaped"]
    if escaped:
        terminalreporter.section("ampnet swap: tests that initialized an original skorch net")
        for node, count in sorted(escaped.items()):
            terminalreporter.write_line(f"{count:4d}  {node}")
    else:
        terminalreporter.write_line(
            f"ampnet swap ({_state['mode']}): no original skorch net was initialized in any test"
        )
