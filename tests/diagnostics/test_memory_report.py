"""net.memory_report(): exact bytes of parameters, gradients, master
weights, compensation buffers and optimizer state."""

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier
from ampnet.precision.memory import MemoryReport

from conftest import MLP

N = 20 * 16 + 16 + 16 * 2 + 2  # parameters of MLP(20, 16, 2): 370
TENSORS = 4
STEP = 4  # Adam's step counter: one float32 scalar per parameter tensor

BF16 = dict(amp_enabled=True, amp_dtype="bfloat16")
CASES = {
    # name: (settings, parameters, gradients, master_weights, compensation, optimizer_state)
    "float32": ({}, 4 * N, 4 * N, 0, 0, 8 * N + TENSORS * STEP),
    "mixed": (BF16, 4 * N, 4 * N, 0, 0, 8 * N + TENSORS * STEP),
    "pure": ({**BF16, "amp_level": "pure"}, 2 * N, 4 * N, 4 * N, 0, 8 * N + TENSORS * STEP),
    "pure-no-masters": ({**BF16, "amp_level": "pure", "amp_master_weights": False},
                        2 * N, 2 * N, 0, 0, 4 * N + TENSORS * STEP),
    "compensated": ({**BF16, "amp_level": "pure", "amp_master_weights": "compensated"},
                    2 * N, 2 * N, 0, 2 * N, 4 * N + TENSORS * STEP),
}


def fitted(settings, X, y):
    return AmpNetClassifier(MLP, optimizer=torch.optim.Adam, max_epochs=1, batch_size=32, train_split=None,
                            verbose=0, **settings).fit(X, y)


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_bytes_after_fit(case, classifier_data):
    settings, params, grads, masters, comp, state = CASES[case]
    report = fitted(settings, *classifier_data).memory_report()
    assert isinstance(report, MemoryReport)
    assert (report.parameters, report.gradients, report.master_weights, report.compensation,
            report.optimizer_state) == (params, grads, masters, comp, state)
    assert report.total == params + grads + masters + comp + state
    assert report.to_dict()["total"] == report.total
    text = str(report)
    assert f"{report.total:,d} B" in text and "compensation buffers" in text


def test_precision_is_named(classifier_data):
    names = {case: fitted(CASES[case][0], *classifier_data).memory_report().precision for case in CASES}
    assert names == {
        "float32": "float32", "mixed": "bfloat16 (mixed)", "pure": "bfloat16 (pure, float32 masters)",
        "pure-no-masters": "bfloat16 (pure, no masters)", "compensated": "bfloat16 (pure, compensated)",
    }


def test_compensated_holds_at_most_065_of_mixed(classifier_data):
    mixed = fitted(CASES["mixed"][0], *classifier_data).memory_report().total
    comp = fitted(CASES["compensated"][0], *classifier_data).memory_report().total
    assert comp / mixed <= 0.65  # (2 + 2 + 2 + 4) / (4 + 4 + 8) bytes per parameter, plus step counters


def test_before_fit_only_parameters_are_counted():
    report = AmpNetClassifier(MLP, optimizer=torch.optim.Adam, **CASES["pure"][0]).initialize().memory_report()
    assert (report.parameters, report.gradients, report.master_weights, report.compensation,
            report.optimizer_state) == (2 * N, 0, 4 * N, 0, 0)


def test_uninitialized_net_refuses():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        AmpNetClassifier(MLP).memory_report()
