"""Precision kinds (ampnet.precision.kinds): one subclass of ``Precision``
per kind, chosen from the settings; no hook branches on the settings; the
pickles of ampnet 0.4 (one class for every precision) load as their kind
(tests/data/v0.4, written by its make.py with the 0.4 code)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import pickle
import textwrap
import warnings
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier
from ampnet.precision.component import Precision
from ampnet.precision.kinds import (
    KINDS, CompensatedPrecision, Float32Precision, MixedPrecision, PurePrecision, precision_class,
)
from repo_paths import DATA

HERE = os.path.join(DATA, "v0.4")

#: The hooks of a training step and of inference (ampnet.training.step, ampnet.net).
HOOKS = ("forward_context", "convert_input", "convert_output", "backward", "gather_grads", "zero_grad",
         "check", "decide", "skip_on", "step_context", "after_step", "update", "discard_step")

#: Names through which a hook would read the settings.
SETTINGS_NAMES = {"settings", "policy", "enabled", "compensated", "master_weights", "level", "skip_nonfinite"}


def _make_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ampnet_v0_4_fixtures", os.path.join(HERE, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _make_module()

KIND_OF = {"float32": Float32Precision, "mixed": MixedPrecision, "pure": PurePrecision,
           "compensated": CompensatedPrecision}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _net(name: str) -> AmpNetClassifier:
    return AmpNetClassifier(make.make_module(), **make.NET_KWARGS, **make.NETS[name])


@pytest.mark.parametrize("name", list(make.NETS))
def test_the_settings_choose_the_kind(name):
    net = _net(name).initialize()
    assert type(net.precision_) is KIND_OF[name]
    assert precision_class(net.precision_.settings) is KIND_OF[name]
    assert isinstance(net.precision_, Precision)
    assert net.precision_.enabled is (name != "float32")


def test_set_params_changes_the_kind_and_keeps_the_weights():
    X, y = make.make_data()
    net = _net("mixed").fit(X, y)
    before = net.predict_proba(X)
    net.set_params(amp_level="pure")
    assert type(net.precision_) is PurePrecision
    assert net.module_[0].weight.dtype == torch.bfloat16
    net.set_params(amp_enabled=False)
    assert type(net.precision_) is Float32Precision
    assert net.module_[0].weight.dtype == torch.float32
    np.testing.assert_allclose(net.predict_proba(X), before, atol=2e-2)


@pytest.mark.parametrize("kind", [Precision, *KINDS], ids=lambda k: k.__name__)
def test_no_hook_branches_on_the_settings(kind):
    """Each hook a class defines reads nothing of the settings: what a kind
    does is its class, what it needs was read when the settings were set."""
    for hook in HOOKS:
        fn = kind.__dict__.get(hook)
        if fn is None:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not read & SETTINGS_NAMES, (kind.__name__, hook, read & SETTINGS_NAMES)


def test_every_hook_of_a_kind_is_defined():
    for kind in KINDS:
        for hook in HOOKS:
            assert getattr(kind, hook) is not getattr(Precision, hook) or hook not in (
                "forward_context", "convert_input", "convert_output"), (kind.__name__, hook)


def test_a_pickled_component_keeps_0_4s_names_and_no_derived_state():
    net = _net("pure").initialize()
    state = net.precision_.__getstate__()
    assert {"settings", "scaler", "layout", "masters", "auto_fp32", "_found"} == set(state)
    copy = pickle.loads(pickle.dumps(net.precision_))
    assert type(copy) is PurePrecision and copy.layout == net.precision_.layout


def test_a_kind_of_ones_own_is_one_subclass_and_must_own_its_settings():
    net = _net("mixed").initialize()
    settings = net.precision_.settings

    class Spy(MixedPrecision):  # no serves of its own: never chosen
        pass

    assert precision_class(settings) is MixedPrecision

    class Mine(MixedPrecision):
        @staticmethod
        def serves(settings):
            return settings.policy.compute_dtype == torch.bfloat16

    assert type(Precision(settings, net.precision_.scaler)) is Mine

    class Rival(MixedPrecision):
        @staticmethod
        def serves(settings):
            return True

    with pytest.raises(TypeError, match="Mine, .*Rival all serve .*Fix: make their serves"):
        precision_class(settings)
    del Mine, Rival, Spy
    import gc

    gc.collect()  # the kinds above go with their classes
    assert precision_class(settings) is MixedPrecision


def test_new_settings_choose_the_kind_again():
    net = _net("mixed").initialize()
    prec = net.precision_
    prec.settings = _net("float32").initialize().precision_.settings
    assert type(prec) is Float32Precision
    assert prec.forward_context().__class__.__name__ == "nullcontext"


@pytest.mark.parametrize("name", list(make.NETS))
def test_a_0_4_pickle_loads_as_its_kind_and_predicts_as_it_did(name):
    with open(os.path.join(HERE, "expected.json")) as f:
        expected = json.load(f)[name]
    with open(os.path.join(HERE, f"{name}.pkl"), "rb") as f:
        net = pickle.load(f)
    assert type(net.precision_) is KIND_OF[name]
    X, y = make.make_data()
    # the 0.4 net's own predictions, stored on the machine that made the fixture: float32 kernels differ by
    # an ulp between CPUs (an AMD EPYC and an Intel Xeon with the same torch), so within 1e-6, not bitwise
    np.testing.assert_allclose(net.predict_proba(X), np.asarray(expected, dtype=np.float32), rtol=0, atol=1e-6)
    net.partial_fit(X, y)  # and trains on
    assert np.isfinite(net.history[-1, "train_loss"])
