"""Files written by ampnet 0.3 load bitwise and train on as 0.3 trained them
on (tests/data/v0.3, written by its make.py with the 0.3 code: a pickled
fp16 net, its save_params files, a Checkpoint folder, a net with torch's
own GradScaler, and a bare GradScaler pickled mid-step)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from ampnet import AmpNetClassifier, GradScaler
from repo_paths import DATA

HERE = os.path.join(DATA, "v0.3")


def _make_module() -> ModuleType:
    """tests/data/v0.3/make.py: the fixtures' nets, data and measurements."""
    spec = importlib.util.spec_from_file_location("ampnet_v0_3_fixtures", os.path.join(HERE, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make = _make_module()


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    with open(os.path.join(HERE, "expected.json")) as f:
        return json.load(f)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 autocast on CPU
        yield


def _load_pickle(name: str) -> Any:
    with open(os.path.join(HERE, name), "rb") as f:
        return pickle.load(f)


def _assert_saved_weights(net: Any) -> None:
    """The module's tensors are bitwise those of the 0.3 params file."""
    saved = torch.load(os.path.join(HERE, "params", "params.pt"), weights_only=True)
    state = net.module_.state_dict()
    assert saved.keys() == state.keys()
    for key, value in saved.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_a_0_3_pickled_net_loads_bitwise_and_trains_on_as_0_3_did(expected):
    net = _load_pickle("net.pkl")
    assert isinstance(net.grad_scaler_, GradScaler)
    assert make.net_facts(net) == expected["saved"]
    _assert_saved_weights(net)
    state = net.grad_scaler_.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["_overflow_streak"]) == (262144.0, 0, 1)
    assert net.grad_scaler_.get_settings()["hysteresis"] == 2
    assert make.train_on(net) == expected["trained_on"]


@pytest.mark.parametrize("source", ["params", "checkpoint"])
def test_0_3_files_load_bitwise_and_train_on_as_0_3_did(source, expected):
    net = AmpNetClassifier(make.make_module(), **make.NET_KWARGS, **make.AMPNET_SCALER_KWARGS).initialize()
    make.loaders(HERE)[source](net)
    assert make.net_facts(net) == expected[f"{source}_loaded"] == expected["saved"]
    _assert_saved_weights(net)
    assert make.train_on(net) == expected[f"{source}_trained_on"]


def test_a_0_3_pickled_net_with_torchs_scaler_trains_on_as_0_3_did(expected):
    net = _load_pickle("torch_scaler_net.pkl")
    assert type(net.grad_scaler_) is torch.amp.GradScaler
    assert make.net_facts(net) == expected["torch_scaler_saved"]
    assert make.train_on(net) == expected["torch_scaler_trained_on"]


def test_a_0_3_scaler_pickled_mid_step_loads_and_steps_as_0_3_did(expected):
    scaler = _load_pickle("scaler_mid_step.pkl")
    assert isinstance(scaler, GradScaler) and scaler.is_enabled()
    want = expected["scaler_mid_step"]
    assert make.scaler_facts(scaler) == {k: want[k] for k in ("scale", "growth_tracker", "overflow_streak")}
    assert scaler.get_settings() == want["settings"]
    assert scaler.get_growth_factor() == 2.0 and scaler.get_growth_interval() == 3
    param = torch.nn.Parameter(torch.ones(3))  # as the fixture left it: one good SGD step from ones
    param.grad = torch.full((3,), 2.0)
    torch.optim.SGD([param], lr=0.1).step()
    steps = make.scaler_steps(scaler, param, None, make.SCALER_PATTERN)
    assert steps == expected["scaler_mid_step_trained_on"]
