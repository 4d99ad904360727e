"""Keep the process's random streams as they were around work the user did
not ask for (the probes of ``'auto'``, ``AmpMonitor``'s replay).

:func:`kept_random_state` saves, and restores on exit (also on an error or
``KeyboardInterrupt``):

- torch's CPU generator, and each CUDA device's generator where CUDA has been
  initialized in this process (reading them would otherwise start CUDA);
- numpy's global generator (``np.random.*``), whatever its bit generator
  (``np.random.set_bit_generator`` may have replaced the default MT19937);
- Python's ``random`` module.

Generators the user created (``np.random.default_rng()``, a
``torch.Generator`` handed to a data loader) are the user's objects and are
not touched by ampnet's work, so they need no keeping.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Iterator

import numpy as np
import torch

__all__ = ["capture_random_state", "kept_random_state"]


def capture_random_state() -> Callable[[], None]:
    """Snapshot torch's, numpy's and Python's global generators; return the
    function that puts them back exactly."""
    torch_state = torch.get_rng_state()
    bit_generator = np.random.get_bit_generator()
    numpy_state = bit_generator.state  # a dict for any bit generator
    legacy = np.random.get_state(legacy=False)  # RandomState's own cache (the gaussian it holds)
    python_state = random.getstate()
    cuda_states = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )

    def restore() -> None:
        torch.set_rng_state(torch_state)
        np.random.set_bit_generator(bit_generator)
        if isinstance(legacy, dict) and legacy.get("bit_generator") == numpy_state.get("bit_generator"):
            np.random.set_state(legacy)
        bit_generator.state = numpy_state
        random.setstate(python_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)

    return restore


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """Run the body, then put torch's, numpy's and Python's global random
    streams back as they were before it (see the module's docstring)."""
    restore = capture_random_state()
    try:
        yield
    finally:
        restore()
