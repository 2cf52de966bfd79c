"""The loader's client of a live blockfs mount: the index, labels, paths, reads, stats and prefetch hints -- no torch.

**Finding the data.** The mount root carries the extended attribute ``user.blockfs.control``, the name of a
hidden control directory at the root; in it ``index.bfi`` is the dataset's index (block layout, labels,
sizes, paths), ``metadata.json`` its metadata and ``stats.json`` the mount's live statistics. Files are read
through the mount in block order, so the mount reads each block from storage once and serves the rest of
its files from memory. Labels come from the index, never from paths.

**Reading a file.** Where the mount shares its cached blocks (the control directory's
``user.blockfs.share`` attribute; :mod:`blockfs.loader.shared_blocks`), the loader maps each block it
reads once, read-only, from the mount's own verified memory, and copies files out of it: no FUSE round trip per file. A block the
mount does not share (its budget is full, its policy evicts, it is damaged) is read through ``blocks/``
(the block files as stored, served by the mount from its cache): a file is one ``pread`` of its block at
the offset the block's header gives, with no path lookup, open or close per file. The mount verifies
what it serves exactly as for a read by path; the loader also checks each block header's CRC. A read of
a damaged block's file fails with ``EIO`` alone: the loader retries it by its path, which the mount
verifies file by file. Without ``blocks/`` (another mount version), each file is opened by path.

**Prefetch announcements.** At the start of every epoch the loader tells the mount which blocks its rank
will read, first needed first (with ``importance=``, only the blocks of the selected samples), so the mount
can fetch them ahead of the reader. The mount is read-only (and in its ``enosys`` open mode the kernel
sends no ``open`` at all), so the channel is not a file in it: when the control directory has the extended
attribute ``user.blockfs.prefetch``, its value is the address of a Unix stream socket the mount listens on
(in Linux's abstract namespace: it starts with a NUL byte; pass it to ``connect`` as it is); the loader
connects, sends the block ids (:func:`blockfs.protocol.encode_announcement`) and closes the connection.
It is a hint: the mount may cut it short or ignore it, and the loader does not wait for an answer.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import shutil
import socket
import tempfile
import warnings

import numpy as np

from .. import client, protocol
from ..core import format as fmt
from ..core.checked_indexes import CheckedIndexes
from ..core.digest import check_name, name_of
from ..core.index import KIND_FILE, PackedIndex
from ..core.metadata import check_metadata
from ..errors import FormatError, NotADatasetError
from ..protocol import BLOCKS_DIR, INDEX_FILE, METADATA_FILE, PREFETCH_XATTR, SHARE_XATTR, STATS_FILE
from .order import BlockLayout
from .shared_blocks import SharedBlocks

__all__ = ["BlockfsMount"]

OPEN_BLOCKS = 32  # block files kept open per process (a worker reads a few blocks at a time)
ANNOUNCE_TIMEOUT_S = 5.0


class BlockfsMount:
    """What the loader needs from a mounted dataset: the layout, labels, paths, reads, stats and hints.

    Pickles as its root path only (a worker process reopens the index), so it can go to spawned workers.
    """

    def __init__(self, root: str | os.PathLike, share: bool = True, expect: str | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.control = _control_dir(self.root)
        self.share = share
        self._open()
        check_name(f"the dataset mounted at {self.root}", self.digest, expect)

    def _open(self) -> None:
        control = os.path.join(self.root, self.control)
        try:
            with open(os.path.join(control, METADATA_FILE), "rb") as f:
                raw = f.read()
            self.metadata: dict = json.loads(raw)
        except FileNotFoundError:
            raw, self.metadata = b"", {}
        except (OSError, ValueError) as e:
            raise FormatError(f"{control}/{METADATA_FILE}: unreadable metadata: {e}") from e
        # The mount's dataset, by name: the metadata the mount opened (and checked every byte against).
        self.digest = name_of(raw) if raw else None
        if self.metadata:  # as the mount checked it; its index's digest is the one the index is opened against
            check_metadata(self.metadata, f"{control}/{METADATA_FILE}")
        digest = self.metadata["index"].get("blake3") if self.metadata else None
        self.index = _open_index(os.path.join(control, INDEX_FILE), digest)
        a = self.index.arrays
        self._root_bytes = os.fsencode(self.root)
        # Copies, not views of the map, so that close() can unmap the index at once.
        self.sizes: np.ndarray = a["size"].astype(np.int64)
        self.labels: np.ndarray = a["label"].astype(np.int64)
        self.block_of: np.ndarray = a["block"].astype(np.int64)
        self.slot_of: np.ndarray = a["slot"].astype(np.int64)
        self._block_counts: np.ndarray = a["block_counts"].astype(np.int64)
        self.block_bytes: np.ndarray = a["block_sizes"].astype(np.int64)  # balances partition="node" by bytes
        self.layout = BlockLayout(a["block_offsets"], a["block_files"])
        blocks_dir = os.path.join(control, BLOCKS_DIR)
        self._blocks_dir = os.fsencode(blocks_dir) if os.path.isdir(blocks_dir) else None
        self._block_fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._heads: dict[int, fmt.BlockHeader] = {}
        self.shared: SharedBlocks | None = None
        if self.share and self._blocks_dir is not None:
            try:
                self.shared = SharedBlocks(os.getxattr(control, SHARE_XATTR))
            except OSError:
                pass  # a mount that shares no blocks (--no-share, policy lru/fifo/none, an older version)

    def __getstate__(self) -> dict:
        return {"root": self.root, "control": self.control, "share": self.share}  # a worker checks nothing again

    def __setstate__(self, state: dict) -> None:
        self.root, self.control, self.share = state["root"], state["control"], state["share"]
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
        data = bytearray(int(self.sizes[entry]))
        self.read_into(entry, memoryview(data))
        return bytes(data)

    def read_into(self, entry: int, buffer: memoryview) -> None:
        """Read the file, through the mount, into ``buffer`` (exactly its size)."""
        path = self._root_bytes + b"/" + self.index.path(entry)
        if self._blocks_dir is not None and len(buffer):
            block = int(self.block_of[entry])
            try:
                fd, head = self._block(block)
                start = int(head.offsets[self.slot_of[entry]])
                shared = self.shared.get(block) if self.shared is not None else None
                if shared is not None:  # the mount's verified copy, mapped: no FUSE round trip
                    buffer[:] = shared[start : start + len(buffer)]
                else:
                    _read_exactly(fd, buffer, head.data_start + start, path)
                return
            except OSError as e:  # name the file, not the block file the bytes came through
                if e.errno != errno.EIO:
                    raise OSError(e.errno, f"{e.strerror} (block {block})", os.fsdecode(path)) from None
                # A damaged block: the kernel reads its block file a page-cache window at a time, so a
                # damaged file fails its neighbours' reads too.  By its path, the mount checks this file alone.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _read_exactly(fd, buffer, None, path)
            finally:
                os.close(fd)
        except OSError as e:
            if self._blocks_dir is None:
                raise
            raise OSError(e.errno, f"{e.strerror} (block {int(self.block_of[entry])})", os.fsdecode(path)) from None

    def _block(self, block: int) -> tuple[int, fmt.BlockHeader]:
        """An open descriptor of ``blocks/NNNNNNNN`` and the block's checked header."""
        fd = self._block_fds.get(block)
        if fd is None:
            assert self._blocks_dir is not None
            name = os.fsencode(protocol.block_file_name(block))
            fd = os.open(self._blocks_dir + b"/" + name, os.O_RDONLY | os.O_CLOEXEC)
            self._block_fds[block] = fd
            if len(self._block_fds) > OPEN_BLOCKS:
                os.close(self._block_fds.popitem(last=False)[1])
        else:
            self._block_fds.move_to_end(block)
        head = self._heads.get(block)
        if head is None:
            where = f"block {block} through the mount at {self.root}"
            head = self._heads[block] = fmt.read_header(lambda size, offset: os.pread(fd, size, offset), where)[0]
            if head.block_id != block or head.count != int(self._block_counts[block]):
                raise FormatError(
                    f"{where}: its header says block {head.block_id} with {head.count} files, the index block "
                    f"{block} with {int(self._block_counts[block])}: is the mount serving another dataset?"
                )
        return fd, head

    def close(self) -> None:
        """Close the block files and unmap the index: while either is open, the mount cannot be unmounted."""
        while self._block_fds:
            os.close(self._block_fds.popitem()[1])
        if self.shared is not None:
            self.shared.close()
        self._heads.clear()
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
        payload = protocol.encode_announcement(np.asarray(blocks).tolist())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
                channel.settimeout(ANNOUNCE_TIMEOUT_S)
                channel.connect(address)
                channel.sendall(payload)
        except OSError as e:
            warnings.warn(
                f"cannot announce the epoch's blocks to the mount at {self.root} ({address!r}): {e}",
                RuntimeWarning,
                stacklevel=4,  # announce <- BlockLoader._epoch_plan <- len()/iter() <- the caller
            )
            return False
        return True


def _read_exactly(fd: int, buffer: memoryview, offset: int | None, path: bytes) -> None:
    """Fill ``buffer`` from ``fd`` (at ``offset``, or from its position); a short file is an error."""
    size, done = len(buffer), 0
    while done < size:  # a short read is legal; the index says how much there is
        view = [buffer[done:]]
        n = os.readv(fd, view) if offset is None else os.preadv(fd, view, offset + done)
        if n == 0:
            raise FormatError(
                f"{os.fsdecode(path)}: {done} bytes, but the index says {size}: is the mount "
                "serving another dataset than its control directory describes?"
            )
        done += n


def _control_dir(root: str) -> str:
    """The control directory's name (checked by :func:`blockfs.client.control_dir`), with its index there."""
    name = os.path.basename(client.control_dir(root))
    if not os.path.isfile(os.path.join(root, name, INDEX_FILE)):
        raise NotADatasetError(f"{root!r} is not a blockfs mount: its control directory {name!r} has no {INDEX_FILE}")
    return name


def _open_index(path: str, digest: str | None = None) -> PackedIndex:
    """The mount's index, every check run, or skipped where an index of ``digest`` (checked against these
    bytes first) passed them on this machine before (:mod:`blockfs.core.checked_indexes`: the mount's
    record, kept by the mount once its checks passed, or by an earlier open here): at ten million files
    the checks are ~3 s of CPU in each process that opens the index, a worker that reopens it included."""
    record = CheckedIndexes.default() if digest is not None else None
    try:
        return PackedIndex(path, digest=digest, checked=record)
    except OSError:
        # The mount may not support mmap (direct I/O): map a private copy instead.
        fd, copy = tempfile.mkstemp(prefix="blockfs-index-", suffix=".bfi")
        try:
            with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            return PackedIndex(copy, digest=digest, checked=record)
        finally:
            os.unlink(copy)  # the map keeps the bytes
