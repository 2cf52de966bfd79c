"""The loader's batches: reading and collating them, reuse's sample cache, pinning and the copy to the device.

**Batches.** With the default ``decode`` (identity), a batch's samples are a :class:`ByteBatch`: a sequence
of the files' ``bytes`` held in one buffer, read straight into shared memory by the workers. With a
``decode`` that returns equal-shape tensors (or arrays, or numbers) they are stacked into one tensor;
anything else stays a list (see :func:`collate_samples`).

**Device.** Batches are collated in the worker processes, pinned (a ``DataLoader`` pin thread) and copied
with non-blocking copies on a side CUDA stream one batch ahead of the consumer. ``device=None`` means CUDA
when it is available, else the CPU; ``device="cuda"`` without CUDA warns once and stays on the CPU, so the
same script runs on a machine without a GPU. ``samples`` and ``labels`` go to the device; ``ids`` stay on
the CPU (they index host-side bookkeeping such as :meth:`BlockLoader.path` and
:meth:`BlockLoader.report_losses`).
"""

from __future__ import annotations

import pickle
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from ..errors import DecodeError
from .mount_client import BlockfsMount

__all__ = ["ByteBatch", "collate_samples"]

ON_DECODE_ERROR = ("raise", "skip")
SKIP_HINT = "pass on_decode_error='skip' to leave such files out and count them (loader.skipped)"


def identity(data: Any) -> Any:
    """The default ``decode`` (a sample is the file's bytes), and the read pipeline's ``collate_fn`` (its
    dataset, :class:`BatchReader`, returns whole batches)."""
    return data


def collate_samples(samples: list) -> Any:
    """Stack equal-shape tensors or arrays (in shared memory inside a worker); numbers become a tensor;
    tuples are collated field by field; anything else (bytes, ragged shapes) stays a list."""
    first = samples[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        same = all(type(s) is type(first) and s.shape == first.shape and s.dtype == first.dtype for s in samples)
        numeric = isinstance(first, torch.Tensor) or first.dtype.kind in "biufc"
        return default_collate(samples) if same and numeric else list(samples)
    if isinstance(first, (int, float)) and all(type(s) is type(first) for s in samples):
        return default_collate(samples)
    if isinstance(first, tuple) and all(isinstance(s, tuple) and len(s) == len(first) for s in samples):
        return tuple(collate_samples(list(field)) for field in zip(*samples, strict=True))
    return list(samples)


class ByteBatch(Sequence):
    """A batch of samples that are the files' bytes, back to back in one uint8 tensor.

    ``batch[i]`` is sample ``i``'s bytes; ``data`` and ``offsets`` (``n + 1`` int64) are the buffer and
    where each sample starts. One buffer, rather than a list of ``bytes``, crosses from a worker process
    in shared memory instead of through a pickle, and can be pinned and copied to a GPU decoder in one
    piece. It stays on the host whatever the loader's device.
    """

    __slots__ = ("data", "offsets")

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor) -> None:
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> bytes:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a batch of {len(self)}")
        i %= len(self)
        start, end = self.offsets[i : i + 2].tolist()
        return self.data[start:end].numpy().tobytes()

    def __repr__(self) -> str:
        return f"ByteBatch({len(self)} samples, {self.data.numel()} bytes)"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ByteBatch):
            return torch.equal(self.offsets, other.offsets) and torch.equal(self.data, other.data)
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> tuple:
        return self.data, self.offsets

    def __setstate__(self, state: tuple) -> None:
        self.data, self.offsets = state

    def pin_memory(self) -> ByteBatch:
        """Called by the DataLoader's pin thread."""
        return ByteBatch(self.data.pin_memory(), self.offsets.pin_memory())

    def take(self, rows: np.ndarray) -> ByteBatch:
        sizes = np.diff(self.offsets.numpy())[rows]
        starts = self.offsets.numpy()[:-1][rows]
        source = self.data.numpy()
        data = np.concatenate(
            [source[a : a + n] for a, n in zip(starts.tolist(), sizes.tolist(), strict=True)] or [source[:0]]
        )
        return ByteBatch(torch.from_numpy(data), torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])))

    @staticmethod
    def cat(parts: list[ByteBatch]) -> ByteBatch:
        ends = np.cumsum([p.data.numel() for p in parts])
        offsets = [parts[0].offsets] + [p.offsets[1:] + int(base) for p, base in zip(parts[1:], ends[:-1], strict=True)]
        return ByteBatch(torch.cat([p.data for p in parts]), torch.cat(offsets))


# A batch smaller than this crosses from a worker pickled, as numpy arrays: every tensor a worker returns
# goes through its own shared-memory segment (four per batch), which costs more than copying a small one
# (README: Slow and remote storage).
PICKLED_BATCH_BYTES = 1 << 20


class WorkerBatch:
    """A small batch as a worker sends it: numpy arrays, pickled by value; :meth:`to_host` makes the batch."""

    __slots__ = ("data", "offsets", "labels", "ids")

    def __init__(self, data: np.ndarray, offsets: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> None:
        self.data, self.offsets, self.labels, self.ids = data, offsets, labels, ids

    def to_host(self) -> tuple[ByteBatch, torch.Tensor, torch.Tensor]:
        data, offsets = torch.from_numpy(self.data), torch.from_numpy(self.offsets)
        return ByteBatch(data, offsets), torch.from_numpy(self.labels), torch.from_numpy(self.ids)

    def pin_memory(self) -> tuple[ByteBatch, torch.Tensor, torch.Tensor]:
        """Called by the DataLoader's pin thread: the batch itself, pinned."""
        batch, labels, ids = self.to_host()
        return batch.pin_memory(), labels.pin_memory(), ids.pin_memory()


def on_host(batch: Any) -> Any:
    """A batch from the read pipeline as the loader yields it (a :class:`WorkerBatch` made whole); a
    :class:`DecodeFailure` is raised here."""
    if isinstance(batch, DecodeFailure):
        batch.raise_it()
    return batch.to_host() if isinstance(batch, WorkerBatch) else batch


def _byte_buffer(size: int) -> torch.Tensor:
    """A uint8 tensor, in shared memory inside a worker so that it crosses to the main process unpickled."""
    if get_worker_info() is None:
        return torch.empty(size, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))


def decode_error(sample_id: int, path: str, cause: BaseException, *, whole_batch: int = 0) -> DecodeError:
    """The one-line error for ``decode`` failing on a file (the caller chains ``cause``)."""
    text = str(cause).strip().splitlines()
    why = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
    if whole_batch:
        return DecodeError(
            f"decode failed on all {whole_batch} samples of a batch, the first {path!r} (sample {sample_id}): "
            f"{why}; skipping leaves no batch to yield: check that decode reads these files",
            path=path,
            sample_id=sample_id,
        )
    return DecodeError(
        f"decode failed on {path!r} (sample {sample_id}): {why}; replace the file or pack without it, or {SKIP_HINT}",
        path=path,
        sample_id=sample_id,
    )


class DecodeFailure:
    """A failed ``decode`` as it leaves the read pipeline (from a worker process too): :func:`on_host`
    raises it as a :class:`~blockfs.errors.DecodeError` in the loader's process, the decode's exception
    chained (with its traceback text as a note when it came from a worker, where tracebacks cannot cross)."""

    __slots__ = ("sample_id", "path", "cause", "trace", "whole_batch")

    def __init__(self, sample_id: int, path: str, cause: BaseException, whole_batch: int = 0) -> None:
        self.sample_id, self.path, self.whole_batch = sample_id, path, whole_batch
        self.trace = ""
        if get_worker_info() is not None:
            self.trace = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            try:
                pickle.loads(pickle.dumps(cause))
            except Exception:  # an exception that does not survive a pickle: its type and text do
                cause = RuntimeError(f"{type(cause).__name__}: {cause}")
        self.cause = cause

    def raise_it(self) -> None:
        error = decode_error(self.sample_id, self.path, self.cause, whole_batch=self.whole_batch)
        if self.trace and self.cause.__traceback__ is None and hasattr(self.cause, "add_note"):
            self.cause.add_note(f"decode's traceback, in the worker process:\n{self.trace.rstrip()}")
        raise error from self.cause


class BatchReader(torch.utils.data.Dataset):
    """Map-style: ``reader[ids]`` reads, decodes and collates the files ``ids`` -> (samples, labels, ids).

    A file ``decode`` fails on makes the batch a :class:`DecodeFailure` (``on_decode_error="raise"``), or
    is left out of it (``"skip"``: the batch's samples, labels and ids are the rest, in order)."""

    def __init__(
        self, mount: BlockfsMount, decode: Callable, collate: Callable, on_decode_error: str = "raise"
    ) -> None:
        if on_decode_error not in ON_DECODE_ERROR:
            raise ValueError(f"on_decode_error must be 'raise' or 'skip' (got {on_decode_error!r})")
        self.mount, self.decode, self.collate = mount, decode, collate
        self.on_decode_error = on_decode_error

    def __len__(self) -> int:
        return self.mount.n_entries

    def __getitem__(self, ids: np.ndarray) -> tuple[Any, torch.Tensor, torch.Tensor] | WorkerBatch:
        ids = np.asarray(ids, dtype=np.int64)
        if self.decode is identity and self.collate is collate_samples:
            if get_worker_info() is not None and int(self.mount.sizes[ids].sum()) < PICKLED_BATCH_BYTES:
                offsets, data = self._read_into_array(ids)
                return WorkerBatch(data, offsets, self.mount.labels[ids], ids)
            samples = self._read_bytes(ids)
        else:
            decoded = self._decoded(ids)
            if isinstance(decoded, DecodeFailure):
                return decoded  # type: ignore[return-value]  # raised by on_host in the loader's process
            kept, rows = decoded
            samples = self.collate(kept)
            if len(kept) < ids.size:
                ids = ids[rows]
        return samples, torch.from_numpy(self.mount.labels[ids]), torch.from_numpy(ids)

    def _decoded(self, ids: np.ndarray) -> tuple[list, np.ndarray] | DecodeFailure:
        """The decoded samples of ``ids`` and the rows they are (all of them unless skipped), or the failure."""
        samples, rows, first = [], [], None
        for row, i in enumerate(ids.tolist()):
            data = self.mount.read(i)  # a read error is the mount's, never skipped
            try:
                samples.append(self.decode(data))
            except Exception as e:
                if self.on_decode_error == "raise":
                    return DecodeFailure(i, self.mount.path(i), e)
                first = first or (i, e)
                continue
            rows.append(row)
        if not samples and first is not None:  # no sample to make a batch of: skipping cannot help
            return DecodeFailure(first[0], self.mount.path(first[0]), first[1], whole_batch=ids.size)
        return samples, np.asarray(rows, dtype=np.int64)

    def _read_bytes(self, ids: np.ndarray) -> ByteBatch:
        """The files' bytes read straight into one buffer (no bytes objects, no pickling)."""
        offsets = self._offsets(ids)
        data = _byte_buffer(int(offsets[-1]))
        self._fill(ids, offsets, data.numpy())
        return ByteBatch(data, torch.from_numpy(offsets))

    def _read_into_array(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = self._offsets(ids)
        data = np.empty(int(offsets[-1]), dtype=np.uint8)
        self._fill(ids, offsets, data)
        return offsets, data

    def _offsets(self, ids: np.ndarray) -> np.ndarray:
        """Where each file of ``ids`` starts in the batch's buffer, and its end (``ids.size + 1`` values)."""
        offsets = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(self.mount.sizes[ids], out=offsets[1:])
        return offsets

    def _fill(self, ids: np.ndarray, offsets: np.ndarray, buffer: np.ndarray) -> None:
        view = buffer.data  # a memoryview of the batch's bytes
        for i, start, end in zip(ids.tolist(), offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            self.mount.read_into(i, view[start:end])


class WorkList:
    """The read pipeline's sampler: the current iteration's batches of ids, one item each."""

    def __init__(self) -> None:
        self.items: list[np.ndarray] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


# --- reuse: rows of collated batches ----------------------------------------------------------------------
def _rows(x: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of a collated batch (a tensor/array is sliced on dim 0, a list is a list of samples)."""
    if isinstance(x, ByteBatch):
        return x.take(rows)
    if isinstance(x, torch.Tensor):
        return x[torch.from_numpy(rows)]
    if isinstance(x, np.ndarray):
        return x[rows]
    if isinstance(x, tuple):
        return tuple(_rows(v, rows) for v in x)
    if isinstance(x, list):
        return [x[i] for i in rows.tolist()]
    if isinstance(x, dict):
        return {k: _rows(v, rows) for k, v in x.items()}
    raise TypeError(
        f"reuse cannot take rows of a collated {type(x).__name__}: collate must return tensors, arrays, "
        "lists of samples, or tuples/dicts of them"
    )


def _cat(parts: list) -> Any:
    first = parts[0]
    if isinstance(first, ByteBatch):
        return ByteBatch.cat(parts)
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    if isinstance(first, tuple):
        return tuple(_cat(list(fields)) for fields in zip(*parts, strict=True))
    if isinstance(first, list):
        return [s for p in parts for s in p]
    if isinstance(first, dict):
        return {k: _cat([p[k] for p in parts]) for k in first}
    raise TypeError(f"reuse cannot concatenate collated {type(first).__name__} batches")


class SampleCache:
    """Reuse's in-memory cache: decoded samples by position in the epoch's sequence, evicted on use."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[int, int]] = {}  # position -> (batch key, row)
        self._batches: dict[int, list] = {}  # key -> [collated batch, rows still cached]
        self._next_key = 0

    def put(self, positions: range | np.ndarray, batch: Any) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._batches[key] = [batch, len(positions)]
        for row, position in enumerate(positions):
            self._where[int(position)] = (key, row)

    def take(self, positions: np.ndarray, fresh: Any | None) -> Any:
        """A new batch: ``fresh`` followed by the cached samples at ``positions``, which leave the cache.

        Always a copy, so a consumer that changes its batch in place cannot change a cached sample.
        """
        parts: list[Any] = []
        base: dict[int, int] = {}  # a cached batch's key -> where its rows start in the result
        rows: list[int] = []
        if fresh is not None:
            parts.append(fresh)
            rows.extend(range(len(fresh[2])))
        size = len(rows)
        for position in np.asarray(positions).tolist():
            key, row = self._where.pop(position)
            if key not in base:
                base[key] = size
                parts.append(self._batches[key][0])
                size += len(self._batches[key][0][2])
            rows.append(base[key] + row)
            self._batches[key][1] -= 1
        for key in base:
            if self._batches[key][1] == 0:
                del self._batches[key]
        return _rows(_cat(parts), np.asarray(rows, dtype=np.int64))


# --- pinned memory and the device -----------------------------------------------------------------------
def _map_tensors(x: Any, fn: Callable[[torch.Tensor], object]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def pinned(batch: tuple) -> tuple:
    """``batch`` (samples, labels, ids) with its samples and labels in pinned memory."""
    samples, labels, ids = batch
    samples = samples.pin_memory() if isinstance(samples, ByteBatch) else _map_tensors(samples, torch.Tensor.pin_memory)
    return samples, labels.pin_memory(), ids


class DeviceFeeder:
    """Copies host batches to ``device`` on a side CUDA stream, one batch ahead; on the CPU, passes them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batches: Iterator[tuple]) -> Iterator[tuple]:
        if self.stream is None:
            yield from batches
            return
        ahead = None
        for batch in batches:
            issued = self._issue(batch)
            if ahead is not None:
                yield self._ready(*ahead)
            ahead = issued
        if ahead is not None:
            yield self._ready(*ahead)

    def _issue(self, batch: tuple) -> tuple:
        samples, labels, ids = batch
        with torch.cuda.stream(self.stream):
            moved = _map_tensors((samples, labels), lambda t: t.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, ids, done, batch  # the host batch stays referenced until its copy is waited for

    def _ready(self, moved: tuple, ids: torch.Tensor, done: torch.cuda.Event, _host: tuple) -> tuple:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        # Memory allocated on the side stream is now used on the compute stream: tell the allocator.
        _map_tensors(moved, lambda t: t.record_stream(current))
        return moved[0], moved[1], ids


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device``, or CUDA when None and available; the CPU (with a warning) for CUDA without CUDA."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            f"device={str(device)!r} but CUDA is not available: batches stay on the CPU", RuntimeWarning, stacklevel=3
        )
        return torch.device("cpu")
    return resolved
