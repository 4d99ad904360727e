"""The array data path: batches of array data gathered with one index.

skorch's default data path builds each batch sample by sample: its
``DataLoader`` calls ``Dataset.__getitem__`` once per row and collates the
rows (about 120 µs a batch of 32 on one CPU thread, a third of a tiny
model's whole step). When ``X`` and ``y`` are numpy arrays, torch tensors
or dicts of them, and the net uses skorch's ``Dataset`` and torch's
``DataLoader`` with nothing that needs them, :func:`array_batches` returns
an :class:`ArrayBatches` instead: each batch is gathered with one
``index_select`` per array.

It is a drop-in for that ``DataLoader``: the same batches (a list
``[X, y]``, ``y`` a zero placeholder where there is none, as skorch's
``Dataset`` gives), of the same dtypes, in the same order, drawn from the
same random streams: it draws the loader iterator's base seed and the
``RandomSampler``'s seed and permutations as torch does, so the global RNG
and a ``generator`` passed as ``iterator_train__generator`` advance exactly
as with the ``DataLoader`` (tested bitwise against it).

On a CUDA device the arrays move to the device once per fit when they fit
(``data_on_device``), and batches are gathered there: no copy and no host
sync per batch. Otherwise each batch is gathered into pinned memory and
copied ``non_blocking`` on a side stream, one batch ahead.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from skorch.dataset import Dataset
from torch.utils.data import DataLoader, Subset

from ampnet.utils.placement import is_on

__all__ = ["ArraySource", "ArrayBatches", "array_batches", "source_of", "LOADER_SETTINGS"]

#: numpy dtypes that torch takes as they are (what ``default_collate`` would build from them).
_NUMPY_KINDS = {np.dtype(t) for t in (
    np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
)}

#: The ``DataLoader`` settings the array path honours, with the values it honours
#: (None: any). Any other setting, or another value, keeps skorch's ``DataLoader``.
LOADER_SETTINGS = {
    "batch_size": None, "shuffle": None, "generator": None, "drop_last": None, "pin_memory": None,
    "num_workers": (0,), "timeout": (0,), "persistent_workers": (False,), "prefetch_factor": (None,),
}

#: ``data_on_device='auto'``: the arrays go to a CUDA device when they take at
#: most this share of its free memory.
AUTO_DEVICE_SHARE = 0.25


def _tensor(value: Any) -> torch.Tensor | None:
    """``value`` as a tensor sharing its memory (None: not an array the path takes)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad or value.is_sparse or value.layout != torch.strided:
            return None
        return value
    if type(value) not in (np.ndarray, np.memmap) or value.dtype not in _NUMPY_KINDS or value.ndim == 0:
        return None
    if any(s < 0 for s in value.strides):
        value = np.ascontiguousarray(value)
    with warnings.catch_warnings():
        # a read-only array: only ever read here (gathered into new tensors)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(value)


def _leaves(X: Any) -> dict[str, torch.Tensor] | torch.Tensor | None:
    """``X`` as a tensor, or a dict of tensors (None: not taken)."""
    if isinstance(X, dict):
        if not X or not all(isinstance(k, str) for k in X):
            return None
        out = {k: _tensor(v) for k, v in X.items()}
        return None if any(v is None for v in out.values()) else out
    return _tensor(X)


class ArraySource:
    """The arrays of one skorch ``Dataset``, as tensors, once per fit.

    Parameters
    ----------
    X : tensor or dict of tensors
      The features (sharing the memory of the arrays given).

    y : tensor or None
      The target.

    device : torch.device or None
      The net's device. On a CUDA device the tensors are moved there when
      ``on_device`` allows (see :func:`device_placement`); elsewhere they
      stay where they are and the net moves each batch, as skorch does.

    on_device : bool or int or str
      The net's ``data_on_device``.

    Attributes
    ----------
    resident : bool
      Whether the arrays were moved to ``device``.
    """

    def __init__(self, X: Any, y: torch.Tensor | None, device: torch.device | None, on_device: Any) -> None:
        self.device = device
        self.cuda = device is not None and device.type == "cuda"
        tensors = list(X.values()) if isinstance(X, dict) else [X]
        if y is not None:
            tensors.append(y)
        self.resident = self.cuda and (all(is_on(t, device) for t in tensors)
                                       or device_placement(on_device, tensors, device))
        if self.resident:
            X = {k: v.to(device) for k, v in X.items()} if isinstance(X, dict) else X.to(device)
            y = None if y is None else y.to(device)
        self.X, self.y = X, y
        self.n = len(next(iter(X.values())) if isinstance(X, dict) else X)

    def gather(self, idx: torch.Tensor, pinned: bool = False) -> list[Any]:
        """The batch of rows ``idx``: ``[X, y]`` as skorch's ``DataLoader``
        collates it (new tensors; ``pinned``: in pinned host memory)."""
        if not pinned and self.y is not None and type(self.X) is torch.Tensor:  # the common case, briefly
            return [torch.index_select(self.X, 0, idx), torch.index_select(self.y, 0, idx)]
        def take(t: torch.Tensor) -> torch.Tensor:
            if pinned:
                out = torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                return torch.index_select(t, 0, idx, out=out)
            return torch.index_select(t, 0, idx)

        X = {k: take(v) for k, v in self.X.items()} if isinstance(self.X, dict) else take(self.X)
        if self.y is None:  # skorch's Dataset: a zero placeholder per row
            y = torch.zeros((len(idx), 1), device=idx.device if self.resident else None)
            if pinned:
                y = y.pin_memory()
        else:
            y = take(self.y)
        return [X, y]


def device_placement(on_device: Any, tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether ``tensors`` go to the CUDA ``device`` once per fit:
    ``on_device`` True (always), False (never), an int (when they take at
    most that many bytes) or ``'auto'`` (when they take at most
    :data:`AUTO_DEVICE_SHARE` of the device's free memory)."""
    if on_device is True or on_device is False:
        return on_device
    size = sum(t.numel() * t.element_size() for t in tensors)
    if on_device == "auto":
        free, _ = torch.cuda.mem_get_info(device)
        return size <= AUTO_DEVICE_SHARE * free
    return size <= int(on_device)


class ArrayBatches:
    """Batches of an :class:`ArraySource`, as torch's ``DataLoader`` over
    skorch's ``Dataset`` (or a ``Subset`` of it) gives them.

    Parameters
    ----------
    source : ArraySource
      The arrays.

    rows : tensor or None
      The rows of ``source`` this dataset holds (a ``Subset``'s indices),
      None for all.

    batch_size : int
      Rows per batch.

    shuffle : bool
      A new permutation each epoch, drawn as ``RandomSampler`` draws it.

    generator : torch.Generator or None
      As the ``DataLoader``'s ``generator``.

    drop_last : bool
      Leave out the last, short batch.

    The rows of ``source`` in a batch recently yielded (:meth:`rows_of`)
    let the training step find the bad rows of a skipped step without
    keeping the batch.
    """

    def __init__(
        self, source: ArraySource, rows: torch.Tensor | None, batch_size: int, shuffle: bool = False,
        generator: torch.Generator | None = None, drop_last: bool = False,
    ) -> None:
        self.source, self.rows = source, rows
        self.batch_size, self.shuffle = int(batch_size), bool(shuffle)
        self.generator, self.drop_last = generator, bool(drop_last)
        self.n = source.n if rows is None else len(rows)
        self._recent: collections.deque = collections.deque(maxlen=3)

    def rows_of(self, batch: Any) -> torch.Tensor | None:
        """The rows of ``source`` in ``batch``, one of the last few this
        iterator yielded (None: not one of them)."""
        for yielded, rows in self._recent:
            if yielded is batch:
                return rows
        return None

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.batch_size
        return -(-self.n // self.batch_size)

    def _order(self) -> tuple[torch.Tensor, torch.Generator | None]:
        """This epoch's rows of the source, in order, drawn as the
        ``DataLoader`` draws them: the iterator's base seed first, then the
        sampler's seed (where it has no generator) and its permutation."""
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # the iterator's base seed
        gen = None
        if self.shuffle:
            gen = self.generator
            if gen is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                gen = torch.Generator()
                gen.manual_seed(seed)
            order = torch.randperm(self.n, generator=gen)
        else:
            order = torch.arange(self.n)
        if self.rows is not None:
            order = self.rows[order]
        return order, gen

    def _second_draw(self, gen: torch.Generator | None) -> None:
        """``RandomSampler`` draws a second (empty) permutation once the first
        is used up; it advances a generator passed in, so it is drawn too."""
        if gen is not None and gen is self.generator:
            torch.randperm(self.n, generator=gen)

    def __iter__(self) -> Iterator[list[Any]]:
        order, gen = self._order()
        bs, n = self.batch_size, self.n
        stop = n - n % bs if self.drop_last else n
        # with a short last batch kept, the sampler's second draw comes before it
        early = not self.drop_last and n % bs != 0
        starts = range(0, stop, bs)
        source = self.source
        if source.resident:
            order = order.to(source.device, non_blocking=False)
        staged = source.cuda and not source.resident
        ahead = _Prefetch(source) if staged else None
        for k, start in enumerate(starts):
            idx = order[start:start + bs]
            if early and k == len(starts) - 1:
                self._second_draw(gen)
            if ahead is not None:
                batch = ahead.take(k, idx, order[start + bs:start + 2 * bs] if start + bs < stop else None)
            else:
                batch = source.gather(idx)
            self._recent.append((batch, idx))
            yield batch
        if not early:
            self._second_draw(gen)


class _Prefetch:
    """Pinned batches copied to the CUDA device on a side stream, one batch ahead."""

    def __init__(self, source: ArraySource) -> None:
        self.source = source
        self.stream = torch.cuda.Stream(source.device)
        self.next: tuple[int, list[Any], Any] | None = None

    def _start(self, k: int, idx: torch.Tensor) -> tuple[int, list[Any], Any]:
        host = self.source.gather(idx, pinned=True)
        with torch.cuda.stream(self.stream):
            # the pinned blocks stay reserved until the copy on this stream is done (torch's host allocator)
            batch = _map(host, lambda t: t.to(self.source.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        return k, batch, done

    def take(self, k: int, idx: torch.Tensor, following: torch.Tensor | None) -> list[Any]:
        """Batch ``k`` (rows ``idx``), on the device; batch ``k + 1`` (rows
        ``following``, None: there is none) starts its copy."""
        staged = self.next if self.next is not None and self.next[0] == k else self._start(k, idx)
        self.next = self._start(k + 1, following) if following is not None else None
        _, batch, done = staged
        current = torch.cuda.current_stream(self.source.device)
        current.wait_event(done)
        _map(batch, lambda t: t.record_stream(current))
        return batch


def _map(batch: list[Any], fn: Any) -> list[Any]:
    X, y = batch
    X = {k: fn(v) for k, v in X.items()} if isinstance(X, dict) else fn(X)
    return [X, fn(y)]


def source_of(dataset: Any) -> tuple[Any, torch.Tensor | None] | None:
    """``(dataset, rows)`` for skorch's own ``Dataset`` (rows None) or a
    ``Subset`` of it (rows: its indices); None for any other dataset."""
    rows = None
    if type(dataset) is Subset:
        rows = torch.as_tensor(np.asarray(dataset.indices), dtype=torch.int64)
        dataset = dataset.dataset
    if type(dataset) is not Dataset:
        return None
    return dataset, rows


def array_batches(net: Any, dataset: Any, training: bool, sources: dict | None) -> ArrayBatches | None:
    """An :class:`ArrayBatches` for what ``net.get_iterator(dataset, training)``
    would build, where the array path applies; else None (skorch's path).

    It applies when ``batch_gather`` is on, the iterator is torch's
    ``DataLoader`` itself with only the settings in :data:`LOADER_SETTINGS`,
    and the dataset is skorch's ``Dataset`` (or a ``Subset`` of it) over
    arrays :func:`_leaves` takes. ``sources``: the fit's sources by dataset,
    so that the training and validation split share one copy on the device.
    """
    prefix = "iterator_train" if training else "iterator_valid"
    if (net.iterator_train if training else net.iterator_valid) is not DataLoader:
        return None
    kwargs = net.get_params_for(prefix)
    for key, value in kwargs.items():
        allowed = LOADER_SETTINGS.get(key, ())
        if key not in LOADER_SETTINGS or (allowed is not None and not any(value is a or value == a for a in allowed)):
            return None
    found = source_of(dataset)
    if found is None:
        return None
    base, rows = found
    batch_size = kwargs.get("batch_size", net.batch_size)
    if batch_size == -1:
        batch_size = len(dataset)
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
        return None  # the DataLoader says what is wrong
    generator = kwargs.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        return None
    source = sources.get(id(base)) if sources is not None else None
    if source is None or source[0] is not base:
        X = _leaves(base.X)
        y = None if base.y is None else _tensor(base.y)
        if X is None or (base.y is not None and y is None) or not _same_length(X, y, len(base)):
            return None
        device = torch.device(net.device) if net.device is not None else None
        tensors = [*(X.values() if isinstance(X, dict) else [X]), *([] if y is None else [y])]
        if any(not t.is_cpu and not is_on(t, device) for t in tensors):
            return None  # tensors on another device: skorch's path moves each batch
        source = (base, ArraySource(X, y, device, net.data_on_device))
        if sources is not None:
            sources[id(base)] = source
    return ArrayBatches(source[1], rows, batch_size, bool(kwargs.get("shuffle", False)), generator,
                        bool(kwargs.get("drop_last", False)))


def _same_length(X: Any, y: torch.Tensor | None, n: int) -> bool:
    tensors = list(X.values()) if isinstance(X, dict) else [X]
    return all(len(t) == n for t in tensors) and (y is None or len(y) == n)
