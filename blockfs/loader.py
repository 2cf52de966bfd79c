"""The companion loader: block-shuffled batches read through a blockfs mount, on the GPU one batch ahead.

    loader = BlockLoader("/mnt/imagenet", batch_size=256, decode=my_decode, device="cuda", num_workers=4)
    for epoch in range(90):
        loader.set_epoch(epoch)
        for samples, labels, ids in loader: ...

**Finding the data.** The mount root carries the extended attribute ``user.blockfs.control``, the name of a
hidden control directory at the root; in it ``index.bfi`` is the dataset's index (block layout, labels,
sizes, paths), ``metadata.json`` its metadata and ``stats.json`` the mount's live statistics. Files are read
with plain ``open``/``read`` through the mount, in block order, so the mount reads each block from storage
once and serves the rest of its files from memory. Labels come from the index, never from paths.

**The epoch's sequence** is a pure function of (seed, epoch, rank, world size, number of workers, batch
size): each of the ``W = max(1, num_workers)`` workers has its own :func:`~blockfs.order.block_shuffled_order`
(disjoint whole blocks); the rank's sequence takes ``batch_size`` samples from worker 0, then from worker 1,
and so on round robin, skipping a worker that has run out -- the sequence a torch ``DataLoader`` with
``batch_size`` gives over :class:`BlockShuffleDataset` -- and is cut into batches of ``batch_size``, so
every rank has the same number of batches. Batch ``k`` is read by worker process ``k mod W``, mostly the one
that owns its blocks. Resuming replays the same plan from the first batch not yet handed out.

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

**Prefetch announcements.** At the start of every epoch the loader tells the mount which blocks its rank
will read, first needed first (with ``importance=``, only the blocks of the selected samples), so the mount
can fetch them ahead of the reader. The mount is read-only (and in its ``enosys`` open mode the kernel
sends no ``open`` at all), so the channel is not a file in it: when the control directory has the extended
attribute ``user.blockfs.prefetch``, its value is the path of a Unix stream socket the mount listens on;
the loader connects, sends the block ids as ASCII decimal numbers, one per line (``b"17\\n3\\n42\\n"``),
and closes the connection (end of the announcement). It is a hint: the mount may cut it short or ignore it,
and the loader does not wait for an answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from .errors import FormatError, NotADatasetError
from .importance import ImportanceConfig, LossTracker, select_important, subset_layout
from .index import KIND_FILE, PackedIndex
from .order import BlockLayout, block_shuffled_order
from .reuse import ReusePlan, plan_reuse

__all__ = [
    "BlockLoader",
    "BlockShuffleDataset",
    "BlockfsMount",
    "ByteBatch",
    "ImportanceConfig",
    "collate_samples",
    "merge_worker_orders",
]

CONTROL_XATTR = "user.blockfs.control"
INDEX_FILE = "index.bfi"
METADATA_FILE = "metadata.json"
STATS_FILE = "stats.json"
PREFETCH_XATTR = "user.blockfs.prefetch"
ANNOUNCE_TIMEOUT_S = 5.0
STATE_VERSION = 1


def identity(data: bytes) -> bytes:
    """The default ``decode``: a sample is the file's bytes."""
    return data


# --- the mount ------------------------------------------------------------------------------------------
class BlockfsMount:
    """What the loader needs from a mounted dataset: the layout, labels, paths, reads, stats and hints.

    Pickles as its root path only (a worker process reopens the index), so it can go to spawned workers.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.control = _control_dir(self.root)
        self._open()

    def _open(self) -> None:
        control = os.path.join(self.root, self.control)
        self.index = _open_index(os.path.join(control, INDEX_FILE))
        try:
            with open(os.path.join(control, METADATA_FILE), encoding="utf-8") as f:
                self.metadata: dict = json.load(f)
        except FileNotFoundError:
            self.metadata = {}
        except (OSError, ValueError) as e:
            raise FormatError(f"{control}/{METADATA_FILE}: unreadable metadata: {e}") from e
        a = self.index.arrays
        self._root_bytes = os.fsencode(self.root)
        # Copies, not views of the map, so that close() can unmap the index at once.
        self._size = a["size"].astype(np.int64)
        self.labels: np.ndarray = a["label"].astype(np.int64)
        self.block_of: np.ndarray = a["block"].astype(np.int64)
        self.layout = BlockLayout(a["block_offsets"], a["block_files"])

    def __getstate__(self) -> dict:
        return {"root": self.root, "control": self.control}

    def __setstate__(self, state: dict) -> None:
        self.root, self.control = state["root"], state["control"]
        self._open()

    @property
    def n_entries(self) -> int:
        """Size of the id space (every entry of the tree; only regular files are samples)."""
        return self.index.n_entries

    @property
    def file_ids(self) -> np.ndarray:
        return np.flatnonzero(self.index.arrays["kind"] == KIND_FILE)

    @property
    def classes(self) -> list[str] | None:
        return self.metadata.get("classes")

    def path(self, entry: int) -> str:
        """The file's path in the mount."""
        return os.path.join(self.root, os.fsdecode(self.index.path(int(entry))))

    def read(self, entry: int) -> bytes:
        """The file's bytes, read through the mount."""
        data = bytearray(int(self._size[entry]))
        self.read_into(entry, memoryview(data))
        return bytes(data)

    def read_into(self, entry: int, buffer: memoryview) -> None:
        """Read the file, through the mount, into ``buffer`` (exactly its size)."""
        path = self._root_bytes + b"/" + self.index.path(entry)
        size = len(buffer)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < size:  # a short read is legal; the index says how much there is
                n = os.readv(fd, [buffer[done:]])
                if n == 0:
                    raise FormatError(
                        f"{os.fsdecode(path)}: {done} bytes, but the index says {size}: is the mount "
                        "serving another dataset than its control directory describes?"
                    )
                done += n
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap the index: while it is mapped, the mount is busy and cannot be unmounted."""
        self.index.close()

    def stats(self) -> dict:
        """The mount's live statistics (``stats.json`` of the control directory)."""
        with open(os.path.join(self.root, self.control, STATS_FILE), encoding="utf-8") as f:
            return json.load(f)

    def announce(self, blocks: np.ndarray) -> bool:
        """Tell the mount which blocks come next, first needed first; False when it takes no hints."""
        control = os.path.join(self.root, self.control)
        try:
            address = os.getxattr(control, PREFETCH_XATTR)
        except OSError:
            return False
        payload = "".join(f"{b}\n" for b in np.asarray(blocks).tolist()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
                channel.settimeout(ANNOUNCE_TIMEOUT_S)
                channel.connect(address)
                channel.sendall(payload)
        except OSError as e:
            warnings.warn(
                f"cannot announce the epoch's blocks to the mount at {self.root} ({os.fsdecode(address)}): {e}",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        return True


def _control_dir(root: str) -> str:
    hint = f"mount a packed dataset there first: blockfs mount DATASET {root}"
    if not os.path.isdir(root):
        raise NotADatasetError(f"{root!r} is not a blockfs mount: it is not a directory ({hint})")
    try:
        name = os.fsdecode(os.getxattr(root, CONTROL_XATTR))
    except OSError as e:
        if os.path.exists(os.path.join(root, "blockfs.json")):
            hint = f"it is a packed dataset, not its mount: blockfs mount {root} MOUNTPOINT"
        raise NotADatasetError(
            f"{root!r} is not a blockfs mount: it has no {CONTROL_XATTR!r} attribute ({e.strerror}); {hint}"
        ) from None
    if not name or "/" in name or name in (".", ".."):
        raise NotADatasetError(f"{root!r}: {CONTROL_XATTR}={name!r} is not the name of a control directory")
    if not os.path.isfile(os.path.join(root, name, INDEX_FILE)):
        raise NotADatasetError(
            f"{root!r} is not a blockfs mount: its control directory {name!r} has no {INDEX_FILE}"
        )
    return name


def _open_index(path: str) -> PackedIndex:
    try:
        return PackedIndex(path)
    except OSError:
        # The mount may not support mmap (direct I/O): map a private copy instead.
        fd, copy = tempfile.mkstemp(prefix="blockfs-index-", suffix=".bfi")
        try:
            with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            return PackedIndex(copy)
        finally:
            os.unlink(copy)  # the map keeps the bytes


# --- batches --------------------------------------------------------------------------------------------
def collate_samples(samples: list) -> Any:
    """Stack equal-shape tensors or arrays (in shared memory inside a worker); numbers become a tensor;
    tuples are collated field by field; anything else (bytes, ragged shapes) stays a list."""
    first = samples[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        same = all(
            type(s) is type(first) and s.shape == first.shape and s.dtype == first.dtype for s in samples
        )
        numeric = isinstance(first, torch.Tensor) or first.dtype.kind in "biufc"
        return default_collate(samples) if same and numeric else list(samples)
    if isinstance(first, (int, float)) and all(type(s) is type(first) for s in samples):
        return default_collate(samples)
    if isinstance(first, tuple) and all(isinstance(s, tuple) and len(s) == len(first) for s in samples):
        return tuple(collate_samples(list(field)) for field in zip(*samples))
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
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
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
        data = np.concatenate([source[a : a + n] for a, n in zip(starts.tolist(), sizes.tolist())] or [source[:0]])
        return ByteBatch(torch.from_numpy(data), torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])))

    @staticmethod
    def cat(parts: list[ByteBatch]) -> ByteBatch:
        ends = np.cumsum([p.data.numel() for p in parts])
        offsets = [parts[0].offsets] + [p.offsets[1:] + int(base) for p, base in zip(parts[1:], ends[:-1])]
        return ByteBatch(torch.cat([p.data for p in parts]), torch.cat(offsets))


def _byte_buffer(size: int) -> torch.Tensor:
    """A uint8 tensor, in shared memory inside a worker so that it crosses to the main process unpickled."""
    if get_worker_info() is None:
        return torch.empty(size, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))


class _BatchReader(torch.utils.data.Dataset):
    """Map-style: ``reader[ids]`` reads, decodes and collates the files ``ids`` -> (samples, labels, ids)."""

    def __init__(self, mount: BlockfsMount, decode: Callable, collate: Callable) -> None:
        self.mount, self.decode, self.collate = mount, decode, collate

    def __len__(self) -> int:
        return self.mount.n_entries

    def __getitem__(self, ids: np.ndarray) -> tuple[Any, torch.Tensor, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        if self.decode is identity and self.collate is collate_samples:
            samples = self._read_bytes(ids)
        else:
            samples = self.collate([self.decode(self.mount.read(i)) for i in ids.tolist()])
        return samples, torch.from_numpy(self.mount.labels[ids]), torch.from_numpy(ids)

    def _read_bytes(self, ids: np.ndarray) -> ByteBatch:
        """The files' bytes read straight into one buffer (no bytes objects, no pickling)."""
        offsets = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(self.mount._size[ids], out=offsets[1:])
        data = _byte_buffer(int(offsets[-1]))
        view = memoryview(data.numpy())
        for i, start, end in zip(ids.tolist(), offsets[:-1].tolist(), offsets[1:].tolist()):
            self.mount.read_into(i, view[start:end])
        return ByteBatch(data, torch.from_numpy(offsets))


def _as_is(batch: Any) -> Any:
    return batch


class _WorkList:
    """The read pipeline's sampler: the current iteration's batches of ids, one item each."""

    def __init__(self) -> None:
        self.items: list[np.ndarray] = []

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def merge_worker_orders(orders: list[np.ndarray], chunk: int) -> np.ndarray:
    """Round robin over the workers' orders, ``chunk`` samples at a time, skipping those that ran out."""
    if len(orders) == 1:
        return np.asarray(orders[0], dtype=np.int64)
    keys = np.concatenate([np.arange(o.size) // chunk * len(orders) + w for w, o in enumerate(orders)])
    return np.concatenate(orders).astype(np.int64)[np.argsort(keys, kind="stable")]


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def _pinned(batch: tuple) -> tuple:
    samples, labels, ids = batch
    samples = samples.pin_memory() if isinstance(samples, ByteBatch) else _map_tensors(samples, torch.Tensor.pin_memory)
    return samples, labels.pin_memory(), ids


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
        return tuple(_cat(list(fields)) for fields in zip(*parts))
    if isinstance(first, list):
        return [s for p in parts for s in p]
    if isinstance(first, dict):
        return {k: _cat([p[k] for p in parts]) for k in first}
    raise TypeError(f"reuse cannot concatenate collated {type(first).__name__} batches")


class _SampleCache:
    """Reuse's in-memory cache: decoded samples by position in the epoch's sequence, evicted on use."""

    def __init__(self) -> None:
        self._where: dict[int, tuple[int, int]] = {}  # position -> (batch key, row)
        self._batches: dict[int, list] = {}  # key -> [collated batch, rows still cached]
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._where)

    def put(self, positions: range | np.ndarray, batch: Any) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._batches[key] = [batch, len(positions)]
        for row, position in enumerate(positions):
            self._where[int(position)] = (key, row)

    def take(self, positions: np.ndarray, fresh: Any | None) -> Any:
        """A new batch: ``fresh`` followed by the cached samples at ``positions``, which leave the cache.

        Always a copy, so a consumer that changes its batch in place cannot change a cached sample.
        """
        parts, base, rows = [], {}, []
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


@dataclasses.dataclass(frozen=True, eq=False)
class _EpochPlan:
    """Batch ``k`` reads ``sequence[bounds[k]:bounds[k + 1]]`` fresh (plus ``reuse``'s cached samples)."""

    sequence: np.ndarray
    bounds: np.ndarray
    reuse: ReusePlan | None
    selected: np.ndarray | None

    def __len__(self) -> int:
        return self.bounds.size - 1

    def fresh_ids(self, k: int) -> np.ndarray:
        return self.sequence[self.bounds[k] : self.bounds[k + 1]]


class _DeviceFeeder:
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


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            f"device={str(device)!r} but CUDA is not available: batches stay on the CPU", RuntimeWarning, stacklevel=3
        )
        return torch.device("cpu")
    return resolved


def _distributed() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer of at least {low} (got {value!r})")
    return int(value)


def _sharding(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """rank and world size: the keywords where given, else torch.distributed's, else (0, 1)."""
    from_dist = _distributed() or (0, 1)
    world_size = _check_int("world_size", from_dist[1] if world_size is None else world_size, 1)
    rank = from_dist[0] if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size} (got {rank!r})")
    return int(rank), world_size


# --- the loaders ----------------------------------------------------------------------------------------
class BlockShuffleDataset(IterableDataset):
    """Samples ``(decode(bytes), label, id)`` in block-shuffled order, for your own ``DataLoader``.

    Each ``DataLoader`` worker reads its own share (``torch.utils.data.get_worker_info()``), the same
    share :class:`BlockLoader` gives its worker of that number; ``DataLoader(ds, batch_size=B,
    num_workers=W)`` then yields the same ids in the same order as ``BlockLoader(..., batch_size=B,
    num_workers=W)``, except that its last batches are each worker's partial one. Call :meth:`set_epoch`
    before each epoch (with ``persistent_workers`` the workers keep the epoch they started with).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        decode: Callable[[bytes], Any] = identity,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        blocks_in_flight: int = 6,
        drop_last: bool = False,
    ) -> None:
        self.mount = BlockfsMount(root)
        self.decode = decode
        self.seed = _check_int("seed", seed, 0)
        self.rank, self.world_size = _sharding(rank, world_size)
        self.blocks_in_flight = _check_int("blocks_in_flight", blocks_in_flight, 1)
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = _check_int("epoch", epoch, 0)

    def order(self, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """The ids ``worker`` of ``num_workers`` reads this epoch."""
        return block_shuffled_order(
            self.mount.layout, seed=self.seed, epoch=self.epoch, rank=self.rank, world_size=self.world_size,
            worker=worker, num_workers=num_workers, blocks_in_flight=self.blocks_in_flight,
            drop_last=self.drop_last,
        )  # fmt: skip

    def __len__(self) -> int:
        return int(self.order().size)

    def close(self) -> None:
        """Unmap the index, so the mount can be unmounted."""
        self.mount.close()

    def __iter__(self) -> Iterator[tuple[Any, int, int]]:
        info = get_worker_info()
        order = self.order(info.id, info.num_workers) if info is not None else self.order()
        labels = self.mount.labels
        for i in order.tolist():
            yield self.decode(self.mount.read(i)), int(labels[i]), i


class BlockLoader:
    """Batches ``(samples, labels, ids)`` of a blockfs mount in block-shuffled order (see the module doc).

    ``decode(bytes) -> sample`` runs in the workers; ``collate(list of samples)`` (default
    :func:`collate_samples`) makes the batch. ``rank``/``world_size`` default to torch.distributed's when it
    is initialised. ``drop_last`` follows ``DistributedSampler`` (drop rather than pad to equal rank sizes)
    and also drops a last partial batch. ``reuse=True``: see :mod:`blockfs.reuse`. ``importance=``: an
    :class:`ImportanceConfig`, see :mod:`blockfs.importance` and :meth:`report_losses`.

    One iteration at a time; ``state_dict()`` after a batch and ``load_state_dict()`` in a new loader
    (same arguments, same number of workers) continue with exactly the batches that would have followed.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int,
        decode: Callable[[bytes], Any] = identity,
        device: str | torch.device | None = None,
        *,
        seed: int = 0,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        blocks_in_flight: int = 6,
        reuse: bool = False,
        importance: ImportanceConfig | None = None,
        collate: Callable[[list], Any] = collate_samples,
        prefetch_factor: int = 2,
        multiprocessing_context: str | None = None,
    ) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.blocks_in_flight = _check_int("blocks_in_flight", blocks_in_flight, 1)
        self.prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 1)
        self.rank, self.world_size = _sharding(rank, world_size)
        if reuse and self.batch_size < 2:
            raise ValueError(f"reuse needs batch_size of at least 2 (got {batch_size}): half of a batch is reused")
        if importance is not None and not isinstance(importance, ImportanceConfig):
            raise TypeError(f"importance must be an ImportanceConfig or None (got {type(importance).__name__})")
        self.drop_last, self.reuse, self.importance = bool(drop_last), bool(reuse), importance
        self.mount = BlockfsMount(root)
        self.device = _resolve_device(device)
        self.decode = decode
        self._reader = _BatchReader(self.mount, decode, collate)
        self.multiprocessing_context = multiprocessing_context
        self._work = _WorkList()
        self._dataloader: DataLoader | None = None
        self._feeder = _DeviceFeeder(self.device)
        self._tracker = LossTracker(self.mount.n_entries) if importance is not None else None
        self._planned_epoch = -1  # the last epoch whose losses were folded into the tracker
        self.epoch = 0
        self._plan: _EpochPlan | None = None
        self._position = 0  # batches of this epoch handed out
        self._resume_at: int | None = None

    # --- epochs and order ---------------------------------------------------------------------------
    @property
    def root(self) -> str:
        return self.mount.root

    @property
    def classes(self) -> list[str] | None:
        return self.mount.classes

    def path(self, i: int | torch.Tensor) -> str:
        """The path in the mount of the file with id ``i``."""
        return self.mount.path(int(i))

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new order); the epoch of a just-loaded state keeps its resume point."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch or self._resume_at is None:
            self._resume_at = None
            self._position = 0
        if epoch != self.epoch:
            self._plan = None
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches in this epoch (for this rank)."""
        return len(self._epoch_plan())

    @property
    def selected(self) -> np.ndarray | None:
        """The ids the importance option selected for this epoch (None: every sample)."""
        return self._epoch_plan().selected

    def _epoch_plan(self) -> _EpochPlan:
        if self._plan is None:
            self._plan = self._build_plan()
            blocks = self.mount.block_of[self._plan.sequence]
            _, first = np.unique(blocks, return_index=True)
            self.mount.announce(blocks[np.sort(first)])
        return self._plan

    def _build_plan(self) -> _EpochPlan:
        layout, selected = self.mount.layout, self._select()
        if selected is not None:
            keep = np.zeros(self.mount.n_entries, dtype=bool)
            keep[selected] = True
            layout = subset_layout(layout, keep)
        workers = max(1, self.num_workers)
        orders = [
            block_shuffled_order(
                layout, seed=self.seed, epoch=self.epoch, rank=self.rank, world_size=self.world_size,
                worker=w, num_workers=workers, blocks_in_flight=self.blocks_in_flight, drop_last=self.drop_last,
            )
            for w in range(workers)
        ]  # fmt: skip
        if not self.reuse:
            sequence = merge_worker_orders(orders, self.batch_size)
            n = sequence.size
            bounds = np.append(np.arange(0, n, self.batch_size), n)
            if self.drop_last and n % self.batch_size:
                bounds = bounds[:-1]
            return _EpochPlan(sequence, bounds, None, selected)
        sequence = merge_worker_orders(orders, self.batch_size - self.batch_size // 2)
        reuse = plan_reuse(
            sequence.size, self.batch_size, seed=self.seed, epoch=self.epoch, rank=self.rank, drop_last=self.drop_last
        )
        return _EpochPlan(sequence, reuse.fresh_bounds, reuse, selected)

    def _select(self) -> np.ndarray | None:
        if self._tracker is None:
            return None
        if self.epoch != self._planned_epoch:
            self._all_reduce(self._tracker.pending_sum, self._tracker.pending_count)
            self._tracker.fold()
            self._planned_epoch = self.epoch
        if self.epoch < self.importance.warmup_epochs:
            return None
        if not self._tracker.observed:
            warnings.warn(
                f"importance: no losses were reported before epoch {self.epoch}, so it reads every sample; "
                "call loader.report_losses(ids, losses) after each step",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return select_important(
            self._tracker, self.mount.file_ids, self.importance.fraction, seed=self.seed, epoch=self.epoch
        )

    def _all_reduce(self, *arrays: np.ndarray) -> None:
        """Sum ``arrays`` in place over the ranks, so every rank selects from the same losses."""
        if self.world_size == 1 or _distributed() is None or dist.get_world_size() != self.world_size:
            return
        flat = torch.from_numpy(np.concatenate([a.astype(np.float64) for a in arrays]))
        if dist.get_backend() == "nccl":
            flat = flat.cuda()
        dist.all_reduce(flat)
        flat = flat.cpu().numpy()
        start = 0
        for a in arrays:
            a[:] = flat[start : start + a.size].astype(a.dtype)
            start += a.size

    def report_losses(self, ids: Any, losses: Any) -> None:
        """Record each sample's loss of this step (``reduction="none"``), for the importance option.

        Under DDP each rank reports its own samples; the ranks' losses are summed (all-reduce) when the next
        epoch starts (its first ``iter`` or ``len``), which every rank must reach, as with any collective.
        """
        if self._tracker is None:
            raise RuntimeError(
                "report_losses needs the importance option: BlockLoader(..., importance=ImportanceConfig())"
            )
        self._tracker.report(_to_numpy(ids), _to_numpy(losses))

    # --- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, Any, torch.Tensor]]:
        plan = self._epoch_plan()
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self._position = start
        for k, batch in enumerate(self._feeder(self._host_batches(plan, start)), start):
            self._position = k + 1
            yield batch

    def _host_batches(self, plan: _EpochPlan, start: int) -> Iterator[tuple]:
        todo = [k for k in range(start, len(plan)) if plan.bounds[k + 1] > plan.bounds[k]]
        reads = iter(self._pipeline([plan.fresh_ids(k) for k in todo])) if todo else iter(())
        if plan.reuse is None:
            yield from reads
            return
        cache = _SampleCache()
        if start:  # a resumed epoch: the cache holds what earlier batches read and did not reuse yet
            held = plan.reuse.cached_before(start)
            if held.size:
                cache.put(held, self._reader[plan.sequence[held]])
        pin = self.device.type == "cuda"
        for k in range(start, len(plan)):
            fresh_range = plan.reuse.fresh(k)
            fresh = next(reads) if len(fresh_range) else None
            batch = cache.take(plan.reuse.reused_in(k), fresh)
            if fresh is not None:
                cache.put(fresh_range, fresh)
            yield _pinned(batch) if pin else batch

    def _pipeline(self, items: list[np.ndarray]) -> DataLoader:
        """The read pipeline over ``items``; its workers persist across epochs (a spawned worker costs
        seconds of imports), and the work list they are fed is set anew for each iteration."""
        self._work.items = items
        if self._dataloader is None:
            workers = self.num_workers
            self._dataloader = DataLoader(
                self._reader, batch_size=None, sampler=self._work, num_workers=workers, collate_fn=_as_is,
                pin_memory=self.device.type == "cuda", prefetch_factor=self.prefetch_factor if workers else None,
                persistent_workers=workers > 0, multiprocessing_context=self.multiprocessing_context,
            )  # fmt: skip
        return self._dataloader

    def close(self) -> None:
        """Stop the worker processes and unmap the index, so the mount can be unmounted (the end of the
        process does the same); the loader cannot be used after."""
        dataloader, self._dataloader = self._dataloader, None
        iterator = getattr(dataloader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.mount.close()

    def __enter__(self) -> BlockLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- resume -------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "seed": self.seed, "rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers,
            "batch_size": self.batch_size, "blocks_in_flight": self.blocks_in_flight, "drop_last": self.drop_last,
            "reuse": self.reuse, "n_entries": self.mount.n_entries,
            "importance": dataclasses.asdict(self.importance) if self.importance else None,
        }  # fmt: skip

    def state_dict(self) -> dict:
        """Where this rank is: the epoch and the batches of it handed out, plus the loss statistics.

        Plain ints, strings and tensors, so ``torch.save``/``torch.load(weights_only=True)`` keep it.
        """
        state: dict = {"version": STATE_VERSION, "epoch": self.epoch, "batches_done": self._position}
        state["config"] = self._config()
        if self._tracker is not None:
            state["losses"] = {k: torch.from_numpy(v) for k, v in self._tracker.state_dict().items()}
            state["planned_epoch"] = self._planned_epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken: the next iteration yields the batches that would have followed."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r}; this blockfs reads {STATE_VERSION}")
        for key, value in self._config().items():
            saved = state["config"].get(key)
            if saved != value:
                raise ValueError(
                    f"cannot resume: the state was saved with {key}={saved!r}, this loader has {key}={value!r}; "
                    "an exact resume needs the same arguments (and the same rank)"
                )
        if self._tracker is not None:
            self._tracker.load_state_dict({k: _to_numpy(v) for k, v in state["losses"].items()})
            self._planned_epoch = int(state["planned_epoch"])
        self.epoch = _check_int("epoch", state["epoch"], 0)
        self._plan = None
        self._position = self._resume_at = _check_int("batches_done", state["batches_done"], 0)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)
