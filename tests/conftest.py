"""Shared fixtures: tiny modules and data. Tests run with one torch thread
(fastest for tiny models, and bitwise reproducible)."""

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


class MLP(torch.nn.Module):
    """A small classifier that returns probabilities (skorch's default NLLLoss)."""

    def __init__(self, n_in=20, n_hidden=16, n_out=2):
        super().__init__()
        self.hidden = torch.nn.Linear(n_in, n_hidden)
        self.out = torch.nn.Linear(n_hidden, n_out)

    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)


class Regressor(torch.nn.Module):
    def __init__(self, n_in=20):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, 1)

    def forward(self, X):
        return self.lin(X)


@pytest.fixture(scope="session")
def classifier_data():
    rng = np.random.RandomState(0)
    X = rng.randn(128, 20).astype(np.float32)
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(np.int64)
    return X, y


@pytest.fixture(scope="session")
def regression_data():
    rng = np.random.RandomState(1)
    X = rng.randn(96, 20).astype(np.float32)
    y = (X[:, :3].sum(1, keepdims=True)).astype(np.float32)
    return X, y


@pytest.fixture
def mlp():
    return MLP


def params_equal(net_a, net_b):
    """Whether two nets' module parameters are bitwise equal."""
    pa = dict(net_a.module_.named_parameters())
    pb = dict(net_b.module_.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
