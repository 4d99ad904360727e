"""Grid search over AMP parameters on a Dask cluster (joblib's "dask" backend)
gives the same cv_results_ scores as n_jobs=1.

Needs the ``dask`` extra (in ``dev``, so CI runs it); the ``importorskip``
only spares users who installed ampnet without it.
"""

import numpy as np
import pytest
import torch
from sklearn.model_selection import GridSearchCV

from ampnet import AmpNetClassifier

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")
joblib = pytest.importorskip("joblib")


class SeededMLP(torch.nn.Module):
    """Seeds torch when the net builds it, so that every fit starts from the
    same weights and shuffles the same way in any process."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = torch.nn.Linear(20, 32)
        self.out = torch.nn.Linear(32, 2)

    def forward(self, X):
        return self.out(torch.relu(self.hidden(X)))


GRID = [
    {"amp_enabled": [False]},
    {"amp_enabled": [True], "amp_dtype": ["bfloat16"], "amp_level": ["mixed", "pure"]},
]
SCORES = ["mean_test_score", "std_test_score"] + [f"split{i}_test_score" for i in range(3)]


def _search():
    net = AmpNetClassifier(
        SeededMLP, criterion=torch.nn.CrossEntropyLoss, max_epochs=4, lr=0.1,
        batch_size=32, train_split=None, verbose=0,
    )
    return GridSearchCV(net, GRID, cv=3, scoring="neg_log_loss", refit=False, n_jobs=-1)


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
    )
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


@pytest.mark.slow
def test_grid_search_on_dask_cluster_matches_n_jobs_1(client, classifier_data):
    X, y = classifier_data
    local = _search().set_params(n_jobs=1).fit(X, y)

    with distributed.get_task_stream(client) as tasks:
        with joblib.parallel_backend("dask"):
            remote = _search().fit(X, y)

    workers = {t["worker"] for t in tasks.data}
    assert workers and workers <= set(client.scheduler_info()["workers"])  # ran on the workers
    assert remote.cv_results_["params"] == local.cv_results_["params"]
    for key in SCORES:
        np.testing.assert_array_equal(remote.cv_results_[key], local.cv_results_[key], err_msg=key)
    # Dask's nanny starts workers with OMP_NUM_THREADS=1: one torch thread each
    assert dask.config.get("distributed.nanny.pre-spawn-environ")["OMP_NUM_THREADS"] == 1
    assert set(client.run(torch.get_num_threads).values()) == {1}
    off, mixed, pure = local.cv_results_["mean_test_score"]
    assert np.isfinite([off, mixed, pure]).all()
    assert off != mixed  # bf16 changed the numerics: the AMP parameters reached the nets
