"""A tar archive (plain, gzip, bzip2 or xz) as a pack source: its member tree, as ``tar x`` would write it.

A plain tar is read in place: listing reads the headers only (``tarfile`` seeks over the data) and each
file is later read with ``os.pread`` at its data offset, so writer threads need no lock.  A compressed
tar is decompressed once, sequentially, into an anonymous spool file (see :mod:`.spool`) and then read
like a plain one; its headers are listed while it is being decompressed, each as soon as it is spooled.

What ``tar x`` does, this does: leading "/" and "." parts of names dropped, members with ".." skipped,
a later member of the same path replaces the earlier, hard links share the bytes of the member they
name, pax headers give nanosecond mtimes, unknown member types are regular files, device files and
FIFOs are skipped.  An archive that ends in a header that is not one, or whose last member is cut
short, is damaged: an error naming the byte offset, or with --skip-damaged the rest is packed (reading
resumes at the next valid ustar header) and the damage listed.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from ...core.index import KIND_DIR, KIND_FILE, KIND_SYMLINK
from ...errors import SourceError
from ..sources import SourceEntry
from .base import DamageLog, ListedOnce, TreeBuilder, WindowReader, clean_member_name, pread_into
from .spool import Spool
from .tarheaders import fast_members

log = logging.getLogger(__name__)

BLOCK = tarfile.BLOCKSIZE
LIST_BUFFER = 4 << 20  # listing reads this much at a time: sequential I/O, small members come along
UNKNOWN_SIZE = 1 << 62  # the fast parser reads until its reads come back short (the archive's end)
ENCODING = ("utf-8", "surrogateescape")  # names come back as the exact bytes stored (os.fsencode)


@dataclass(eq=False)
class TarEntry(SourceEntry):
    """A member's entry, with where its bytes are."""

    shard: int = 0  # which shard of a WebDataset holds it (no reference back: no cycle to collect)
    data_offset: int = 0
    sparse: tarfile.TarInfo | None = None  # GNU sparse members are read through tarfile


class TarSource(ListedOnce):
    """One tar archive.  ``compression`` is None (plain), "gzip", "bzip2" or "xz"."""

    forkable = True  # read_into only preads descriptors opened before packing starts

    def __init__(
        self,
        path: str | os.PathLike,
        compression: str | None = None,
        *,
        skip_damaged: bool = False,
        spool_dir: str | None = None,
        shard: int = 0,
    ) -> None:
        self.path = os.fspath(path)
        self.description = self.path
        self.compression = compression
        self._spool_dir = spool_dir
        self._shard = shard
        self._damage = DamageLog(self.path, skip_damaged)
        self._skipped: list[bytes] = []
        self._fd = -1
        self._sparse_lock = threading.Lock()
        self._sparse_tar: tarfile.TarFile | None = None
        self._sparse_pid = 0  # the process that opened _sparse_tar

    # --- the Source interface --------------------------------------------------------------------
    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        assert isinstance(entry, TarEntry)
        if entry.sparse is not None:
            return self._read_sparse(entry.sparse, buf, offset)
        return pread_into(self._fd, buf, entry.data_offset + offset)

    def skipped(self) -> list[bytes]:
        return list(self._skipped)

    def damaged(self) -> list[str]:
        return list(self._damage.items)

    def write_metadata(self, dest: str, fsync: bool) -> dict:
        return {"kind": "tar", "compression": self.compression or "none", "skipped_damaged": self.damaged()}

    def close(self) -> None:
        sparse = getattr(self, "_sparse_tar", None)  # None also when __init__ did not get that far
        if sparse is not None:
            sparse.close()
            self._sparse_tar = None
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TarSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # --- listing ---------------------------------------------------------------------------------
    def _load(self) -> list[SourceEntry]:
        if self.compression is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise SourceError(f"cannot read source {self.path!r}: {e.strerror}") from e
            return self._list(_Extent(os.fstat(self._fd).st_size))
        where = self._spool_dir or tempfile.gettempdir()
        log.info("decompressing %s once into an unnamed spool file in %s", self.path, where)
        spool = Spool(self.path, self.compression, where, self._damage)
        self._fd = spool.fd
        try:
            entries = self._list(spool)
            spool.finish()  # the stream's own damage (after the last member) is reported
            return entries
        except BaseException:
            spool.cancel()  # before anyone closes the descriptor it writes to
            raise

    def _list(self, extent: _Extent | Spool) -> list[SourceEntry]:
        tree = TreeBuilder(self.path)
        n_links = 0
        with open(self._fd, "rb", buffering=LIST_BUFFER, closefd=False) as f:
            for m in _members(f, extent, self._damage):
                name = clean_member_name(os.fsencode(m.name))
                if name is None:
                    self._skipped.append(os.fsencode(m.name))
                    continue
                if m.islnk():
                    n_links += 1
                    entry = self._hard_link(tree, m, name, n_links)
                else:
                    entry = self._entry(m, name)
                if entry is not None:
                    tree.add(entry)
        return tree.entries()

    def _entry(self, m: tarfile.TarInfo, name: bytes) -> SourceEntry | None:
        perm, mtime_ns = m.mode & 0o7777, mtime_ns_of(m)
        if m.isdir():
            return TarEntry(name, KIND_DIR, stat.S_IFDIR | perm, mtime_ns, shard=self._shard)
        if m.issym():
            return TarEntry(
                name,
                KIND_SYMLINK,
                stat.S_IFLNK | perm,
                mtime_ns,
                link_target=os.fsencode(m.linkname),
                shard=self._shard,
            )
        if m.isreg() or m.type not in tarfile.SUPPORTED_TYPES:  # GNU tar extracts unknown types as files
            return TarEntry(
                name,
                KIND_FILE,
                stat.S_IFREG | perm,
                mtime_ns,
                m.size,
                shard=self._shard,
                data_offset=m.offset_data,
                sparse=m if m.issparse() else None,
            )
        self._skipped.append(name)  # character and block devices, FIFOs
        return None

    def _hard_link(self, tree: TreeBuilder, m: tarfile.TarInfo, name: bytes, n: int) -> SourceEntry | None:
        target_name = clean_member_name(os.fsencode(m.linkname))
        target = tree.get(target_name) if target_name is not None else None
        if target is None or target.kind == KIND_DIR:
            self._damage.report(
                m.offset,
                f"hard link {os.fsdecode(name)!r} names {m.linkname!r}, which is not an earlier file of the archive",
            )
            return None
        if target.kind == KIND_SYMLINK:  # a hard link to a symlink: keep it as a symlink of its own
            return TarEntry(
                name, KIND_SYMLINK, target.mode, target.mtime_ns, link_target=target.link_target, shard=self._shard
            )
        assert isinstance(target, TarEntry)
        if target.hardlink_key is None:
            target.hardlink_key = (self._shard, n)
        # One inode: the link shows the target's mode and mtime, as after `tar x`.
        return TarEntry(
            name,
            KIND_FILE,
            target.mode,
            target.mtime_ns,
            target.size,
            hardlink_key=target.hardlink_key,
            shard=self._shard,
            data_offset=target.data_offset,
            sparse=target.sparse,
        )

    # --- reading ---------------------------------------------------------------------------------
    def _read_sparse(self, member: tarfile.TarInfo, buf: memoryview, offset: int) -> int:
        with self._sparse_lock:  # tarfile objects are not thread-safe; sparse members are rare
            if self._sparse_tar is None or self._sparse_pid != os.getpid():
                # Its own open file (a fresh offset): forked packers must not move each other's offset.
                own = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
                self._sparse_pid = os.getpid()
                self._sparse_tar = tarfile.open(
                    fileobj=open(own, "rb"), mode="r:", encoding=ENCODING[0], errors=ENCODING[1]
                )
            f = self._sparse_tar.extractfile(member)
            assert f is not None
            f.seek(offset)
            data = f.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def mtime_ns_of(m: tarfile.TarInfo) -> int:
    """The member's mtime in ns: exact from a pax header (tarfile's float would round it), else seconds."""
    text = m.pax_headers.get("mtime")
    if text is not None:
        try:
            return int(Decimal(text) * 1_000_000_000)
        except (InvalidOperation, ValueError):
            pass
    return int(m.mtime) * 1_000_000_000


class _Window:
    """A file seen from ``base`` on, so ``tarfile`` can start over at any header after damage."""

    def __init__(self, f, base: int) -> None:
        self._f, self._base = f, base

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos + self._base if whence == 0 else pos, whence) - self._base

    def tell(self) -> int:
        return self._f.tell() - self._base


class _Extent:
    """A file's size, with :class:`Spool`'s interface for a file that is already whole."""

    def __init__(self, size: int) -> None:
        self._size = size

    def available(self, end: int) -> int:
        return min(end, self._size)

    def finish(self) -> int:
        return self._size


def _members(f, extent: _Extent | Spool, damage: DamageLog) -> Iterator[tarfile.TarInfo]:
    """Every member header, offsets absolute; damage is reported and, when skipping, stepped over.

    The common headers are parsed by :func:`.tarheaders.fast_members`, each as soon as ``extent`` has its
    bytes (a spool still being written); ``tarfile`` takes over at the first one it leaves alone, once
    the whole archive is there, and goes on to the end.
    """
    fd = f.fileno()
    fast = fast_members(WindowReader(fd, LIST_BUFFER, extent.available).read, UNKNOWN_SIZE, *ENCODING)
    while True:
        try:
            m = next(fast)
        except StopIteration as done:
            base = done.value
            break
        end = m.offset_data + _data_size(m)
        if _cut_short(m, extent.available(end), damage):
            return
        yield m
    if base is None:
        return
    size = extent.finish()
    if base > size:  # the last member's data is whole, the padding after it is cut off
        damage.report(size, "the archive ends inside the padding after its last member: it is truncated")
        return
    while base < size:
        f.seek(base)
        try:
            # Reading needs only read, seek and tell: typeshed's file protocol also asks write and close.
            window = _Window(f, base)
            tar = tarfile.open(fileobj=window, mode="r:", encoding=ENCODING[0], errors=ENCODING[1])  # type: ignore[call-overload]
        except tarfile.ReadError as e:
            base = damage.report(
                base, f"not a tar header ({e})", functools.partial(_next_header, fd, base + BLOCK, size)
            )
            continue
        while True:
            at = base + tar.offset
            if at > size:  # the last member's data is whole, the padding after it is cut off
                damage.report(size, "the archive ends inside the padding after its last member: it is truncated")
                return
            try:
                m = tar.next()
            except tarfile.ReadError as e:
                base = damage.report(at, f"bad tar header ({e})", functools.partial(_next_header, fd, at + BLOCK, size))
                break
            if m is None:
                end = base + tar.offset
                problem = _end_problem(fd, end, size)
                if problem is None:
                    return
                base = damage.report(end, problem, functools.partial(_next_header, fd, end + BLOCK, size))
                break
            tar.members.clear()  # tarfile keeps every member; we keep our own, smaller entries
            m.offset += base
            m.offset_data += base
            if _cut_short(m, size, damage):
                return
            yield m


def _cut_short(m: tarfile.TarInfo, size: int, damage: DamageLog) -> bool:
    """Report (and say) that the member's data runs past the end of the archive."""
    if m.issparse() or m.offset_data + _data_size(m) <= size:
        return False
    damage.report(
        m.offset,
        f"member {m.name!r} needs {m.size} bytes of data from byte offset "
        f"{m.offset_data}, past the end of the archive ({size} bytes): the archive is truncated",
    )
    return True


def _data_size(m: tarfile.TarInfo) -> int:
    return m.size if m.isreg() or m.type not in tarfile.SUPPORTED_TYPES else 0


def _end_problem(fd: int, end: int, size: int) -> str | None:
    """None if the archive ends cleanly at ``end`` (end of file, or the zero blocks of an end marker)."""
    if end >= size:
        return None
    block = os.pread(fd, BLOCK, end)
    if not block.strip(b"\0"):
        return None
    if len(block) < BLOCK:
        return f"the archive ends inside a header ({len(block)} of {BLOCK} bytes): it is truncated"
    return "not a tar header (bad checksum): the archive is damaged here"


def _next_header(fd: int, start: int, size: int) -> int:
    """The offset of the first valid ustar header at a block boundary from ``start``, or ``size``."""
    pos = start - start % BLOCK
    while pos < size:
        chunk = os.pread(fd, 1 << 20, pos)
        for i in range(0, len(chunk) - BLOCK + 1, BLOCK):
            if chunk[i + 257 : i + 262] == b"ustar":
                try:
                    tarfile.TarInfo.frombuf(chunk[i : i + BLOCK], *ENCODING)
                except tarfile.HeaderError:
                    continue
                return pos + i
        if len(chunk) < BLOCK:
            break
        pos += len(chunk) - len(chunk) % BLOCK
    return size
