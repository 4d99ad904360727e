"""An optimizer state that a stock optimizer can never hold is refused at
load, naming the file and the field: negative second moments (Adam's
``exp_avg_sq`` of -1 passed every check and turned the weights to NaN after
one epoch, without a warning) and a ``step`` that is not a whole number
>= 0."""

import pytest
import torch

from checkpoint_helpers import data, paths, quietly, snapshot, tiny_net  # noqa: F401  (fixtures)
from resume_script import differences

CASES = {
    # optimizer, its settings, the state key, the value
    "adam-exp_avg_sq": (torch.optim.Adam, {}, "exp_avg_sq", -1.0),
    "adamw-amsgrad-max_exp_avg_sq": (torch.optim.AdamW, {"amsgrad": True}, "max_exp_avg_sq", -0.5),
    "adagrad-sum": (torch.optim.Adagrad, {}, "sum", -1.0),
    "rmsprop-square_avg": (torch.optim.RMSprop, {}, "square_avg", -1e-3),
    "adadelta-acc_delta": (torch.optim.Adadelta, {}, "acc_delta", -1.0),
    "adamax-exp_inf": (torch.optim.Adamax, {}, "exp_inf", -1.0),
    "adam-negative-step": (torch.optim.Adam, {}, "step", -1.0),
    "adam-fractional-step": (torch.optim.Adam, {}, "step", 1.5),
}


def _fitted_files(tmp_path, data, optimizer, settings):
    torch.manual_seed(0)
    net = tiny_net(max_epochs=1, optimizer=optimizer,
                   **{f"optimizer__{k}": v for k, v in settings.items()})
    quietly(net.fit, *data)
    files = paths(tmp_path, ["f_optimizer"])
    net.save_params(**files)
    return net, files["f_optimizer"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_a_stock_optimizer_never_holds_is_refused(tmp_path, data, case):
    optimizer, settings, key, value = CASES[case]
    net, path = _fitted_files(tmp_path, data, optimizer, settings)
    state = torch.load(path, weights_only=True)
    saved = state["state"][0][key]
    state["state"][0][key] = torch.full_like(saved, value) if isinstance(saved, torch.Tensor) else value
    torch.save(state, path)
    before = snapshot(net)
    with pytest.raises(ValueError) as info:
        net.load_params(f_optimizer=path)
    message = str(info.value)
    assert f"f_optimizer file {path!r}" in message and f"state[0][{key!r}]" in message, message
    what = "whole number >= 0" if key == "step" else "holds negative values"
    assert what in message, message
    assert differences(snapshot(net), before) == []


def test_negative_second_moments_are_refused_instead_of_training_to_nan(tmp_path, data):
    net, path = _fitted_files(tmp_path, data, torch.optim.Adam, {})
    state = torch.load(path, weights_only=True)
    for entry in state["state"].values():
        entry["exp_avg_sq"] = torch.full_like(entry["exp_avg_sq"], -1.0)
    torch.save(state, path)
    with pytest.raises(ValueError, match="exp_avg_sq'\\] holds negative values"):
        net.load_params(f_optimizer=path)
    quietly(net.partial_fit, *data)
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())
