"""The array data path (ampnet.training.batches): the batches of skorch's
DataLoader, gathered with one index, from the same random streams."""

import copy
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from skorch.dataset import Dataset, ValidSplit
from torch.utils.data import DataLoader, Subset

from ampnet import AmpNetClassifier
from ampnet.training.batches import ArrayBatches

from conftest import MLP


def _net(**kwargs):
    params = dict(module=MLP, max_epochs=1, lr=0.05, batch_size=16, train_split=None, verbose=0)
    params.update(kwargs)
    return AmpNetClassifier(**params)


def _iterators(dataset, training=True, **kwargs):
    """The array path's iterator and skorch's DataLoader for the same net settings."""
    ours = _net(**kwargs).get_iterator(dataset, training=training)
    theirs = _net(batch_gather=False, **kwargs).get_iterator(dataset, training=training)
    assert isinstance(ours, ArrayBatches), type(ours)
    assert type(theirs) is DataLoader
    return ours, theirs


def _epoch(iterator, seed, generator=None, generator_seed=None):
    """The batches of one pass, and the RNG states after it (global, and the generator's)."""
    torch.manual_seed(seed)
    if generator is not None:
        generator.manual_seed(generator_seed)
    batches = list(iterator)
    return batches, torch.get_rng_state(), None if generator is None else generator.get_state()


def _assert_same_batch(a, b):
    assert type(a) is list and type(b) is list and len(a) == len(b) == 2
    for x, y in zip(a, b):
        if isinstance(y, dict):
            assert isinstance(x, dict) and list(x) == list(y)
            for k in y:
                _assert_same_tensor(x[k], y[k])
        else:
            _assert_same_tensor(x, y)


def _assert_same_tensor(x, y):
    assert type(x) is torch.Tensor and type(y) is torch.Tensor
    assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
    assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                 and torch.equal(x.nan_to_num(), y.nan_to_num()))
    assert x.is_contiguous()


def _data(kind, n=50):
    rng = np.random.RandomState(0)
    X = rng.randn(n, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    if kind == "float64":
        X = X.astype(np.float64)
    elif kind == "tensor":
        X, y = torch.from_numpy(X), torch.from_numpy(y)
    elif kind == "dict":
        X = {"a": X[:, :12], "b": X[:, 12:].astype(np.float64)}
    elif kind == "no_y":
        y = None
    elif kind == "float_y":
        y = rng.randn(n, 3).astype(np.float32)
    elif kind == "fortran":
        X = np.asfortranarray(X)
    elif kind == "reversed":
        X = X[::-1]
    return X, y


@pytest.mark.parametrize("kind", ["float32", "float64", "tensor", "dict", "no_y", "float_y", "fortran", "reversed"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("subset", [False, True])
def test_same_batches_and_random_streams_as_the_dataloader(kind, shuffle, subset):
    X, y = _data(kind)
    dataset = Dataset(X, y)
    if subset:  # skorch's ValidSplit gives Subsets of the Dataset
        dataset = Subset(dataset, np.random.RandomState(1).permutation(50)[:37])
    ours, theirs = _iterators(dataset, iterator_train__shuffle=shuffle)
    assert len(ours) == len(theirs)
    for epoch in range(2):
        a, rng_a, _ = _epoch(ours, seed=epoch)
        b, rng_b, _ = _epoch(theirs, seed=epoch)
        assert len(a) == len(b) == len(theirs)
        for x, z in zip(a, b):
            _assert_same_batch(x, z)
        assert torch.equal(rng_a, rng_b)  # the global RNG advanced exactly as the DataLoader's draws


@pytest.mark.parametrize("n", [48, 50])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_generator_advances_as_with_the_dataloader(n, drop_last, shuffle):
    X, y = _data("float32", n)
    g_ours, g_theirs = torch.Generator(), torch.Generator()
    ours = _net(iterator_train__shuffle=shuffle, iterator_train__generator=g_ours,
                iterator_train__drop_last=drop_last).get_iterator(Dataset(X, y), training=True)
    theirs = _net(batch_gather=False, iterator_train__shuffle=shuffle, iterator_train__generator=g_theirs,
                  iterator_train__drop_last=drop_last).get_iterator(Dataset(X, y), training=True)
    assert isinstance(ours, ArrayBatches) and len(ours) == len(theirs) == (n // 16 if drop_last else -(-n // 16))
    for epoch in range(3):
        a, rng_a, gen_a = _epoch(ours, epoch, g_ours, 100 + epoch)
        b, rng_b, gen_b = _epoch(theirs, epoch, g_theirs, 100 + epoch)
        assert [len(x[0]) for x in a] == [len(x[0]) for x in b]
        for x, z in zip(a, b):
            _assert_same_batch(x, z)
        assert torch.equal(rng_a, rng_b) and torch.equal(gen_a, gen_b)


def test_validation_and_prediction_iterators_take_the_path_too():
    X, y = _data("float32")
    ours, theirs = _iterators(Dataset(X, y), training=False, batch_size=7)
    for a, b in zip(list(ours), list(theirs)):
        _assert_same_batch(a, b)
    torch.manual_seed(0)
    net = _net(max_epochs=1).fit(X, y)
    torch.manual_seed(0)
    other = _net(max_epochs=1, batch_gather=False).fit(X, y)
    np.testing.assert_array_equal(net.predict_proba(X), other.predict_proba(X))


def test_batch_size_minus_one_is_the_whole_dataset():
    X, y = _data("float32")
    ours, theirs = _iterators(Dataset(X, y), iterator_train__batch_size=-1)
    (a,), (b,) = list(ours), list(theirs)
    _assert_same_batch(a, b)
    assert len(a[0]) == 50


@pytest.mark.parametrize("settings", [
    dict(batch_gather=False),
    dict(iterator_train__num_workers=1),
    dict(iterator_train__collate_fn=torch.utils.data.default_collate),
    dict(iterator_train__sampler=torch.utils.data.SequentialSampler(range(50))),
    dict(iterator_train__worker_init_fn=print),
    dict(iterator_train=lambda dataset, **kwargs: DataLoader(dataset, **kwargs)),
], ids=["off", "workers", "collate_fn", "sampler", "worker_init_fn", "another_iterator"])
def test_skorch_s_dataloader_where_the_path_does_not_apply(settings):
    X, y = _data("float32")
    iterator = _net(**settings).get_iterator(Dataset(X, y), training=True)
    assert not isinstance(iterator, ArrayBatches)


@pytest.mark.parametrize("data", ["sparse", "object", "dataset_subclass", "strings"])
def test_skorch_s_dataloader_for_data_the_path_does_not_take(data):
    X, y = _data("float32")
    dataset = Dataset(X, y)
    if data == "sparse":
        from scipy import sparse
        dataset = Dataset(sparse.csr_matrix(X), y)
    elif data == "object":
        dataset = Dataset(X.astype(object), y)
    elif data == "strings":
        dataset = Dataset(X, np.array(["a", "b"] * 25))
    else:
        class MyDataset(Dataset):
            def transform(self, X, y):
                return X * 2, y
        dataset = MyDataset(X, y)
    assert type(_net().get_iterator(dataset, training=True)) is DataLoader


def test_batches_are_copies_that_leave_the_user_s_array_alone():
    from skorch.callbacks import Callback

    class Zeroing(Callback):  # writes into each batch, as a careless callback or module might
        def on_batch_begin(self, net, batch=None, **kwargs):
            batch[0].mul_(0)

    X, y = _data("float32", 64)
    kept = X.copy()
    _net(callbacks=[Zeroing()]).fit(X, y)
    np.testing.assert_array_equal(X, kept)


_READ_ONLY_FIT = """
import warnings
import numpy as np, torch
from ampnet import AmpNetClassifier
warnings.simplefilter("error")
X = np.random.RandomState(0).randn(64, 20).astype(np.float32)
y = (X[:, 0] > 0).astype(np.int64)
kept = X.copy()
X.setflags(write=False)
AmpNetClassifier(torch.nn.Linear(20, 2), criterion=torch.nn.CrossEntropyLoss, max_epochs=1, batch_size=16,
                 train_split=None, verbose=0, batch_gather={gather}).fit(X, y)
np.testing.assert_array_equal(X, kept)
"""


@pytest.mark.slow
def test_a_read_only_array_trains_without_a_warning():
    # torch warns of a read-only array once per process: fresh processes, so that the warning can show
    def run(gather):
        return subprocess.run([sys.executable, "-c", _READ_ONLY_FIT.format(gather=gather)],
                              capture_output=True, text=True, timeout=300)

    ours, theirs = run(True), run(False)
    assert ours.returncode == 0, ours.stderr
    assert theirs.returncode != 0 and "not writable" in theirs.stderr  # skorch's path warns


def test_an_iterator_pickles_as_a_net_without_it():
    X, y = _data("float32")
    net = _net().fit(X, y)
    state = net.amp_step_state_
    assert state.sources is None and state.batch_source is None  # let go at the fit's end
    again = pickle.loads(pickle.dumps(net))
    np.testing.assert_array_equal(again.predict_proba(X), net.predict_proba(X))
    copy.deepcopy(net)


@pytest.mark.parametrize("value, valid", [
    ("auto", "auto"), (" AUTO", "auto"), (True, True), (False, False), (np.bool_(True), True), (0, 0),
    (2**30, 2**30), (np.int64(5), 5),
])
def test_data_on_device_values(value, valid):
    from ampnet.config.params import check

    assert check("data_on_device", value) == valid


@pytest.mark.parametrize("value", ["gpu", -1, 1.5, None, [1]])
def test_data_on_device_refuses_with_the_fix(value):
    net = _net(data_on_device=value)
    with pytest.raises((ValueError, TypeError)) as info:
        net.initialize()
    text = str(info.value)
    assert "data_on_device" in text and "'auto'" in text and "Fix:" in text


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_batch_gather_refuses_with_the_fix(value):
    with pytest.raises(ValueError, match=r"batch_gather must be True or False; got .* Fix: batch_gather=True"):
        _net(batch_gather=value).initialize()


def test_set_params_changes_the_path_at_the_next_fit():
    X, y = _data("float32")
    net = _net().fit(X, y)
    net.set_params(batch_gather=False)
    assert type(net.get_iterator(Dataset(X, y), training=True)) is DataLoader
    net.set_params(batch_gather=True)
    assert isinstance(net.get_iterator(Dataset(X, y), training=True), ArrayBatches)


def test_train_split_shares_one_source_per_fit():
    X, y = _data("float32", 100)
    net = _net(train_split=ValidSplit(5), max_epochs=1)
    seen = []
    original = net.get_iterator

    def spy(dataset, training=False):
        iterator = original(dataset, training=training)
        seen.append(iterator)
        return iterator

    net.get_iterator = spy
    net.fit(X, y)
    train, valid = seen[:2]
    assert isinstance(train, ArrayBatches) and isinstance(valid, ArrayBatches)
    assert train.source is valid.source  # one copy of the arrays (on a GPU, one upload)
    assert train.n == 80 and valid.n == 20


# ---- CUDA: the arrays on the device once, or pinned batches one ahead ----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", ["auto", True, False, 0])
def test_cuda_batches_equal_the_dataloader_s(on_device):
    X, y = _data("dict")
    kwargs = dict(device="cuda", iterator_train__shuffle=True, data_on_device=on_device)
    ours = _net(**kwargs).get_iterator(Dataset(X, y), training=True)
    theirs = _net(batch_gather=False, **kwargs).get_iterator(Dataset(X, y), training=True)
    assert ours.source.resident is (on_device in ("auto", True))
    a, rng_a, _ = _epoch(ours, 0)
    b, rng_b, _ = _epoch(theirs, 0)
    assert torch.equal(rng_a, rng_b)
    for x, z in zip(a, b):
        assert x[0]["a"].device.type == "cuda"
        _assert_same_batch([{k: v.cpu() for k, v in x[0].items()}, x[1].cpu()], z)


def test_is_on_follows_torch_s_to():
    from ampnet.utils.placement import is_on

    t = torch.zeros(2)
    assert is_on(t, None) and is_on(t, "cpu") and is_on(t, torch.device("cpu"))
    assert not is_on(t, "cuda") and not is_on(t, torch.device("cuda", 1)) and not is_on(t, "meta")
    assert t.to("cpu") is t and t.to(torch.device("cpu")) is t  # what is_on stands for: no copy
    assert not is_on(t, "cpu:0") and t.to("cpu:0") is not t  # torch copies here


def test_a_memmap_and_a_net_without_a_device(tmp_path):
    X, y = _data("float32")
    mapped = np.lib.format.open_memmap(tmp_path / "X.npy", mode="w+", dtype=np.float32, shape=X.shape)
    mapped[:] = X
    for kwargs in (dict(), dict(device=None)):
        ours, theirs = _iterators(Dataset(mapped, y), iterator_train__shuffle=True, **kwargs)
        a, rng_a, _ = _epoch(ours, 0)
        b, rng_b, _ = _epoch(theirs, 0)
        for x, z in zip(a, b):
            _assert_same_batch(x, z)
        assert torch.equal(rng_a, rng_b)
