"""Values as the user or a file gives them: AMP parameters are read through
the parameter table wherever ampnet compares them (so a case variant such as
``' Compensated'`` means what ``'compensated'`` means), and the field checks
of :func:`ampnet.utils.file_values.type_mismatch` return a problem, never raise,
for huge ints and tensors without values."""

import pytest
import torch

from ampnet import AmpNetClassifier
from ampnet.io.untrusted import values
from ampnet.utils.values import as_float, describe, finite_number
from ampnet.utils.file_values import type_mismatch
from conftest import MLP
from precision_helpers import COMP, compensation, true_weights


# ---- AMP parameters read through the table ------------------------------------------------


@pytest.mark.parametrize("spelling", [" Compensated", "COMPENSATED"])
def test_convert_for_inference_reads_a_case_variant_of_compensated(classifier_data, spelling):
    """Converted to another dtype, a compensated net gets float32 masters made
    from its weights plus their compensation, whatever the spelling."""
    torch.manual_seed(0)
    net = AmpNetClassifier(MLP, optimizer=torch.optim.Adam, lr=0.01, batch_size=16, train_split=None, verbose=0,
                           max_epochs=2, **{**COMP, "amp_master_weights": spelling}).fit(*classifier_data)
    assert net.precision_.settings.compensated and len(compensation(net)) == 4
    wide = true_weights(net)
    fp16 = net.convert_for_inference("float16")
    assert fp16.amp_master_weights is True and fp16.module_.hidden.weight.dtype == torch.float16
    for name, master in fp16.amp_master_params_.items():
        assert torch.equal(master.double(), wide[name]), name
    assert compensation(fp16) == {}
    same = net.convert_for_inference()  # its own dtype: stays compensated, as given
    assert same.amp_master_weights == spelling and same.precision_.settings.compensated


# ---- type_mismatch never raises for hostile numbers ---------------------------------------


HUGE = 10**400


@pytest.mark.parametrize("reference", [0.5, 3, torch.tensor(0.5)], ids=["float", "int", "tensor"])
@pytest.mark.parametrize("value, problem", [
    (HUGE, "must be a finite number"),
    (-HUGE, "must be a finite number"),
    (float("nan"), "must be a finite number"),
    (torch.tensor(float("inf")), "must be a finite number"),
    (torch.empty((), device="meta"), "meta"),
    (torch.empty(3, device="meta"), "meta"),
    (torch.tensor([1.0]).to_sparse(), "sparse"),
], ids=["huge", "-huge", "nan", "inf-tensor", "meta", "meta-3", "sparse"])
def test_finite_numbers_refuse_huge_ints_and_tensors_without_values(reference, value, problem):
    found = type_mismatch(reference, value, "group['lr']", finite=True)
    assert found is not None and found.startswith("group['lr'] must be")
    assert problem in found


@pytest.mark.parametrize("value", [HUGE, torch.empty((), device="meta")], ids=["huge", "meta"])
def test_nested_hostile_numbers_are_problems_not_errors(value):
    reference = {"params": [0, 1], "betas": (0.9, 0.999), "lr": 0.1}
    found = type_mismatch(reference, {"params": [0, 1], "betas": (0.9, value), "lr": 0.1}, "group",
                          finite=True)
    assert found is not None and found.startswith("group['betas'][1] must be")


def test_without_finite_a_huge_int_is_a_number_and_a_meta_tensor_is_not():
    assert type_mismatch(0.5, HUGE, "x") is None
    assert "meta" in type_mismatch(0.5, torch.empty((), device="meta"), "x")


def test_plain_values_still_pass():
    assert type_mismatch(0.5, 2, "x", finite=True) is None
    assert type_mismatch(0.5, torch.tensor(2.0), "x", finite=True) is None
    assert type_mismatch(torch.tensor(1.0), 10**300, "x", finite=True) is None
    assert "must be a number" in type_mismatch(0.5, "1", "x", finite=True)


def test_describe_shows_an_int_beyond_strs_digit_limit():
    text = describe(10**5000)  # repr() raises ValueError past 4300 digits
    assert "16610 bits" in text and "(int)" in text


def test_io_values_uses_the_one_overflow_safe_check():
    assert values.as_float is as_float  # the checks of what a file holds use validation's
    assert not finite_number(HUGE) and as_float(HUGE) is None and finite_number(2**1000)
