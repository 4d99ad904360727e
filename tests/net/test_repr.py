"""repr(net): skorch's, plus the AMP parameters that differ from their defaults."""

import re

import torch
from skorch import NeuralNetClassifier

import ampnet
from ampnet import AmpNetClassifier


class Tiny(torch.nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.lin = torch.nn.Linear(4, hidden)

    def forward(self, X):
        return self.lin(X)


def skorch_repr(net, cls):
    return repr(net).replace(f"<class 'skorch.classifier.{cls}'>", "<class 'ampnet.net.AmpNetClassifier'>")


def test_default_amp_settings_give_skorchs_repr():
    ours = AmpNetClassifier(Tiny, module__hidden=3)
    theirs = NeuralNetClassifier(Tiny, module__hidden=3)
    assert repr(ours) == skorch_repr(theirs, "NeuralNetClassifier")
    assert repr(ours.initialize()) == skorch_repr(theirs.initialize(), "NeuralNetClassifier")


def test_non_default_amp_settings_are_shown():
    net = AmpNetClassifier(
        Tiny, amp_enabled=True, amp_dtype="bfloat16", amp_fp32_modules=["lin"],
        gradient_accumulation_steps=2, grad_scaler__growth_interval=10,
    )
    assert repr(net) == (
        "<class 'ampnet.net.AmpNetClassifier'>[uninitialized](\n"
        f"  module={Tiny},\n"
        "  amp_enabled=True,\n"
        "  amp_dtype='bfloat16',\n"
        "  amp_fp32_modules=['lin'],\n"
        "  gradient_accumulation_steps=2,\n"
        "  grad_scaler__growth_interval=10,\n"
        ")"
    )
    fitted = net.initialize()
    text = repr(fitted)
    assert text.startswith("<class 'ampnet.net.AmpNetClassifier'>[initialized](\n  module_=Tiny(\n")
    assert text.endswith(
        "  amp_enabled=True,\n  amp_dtype='bfloat16',\n  amp_fp32_modules=['lin'],\n"
        "  gradient_accumulation_steps=2,\n  grad_scaler__growth_interval=10,\n)"
    )


def test_scaler_instance_and_torch_dtype_are_readable():
    net = AmpNetClassifier(Tiny, amp_enabled=True, amp_dtype=torch.float16,
                           grad_scaler=ampnet.GradScaler(init_scale=256.0, hysteresis=2))
    lines = repr(net).splitlines()
    assert "  amp_dtype=torch.float16," in lines
    assert re.match(r"  grad_scaler=GradScaler\(device='(cpu|cuda)', init_scale=256.0, hysteresis=2\),$",
                    lines[-2])
