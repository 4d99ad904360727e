"""net.precision_report: dtypes per module, overflow and underflow analysis,
rendering, and leaving the net unchanged."""

import numpy as np
import pytest
import torch

from ampnet import AmpNetClassifier, AmpNetRegressor, AmpWarning
from ampnet.diagnostics.report import PrecisionReport
from checkpoint_helpers import data, fitted  # noqa: F401  (fixtures)
from precision_helpers import DigitsCNN, ThreePart, digits_split

pytestmark = pytest.mark.filterwarnings(
    "ignore:this CPU has no native bfloat16:ampnet.exceptions.AmpWarning"
)

FP16_MAX = 65504.0


class Overflowing(torch.nn.Module):
    """``big`` is built to produce activations around 1e5: fine in bfloat16
    and float32, inf in float16. The LayerNorm after it brings them back."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(20, 16)
        self.big = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 2)
        with torch.no_grad():
            self.big.weight.copy_(2e4 * (1 + 0.1 * torch.randn(16, 16)))
            self.big.bias.zero_()
            self.inp.bias.fill_(1.0)

    def forward(self, X):
        h = self.big(torch.relu(self.inp(X)) + 0.5)
        return torch.softmax(self.head(self.norm(h)), dim=-1)


def make_net(module=Overflowing, **kwargs):
    torch.manual_seed(0)
    defaults = dict(
        module=module, amp_enabled=True, amp_dtype="bfloat16", batch_size=16,
        train_split=None, verbose=0,
    )
    defaults.update(kwargs)
    return AmpNetClassifier(**defaults).initialize()


def rows_by_name(report):
    return {row["module"]: row for row in report.to_dicts()}


def test_report_flags_layer_that_overflows_in_fp16_target(classifier_data):
    X, y = classifier_data
    net = make_net()  # computes in bfloat16; analysed for float16
    report = net.precision_report(X, y, dtype="float16")
    rows = rows_by_name(report)
    assert report.target_dtype == "float16" and report.dtype_max == FP16_MAX
    assert rows["big"]["max_abs_activation"] > FP16_MAX
    assert "activation-overflow" in rows["big"]["flags"]
    assert rows["norm"]["max_abs_activation"] < 10  # the norm's input was the problem
    assert report.recommended_fp32_modules == ["big"]
    assert [r["module"] for r in report.to_dicts() if r["recommended"]] == ["big"]
    # as bfloat16 (its own dtype) nothing is at risk
    assert net.precision_report(X, y).recommended_fp32_modules == []


def test_report_on_fp16_net_sees_inf_and_fix_removes_it(classifier_data):
    X, y = classifier_data
    net = make_net(amp_dtype="float16")
    report = net.precision_report(X[:16], y[:16])
    rows = rows_by_name(report)
    assert rows["big"]["output_dtypes"] == ["fp16"]
    assert rows["big"]["max_abs_activation"] == float("inf")
    assert report.recommended_fp32_modules == ["big"]

    fixed = make_net(amp_dtype="float16", amp_fp32_modules=report.recommended_fp32_modules)
    rows = rows_by_name(fixed.precision_report(X[:16], y[:16]))
    assert rows["big"]["output_dtypes"] == ["fp32"]
    assert np.isfinite(rows["head"]["max_abs_activation"])
    assert np.isfinite(rows[""]["max_abs_grad"])
    with pytest.warns(AmpWarning, match="float16 autocast on CPU"):
        fixed.partial_fit(X[:32], y[:32])
    assert np.isfinite(fixed.history[-1, "train_loss"])  # float16 forward no longer overflows


def test_report_dtypes_per_module_in_pure(classifier_data):
    X, y = classifier_data
    net = make_net(ThreePart, amp_level="pure", amp_fp32_modules=["head"])
    rows = rows_by_name(net.precision_report(X, y))
    assert rows["embed"]["param_dtypes"] == ["bf16"]
    assert rows["embed"]["input_dtypes"] == ["fp32"]
    assert rows["embed"]["output_dtypes"] == ["bf16"]
    assert rows["embed"]["grad_dtypes"] == ["bf16"]
    assert rows["embed"]["param_grad_dtypes"] == ["bf16"]
    assert rows["head"]["input_dtypes"] == ["fp32"]  # cast up by the fp32 region
    assert rows["head.lin"]["param_dtypes"] == ["fp32"]
    assert rows["head.lin"]["output_dtypes"] == ["fp32"]
    assert rows["head.lin"]["grad_dtypes"] == ["fp32"]
    assert rows["head.lin"]["param_grad_dtypes"] == ["fp32"]
    assert rows["block"]["param_dtypes"] == []  # a container has no own params
    assert all(r["max_abs_grad"] > 0 for r in rows.values())


def test_report_measures_underflow_against_the_target(regression_data):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(20, 1)

        def forward(self, X):
            return self.lin(X) * 1e-6

    X, y = regression_data
    torch.manual_seed(0)
    net = AmpNetRegressor(Tiny, train_split=None, verbose=0, batch_size=32).initialize()
    fp16 = rows_by_name(net.precision_report(X, 0 * y, dtype="float16"))
    bf16 = rows_by_name(net.precision_report(X, 0 * y, dtype="bfloat16"))
    assert fp16["lin"]["underflow_share"] > 0.5
    assert "underflow" in fp16["lin"]["flags"]
    assert bf16["lin"]["underflow_share"] == 0.0
    assert "underflow" not in bf16["lin"]["flags"]


def test_report_renders_a_table_and_dicts(classifier_data):
    X, y = classifier_data
    net = make_net()
    report = net.precision_report(X, y, dtype="float16")
    assert isinstance(report, PrecisionReport)
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("Precision report: net computes in bfloat16 (mixed); target float16")
    assert lines[1].split() == [
        "module", "type", "params", "inputs", "outputs", "grads", "param", "grads",
        "max|act|", "max|grad|", "underflow", "flags",
    ]
    assert any(line.split()[:2] == ["big", "Linear"] and "activation-overflow" in line for line in lines)
    assert lines[-1] == "Recommended amp_fp32_modules: ['big']"
    dicts = report.to_dicts()
    assert [d["module"] for d in dicts] == [n for n, _ in net.module_.named_modules()]
    assert set(dicts[0]) == {
        "module", "type", "param_dtypes", "input_dtypes", "output_dtypes", "grad_dtypes",
        "param_grad_dtypes", "max_abs_input", "max_abs_activation", "max_abs_grad", "dtype_max",
        "underflow_share", "flags", "recommended", "calls",
    }
    assert "recommended amp_fp32_modules=['big']" in repr(report)


def test_report_leaves_the_net_unchanged():
    Xtr, _, ytr, _ = digits_split()
    net = AmpNetClassifier(
        DigitsCNN, criterion=torch.nn.CrossEntropyLoss, amp_enabled=True,
        amp_dtype="bfloat16", amp_level="pure", max_epochs=1, batch_size=64,
        train_split=None, verbose=0,
    ).fit(Xtr[:256], ytr[:256])
    net.module_.eval()
    state = {k: v.clone() for k, v in net.module_.state_dict(keep_vars=False).items()}
    masters = {k: v.detach().clone() for k, v in net.amp_master_params_.items()}
    grads = [p.grad for p in net.module_.parameters()]
    rng = torch.get_rng_state()

    report = net.precision_report(Xtr, ytr)
    assert report.rows[0].calls == 1

    after = net.module_.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())  # incl. BN statistics
    assert all(torch.equal(net.amp_master_params_[k], v) for k, v in masters.items())
    assert [p.grad for p in net.module_.parameters()] == grads
    assert not net.module_.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_report_without_y_and_with_compile(classifier_data):
    X, _ = classifier_data
    net = make_net(ThreePart, compile=True, compile__backend="eager")
    report = net.precision_report(X)
    assert len(report.rows) == len(list(net.module_._orig_mod.named_modules()))
    rows = rows_by_name(report)
    assert rows["embed"]["grad_dtypes"] == ["bf16"]  # the activation gradient
    assert rows["embed"]["param_grad_dtypes"] == ["fp32"]  # 'mixed': fp32 weights
    assert isinstance(net.module_, torch._dynamo.eval_frame.OptimizedModule)
    torch._dynamo.reset()


def test_precision_report_of_an_empty_x(fitted, data):
    X, y = data
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="precision_report needs at least one sample, but X holds none"):
        fitted.precision_report(X[:0], y[:0])
    assert torch.equal(torch.get_rng_state(), rng)
