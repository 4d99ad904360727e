"""ampnet.utils.random_state: every global stream is put back, whatever numpy's bit generator."""

import random

import numpy as np
import pytest
import torch

from ampnet.utils.random_state import kept_random_state


def _draw():
    return np.random.randn(3), np.random.rand(2), random.random(), torch.rand(2)


@pytest.mark.parametrize("bit_generator", [None, "PCG64", "Philox"])
def test_kept_random_state_restores_every_stream(bit_generator):
    old = np.random.get_bit_generator()
    try:
        if bit_generator is not None:
            np.random.set_bit_generator(getattr(np.random, bit_generator)(0))
        np.random.seed(0) if bit_generator is None else None
        random.seed(0)
        torch.manual_seed(0)
        np.random.randn()  # an odd number of normals: numpy caches the second one
        with kept_random_state():
            inside = _draw()
        after = _draw()
        for a, b in zip(inside, after):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        np.random.set_bit_generator(old)


def test_kept_random_state_restores_on_error():
    torch.manual_seed(1)
    expected = torch.rand(1)
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        with kept_random_state():
            torch.rand(5)
            raise KeyboardInterrupt
    assert torch.equal(torch.rand(1), expected)
