"""What ``amp_enabled='auto'`` reads and keeps, as the trust model page
(docs/user_guide/trust_model.md, "What 'auto' reads and keeps") states it,
for the claims that tests/test_auto_trust.py does not cover: a malformed
saved choice is ignored with a warning naming the file, the probe keeps
every global random stream, and drops ampnet's own warnings raised by its
copies."""

import random
import warnings

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpWarning
from ampnet.auto.probe import run_probe
from conftest import timed_probes
from test_auto_trust import BF16_MIXED, Timer, amp_messages, fit, kw, write_choice
from test_training_loop import Logits


@pytest.fixture(scope="module")
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


# ---- a malformed saved choice: warned about, naming the file, and ignored -----------------


MALFORMED = {
    "list": (["amp_enabled", True], "expected a dict with the keys"),
    "missing-key": ({k: v for k, v in BF16_MIXED.items() if k != "memory_format"}, "expected a dict with the keys"),
    "extra-key": ({**BF16_MIXED, "device": "cpu"}, "expected a dict with the keys"),
    "int-value": ({**BF16_MIXED, "amp_enabled": 1}, "amp_enabled holds a int, not a bool or a str"),
    "tensor-value": ({**BF16_MIXED, "amp_level": torch.tensor(1.0)}, "amp_level holds a Tensor"),
    "unknown-level": ({**BF16_MIXED, "amp_level": "half"}, "amp_level"),
    "auto": ({**BF16_MIXED, "amp_enabled": "AUTO"}, "amp_enabled is 'auto'"),
}


@pytest.mark.parametrize("choice, problem", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_choice_is_ignored_with_a_warning_naming_the_file(data, tmp_path, choice, problem):
    saver = fit(data, Timer(mixed=0.5), max_epochs=1)
    path = tmp_path / "params.pt"
    saver.save_params(f_params=path)
    write_choice(path, choice)
    net = AmpNetClassifier(**kw(max_epochs=1)).initialize()
    with pytest.warns(AmpWarning) as record:
        net.load_params(f_params=path)
    refusals = [m for m in amp_messages(record) if str(path) in m]
    assert refusals and "ignored" in refusals[0] and problem in refusals[0], amp_messages(record)
    assert "amp_autotune_" not in vars(net) and not net.precision_policy_.enabled  # as it was
    for a, b in zip(saver.module_.parameters(), net.module_.parameters()):
        assert torch.equal(a.float(), b)  # the rest of the file loaded
    with timed_probes(Timer(mixed=0.5)):
        net.partial_fit(*data)  # the net measures its own
    assert net.amp_autotune_.source == "probe" and net.amp_autotune_.params == BF16_MIXED


# ---- the probe keeps every global random stream ---------------------------------------------


class Noisy(Logits):
    """Draws from torch's (dropout), numpy's and Python's global streams in
    every training forward pass."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, X):
        if self.training:
            X = X + float(np.random.standard_normal()) * 1e-3 + random.random() * 1e-3
        return super().forward(self.drop(X))


def draws():
    return torch.rand(3), np.random.rand(3), random.random()


def test_the_probe_keeps_torchs_numpys_and_pythons_random_streams(data):
    torch.manual_seed(0)
    net = AmpNetClassifier(**kw(module=Noisy)).initialize()
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    expected = draws()
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    with timed_probes(Timer(mixed=0.5)):
        result = run_probe(net, *data)
    assert result.params == BF16_MIXED and len(result.table) > 1  # the candidates were trained
    after = draws()
    assert torch.equal(after[0], expected[0])
    np.testing.assert_array_equal(after[1], expected[1])
    assert after[2] == expected[2]


# ---- the probe drops ampnet's own warnings from its copies, in its thread -------------------


def test_ampnets_warnings_from_the_probes_copies_are_dropped(data):
    """amp_fp32_modules has no effect on the float32 candidate, whose copy
    warns so at its initialize; the user asked for 'auto', not for that copy."""
    with pytest.warns(AmpWarning, match="has no effect"):  # what the float32 copy says alone
        AmpNetClassifier(**kw(amp_enabled=False, amp_fp32_modules=["out"])).initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpWarning)
        net = fit(data, Timer(mixed=0.5), max_epochs=1, amp_fp32_modules=["out"])
    assert net.amp_autotune_.params == BF16_MIXED
    assert net.module_.out.weight.dtype == torch.float32
