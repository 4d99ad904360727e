"""The host-read counter: the one place that counts Python-level reads of
tensor values back to the host. ``tests/test_architecture.py`` holds the
limits with it; ``tools/structure_report.py`` prints the figures of
docs/architecture.md with it.
"""

import numpy as np
import torch

#: Tensor methods that read a value back to the host.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class HostReadCounter:
    """Counts calls of :data:`HOST_READS` on tensors while active (``count``)."""

    def __init__(self):
        self.count = 0
        self._saved = {}

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(*args, __original=original, **kwargs):
                self.count += 1
                return __original(*args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}


def reads_per_batch(cls, module, **kwargs):
    """Host reads per training batch of ``cls(module, **kwargs)`` during a
    ``partial_fit`` of 2 epochs of 16 batches (256 rows of 20 features,
    SGD unless ``kwargs`` names another optimizer), and the net."""
    rng = np.random.RandomState(0)
    X = rng.randn(256, 20).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    kwargs = {"optimizer": torch.optim.SGD, "lr": 0.05, **kwargs}
    net = cls(module, max_epochs=2, batch_size=16, train_split=None, verbose=0, **kwargs)
    net.initialize()
    with HostReadCounter() as counter:
        net.partial_fit(X, y)
    batches = len(net.history[:, "batches"][0]) * len(net.history)
    return counter.count / batches, net
