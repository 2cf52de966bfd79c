"""blockfs.serve.cache.block_memory: cached bytes live in anonymous memory or sealed memfds, never in a map of a block file."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

import numpy as np
import pytest
from capability import require

import blockfs
import blockfs.serve.cache.block_memory as memory
from blockfs.core.dataset import PackedDataset
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.cache.block_memory import BlockMemory, Memfds, MemoryLock


def backing_of(buf: mmap.mmap) -> str:
    """What backs the map ``buf`` starts in, from /proc/self/maps: a path, or "" for private anonymous
    memory (shared anonymous memory shows as ``/dev/zero (deleted)``, a memfd as ``/memfd:NAME (deleted)``)."""
    address = np.frombuffer(buf, np.uint8).ctypes.data
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise LookupError(f"address 0x{address:x} is in no mapping")


def is_anonymous(backing: str) -> bool:
    return backing in ("", "/dev/zero (deleted)") or backing.startswith("/memfd:blockfs-block-")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    for i in range(60):
        (root / "src" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / "src" / f"c{i % 3}" / f"f{i}.bin").write_bytes(os.urandom(1000 + 37 * i))
    blockfs.pack(root / "src", root / "p", block_size=16 << 10, fsync=False)
    return root / "p"


@pytest.mark.parametrize("share", [True, False])
def test_cached_memory_is_anonymous(packed, share):
    """A file-backed map of a block file would pass a type check; /proc/self/maps tells them apart."""
    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, lock_memory=False, share=share)
        ds = ds.reading_through(cache)
        try:
            ds.read(ds.files_in_block(0)[0])
            block = cache._blocks[0]
            assert isinstance(block.buf, mmap.mmap) and np.frombuffer(block.buf, np.uint8).size == block.nbytes
            backing = backing_of(block.buf)
            assert is_anonymous(backing) and ds.store.block_paths[0] not in backing, backing
            assert backing.startswith("/memfd:") == share  # shared blocks are memfds, the rest plain anonymous
        finally:
            cache.close()


def test_the_backing_check_sees_a_file_backed_map(packed):
    """The check above must be able to fail: a map of the block file itself is not anonymous."""
    path = os.path.join(packed, "blocks", "00000000.blk")
    with open(path, "rb") as f:
        file_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        backing = backing_of(file_map)
        assert backing == os.path.realpath(path) and not is_anonymous(backing)
    finally:
        file_map.close()


@pytest.mark.parametrize("memfds", [True, False])
def test_block_memory_is_a_memfd_or_an_anonymous_map(memfds):
    mem = BlockMemory(lock=False, memfds=memfds)
    buf, memfd = mem.allocate(7, 3 * mmap.PAGESIZE)
    try:
        assert len(buf) == 3 * mmap.PAGESIZE and (memfd is not None) == memfds
        assert backing_of(buf) == ("/memfd:blockfs-block-7 (deleted)" if memfds else "/dev/zero (deleted)")
        buf[:5] = b"hello"
        sealed = mem.seal(memfd)
        assert (sealed is not None) == memfds
    finally:
        mem.release(memfd)
        buf.close()


def test_a_sealed_memfd_cannot_be_written_or_resized():
    mem = BlockMemory(lock=False, memfds=True)
    buf, memfd = mem.allocate(1, mmap.PAGESIZE)
    buf[:4] = b"data"
    fd = mem.seal(memfd)
    assert fd is not None
    try:
        with pytest.raises(OSError) as raised:
            mmap.mmap(fd, mmap.PAGESIZE)  # a new writable map
        assert raised.value.errno == errno.EPERM
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        assert os.pread(fd, 4, 0) == b"data"
    finally:
        mem.release(fd)
        buf.close()


def test_memfds_stop_when_descriptors_run_short(monkeypatch):
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(memory, "FDS_KEPT_FREE", soft - memory.FDS_PER_MEMFD)  # room for one
    fds = Memfds(True)
    first = fds.create(0, 4096)
    assert first is not None and fds.create(1, 4096) is None
    fds.close(first)  # given back: room for one again
    again = fds.create(2, 4096)
    assert again is not None
    fds.close(again)
    assert Memfds(False).create(3, 4096) is None


def test_memory_lock_warns_once_and_says_why(caplog):
    lock = MemoryLock(True)

    def refuse(address, length):
        ctypes.set_errno(errno.ENOMEM)
        return -1

    lock._mlock = refuse
    maps = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="blockfs.serve.cache.block_memory"):
        assert not any(lock.lock(m) for m in maps)
    assert len([r for r in caplog.records if "cannot pin" in r.getMessage()]) == 1
    assert "ENOMEM" in lock.describe() and lock.locked_bytes == 0
    assert MemoryLock(False).describe() == "off" and not MemoryLock(False).lock(maps[0])
    for m in maps:
        m.close()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_locking_a_large_map_faults_in_none_of_it_until_it_is_written():
    """A retained-file arena is as large as the budget (11.5 GiB at 10 M files): locking it must not fault
    it all in before the mount serves; its pages are locked as they are filled (MLOCK_ONFAULT)."""
    size = 256 << 20
    arena = mmap.mmap(-1, size)
    lock = MemoryLock(True)
    before = _rss()
    locked = lock.lock(arena)
    require(locked, f"mlock here ({lock.describe()})")
    assert _rss() - before < size // 4  # not faulted in (plain mlock: the whole 256 MiB)
    arena[: 1 << 20] = b"x" * (1 << 20)  # written: in memory, and locked with it
    assert _rss() - before >= 1 << 20
    arena.close()
