"""amp_enabled='auto''s history keeps its columns: a float32 choice made
mid-fit (or read from the cache) records ``loss_scale`` and ``step_skipped``
for every batch, and ``loss_scale``/``skipped_steps`` for every epoch, as
the measuring steps did (a float32 step: a scale of 1.0, not skipped)."""

import pytest
import torch

from ampnet import AmpNetClassifier

from conftest import Logits


class Timer:
    """``amp_autotune__timer``: mixed precision ``mixed`` times float32's step."""

    def __init__(self, mixed):
        self.mixed = mixed

    def __call__(self, params, seconds):
        return self.mixed if params["amp_enabled"] else 1.0


def fit(data, mixed, **extra):
    torch.manual_seed(0)
    kw = dict(module=Logits, criterion=torch.nn.CrossEntropyLoss, max_epochs=3, batch_size=16, train_split=None,
              verbose=0, amp_enabled="auto", amp_autotune__min_steps=0, amp_autotune__timer=Timer(mixed))
    kw.update(extra)
    return AmpNetClassifier(**kw).fit(*data)


@pytest.fixture
def data(classifier_data):
    return classifier_data[0][:64], classifier_data[1][:64]


@pytest.mark.parametrize("mixed", [2.0, 0.5], ids=["float32", "mixed"])
def test_every_batch_has_the_same_columns_whatever_auto_chose(data, native_bf16, auto_cache_dir, mixed):
    net = fit(data, mixed)
    assert net.amp_autotune_.source == "measured" and net.amp_autotune_.steps_run  # it switched mid-fit
    assert net.precision_policy_.enabled == (mixed < 1)
    scales = net.history[:, "batches", :, "loss_scale"]
    assert [len(epoch) for epoch in scales] == [4, 4, 4]  # every epoch, every batch
    assert all(s == 1.0 and type(s) is float for epoch in scales for s in epoch)
    assert net.history[:, "batches", :, "step_skipped"] == [[False] * 4] * 3
    assert net.history[:, "loss_scale"] == [1.0] * 3 and net.history[:, "skipped_steps"] == [0] * 3
    keys = {tuple(batch) for row in net.history for batch in row["batches"]}
    assert len(keys) == 1  # the same keys, in the same order, in every batch


def test_a_stored_float32_choice_records_the_same_columns(data, native_bf16, auto_cache_dir):
    fit(data, 2.0)
    net = fit(data, 2.0, max_epochs=1)  # starts with the stored float32 choice
    assert net.amp_autotune_.source == "cache" and not net.precision_policy_.enabled
    assert net.history[:, "batches", :, "loss_scale"] == [[1.0] * 4]
    assert net.history[:, "batches", :, "step_skipped"] == [[False] * 4]


def test_a_net_pinned_to_float32_records_no_amp_columns(data):
    net = fit(data, 2.0, amp_enabled=False, max_epochs=1)
    assert "loss_scale" not in net.history[-1, "batches", -1] and "loss_scale" not in net.history[-1]
