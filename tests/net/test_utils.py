"""Helpers: the non-finite gradient check and closure detection."""

import pytest
import torch

from ampnet.utils.tree import has_nonfinite
from ampnet.precision.checks import nonfinite_grads
from ampnet.training.closure import may_use_closure, needs_closure


def param_with_grad(values, dtype=torch.float32):
    p = torch.nn.Parameter(torch.zeros(len(values), dtype=dtype))
    p.grad = torch.tensor(values, dtype=dtype)
    return p


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_grads_finds_any_nonfinite_value(bad, dtype):
    good = param_with_grad([1.0, -2.0], dtype)
    assert nonfinite_grads([good, torch.nn.Parameter(torch.ones(2))]) == 0  # no grad: ignored
    assert nonfinite_grads([good, param_with_grad([0.5, bad, 3.0], dtype)]) > 0


def test_opposite_infinities_do_not_cancel():
    assert nonfinite_grads([param_with_grad([float("inf"), -float("inf")])]) > 0


def test_grads_are_left_unchanged():
    p = param_with_grad([1.5, float("nan")])
    before = p.grad.clone()
    nonfinite_grads([p])
    assert torch.equal(p.grad[:1], before[:1]) and torch.isnan(p.grad[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("sizes", [[300_000], [1000] * 8, [2_000] * 600],
                         ids=["one-large-tensor", "small-tensors", "many-small-tensors"])
def test_both_checks_find_any_nonfinite_value(bad, sizes):
    """Per-tensor sums (large tensors) and torch's fused check (small ones,
    also above a million values in all on a CPU) agree, position by position."""
    from ampnet.precision.checks import _fused_check_pays

    params = [param_with_grad(torch.linspace(-1, 1, n).tolist()) for n in sizes]
    fused = _fused_check_pays(torch.device("cpu"), [p.grad for p in params])
    assert fused == (sizes[0] < 100_000)
    assert nonfinite_grads(params) == 0
    for where in (0, len(params) - 1):
        before = params[where].grad.clone()
        params[where].grad[-1] = bad
        assert nonfinite_grads(params) > 0
        params[where].grad.copy_(before)
    assert nonfinite_grads(params) == 0


def test_has_nonfinite_walks_batches():
    assert has_nonfinite((torch.ones(2), {"a": torch.tensor([0.0, float("nan")])}))
    assert not has_nonfinite((torch.ones(2), torch.tensor([1, 2])))


def test_closure_detection():
    p = [torch.nn.Parameter(torch.ones(1))]
    assert needs_closure(torch.optim.LBFGS(p)) and not needs_closure(torch.optim.SGD(p, lr=0.1))
    assert not may_use_closure(torch.optim.SGD(p, lr=0.1))

    class Custom(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    assert may_use_closure(Custom(p, lr=0.1)) and not needs_closure(Custom(p, lr=0.1))
