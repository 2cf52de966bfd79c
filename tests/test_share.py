"""blockfs.serve.control.share and BlockCache.share: cached blocks handed to loaders as sealed memory (no FUSE needed)."""

from __future__ import annotations

import gc
import mmap
import os
import random

import numpy as np
import pytest
from polling import wait_until
from treeutil import make_class_tree

import blockfs
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.core.index import KIND_FILE
from blockfs.loader.shared_blocks import SharedBlocks
from blockfs.serve.cache.block_cache import BlockCache, NotShared
from blockfs.serve.control.share import ShareServer


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")
    make_class_tree(root / "src", files=120, seed=3, sizes=(500, 3000))
    blockfs.pack(root / "src", root / "p", block_size=32 << 10, fsync=False)
    return root / "p"


def block_data(ds: PackedDataset, block: int) -> bytes:
    head = ds.store.header(block)
    with open(ds.store.block_paths[block], "rb") as f:
        f.seek(head.data_start)
        return f.read(head.data_size)


def memfds() -> int:
    """This process's open memfds (a cached block's memory each), once caches no longer referenced (an
    earlier test's) have been collected: their memory is not this test's."""
    gc.collect()
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:blockfs-block-")
        except OSError:
            pass  # the listing's own descriptor, closed already
    return count


@pytest.fixture
def serving(packed):
    """A dataset, its cache (everything fits) and a share server over it; all closed after the test."""
    ds = PackedDataset(packed)
    cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
    server = ShareServer(cache.share, ds.n_blocks)
    yield ds, cache, server
    server.close()
    cache.close()
    ds.close()


def test_a_loader_gets_each_block_byte_for_byte(serving):
    ds, cache, server = serving
    client = SharedBlocks(server.address)
    try:
        assert ds.n_blocks > 3
        for block in range(ds.n_blocks):
            view = client.get(block)
            assert view is not None and view.readonly
            assert bytes(view) == block_data(ds, block)
        assert client.get(0) is client.get(0)  # kept mapped: asked once
        assert cache.stats()["counters"]["blocks_shared"] == ds.n_blocks
        assert cache.stats()["counters"]["block_loads"] == ds.n_blocks  # loaded on request, each once
    finally:
        client.close()


def test_shared_memory_cannot_be_written_resized_or_resealed(serving):
    _ds, cache, _server = serving
    fd = cache.share(1)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 0, prot=mmap.PROT_READ | mmap.PROT_WRITE)  # a writable shared map
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1)  # shrinking would make the mount's own map fault
        with pytest.raises(PermissionError):
            import fcntl

            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # sealed for good
    finally:
        os.close(fd)


def test_refusals_say_why_and_the_loader_falls_back(packed):
    with PackedDataset(packed) as ds:
        sizes = [ds.store.header(b).data_size for b in range(ds.n_blocks)]
        cache = BlockCache(ds.store, sizes[0], "cache-once", lock_memory=False)  # room for one block
        server = ShareServer(cache.share, ds.n_blocks)
        client = SharedBlocks(server.address)
        try:
            assert client.get(0) is not None
            assert client.get(1) is None
            assert "budget is full" in client.refused[1]
            assert client.get(ds.n_blocks) is None  # out of range: refused, the connection stays up
            assert "out of range" in client.refused[ds.n_blocks]
            assert client.get(0) is not None and client.failed is None
        finally:
            client.close()
            server.close()
            cache.close()
        for policy in ("lru", "fifo", "none"):  # a map would keep evicted pages alive: no sharing
            cache = BlockCache(ds.store, 1 << 30, policy, lock_memory=False)
            assert not cache.shares
            with pytest.raises(NotShared, match=policy):
                cache.share(0)
            cache.close()


def test_a_damaged_block_is_not_shared(packed, tmp_path):
    import shutil

    dest = tmp_path / "p"
    shutil.copytree(packed, dest)
    with PackedDataset(dest) as ds:
        head = ds.store.header(2)
        path = ds.store.block_paths[2]
    with open(path, "r+b") as f:  # flip one data byte: the header still reads, the data CRC fails
        f.seek(head.data_start + 10)
        byte = f.read(1)
        f.seek(head.data_start + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with PackedDataset(dest) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        try:
            with pytest.raises(NotShared, match="checksum"):
                cache.share(2)
            with pytest.raises(NotShared, match="damaged"):
                cache.share(2)  # known bad: not read again
            os.close(cache.share(3))  # the others are shared
        finally:
            cache.close()


def test_descriptors_are_given_back(packed):
    before = memfds()
    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        for block in range(ds.n_blocks):
            os.close(cache.share(block))
        # Per cached block: the one kept to share and the one Python's mmap keeps; none per share.
        assert memfds() == before + 2 * ds.n_blocks
        cache.close()
    assert memfds() == before


def test_a_forked_child_asks_on_its_own_connection(serving):
    ds, _cache, server = serving
    client = SharedBlocks(server.address)
    assert client.get(0) is not None
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = bytes(client.get(4) or b"") == block_data(ds, 4) and client.failed is None
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(client.get(5)) == block_data(ds, 5)  # the parent's connection still answers
    client.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_is_not_answered(serving):
    _ds, _cache, server = serving
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        os.setuid(65534)
        client = SharedBlocks(server.address)
        os._exit(0 if client.get(0) is None and client.failed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_mount_gone_away_turns_sharing_off(packed):
    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        server = ShareServer(cache.share, ds.n_blocks)
        client = SharedBlocks(server.address)
        assert client.get(0) is not None
        server.close()
        assert client.get(1) is None
        assert "failed" in client.failed
        assert client.get(0) is None  # maps dropped with the connection: everything through the mount
        cache.close()


def test_the_fast_crc_is_zlibs_crc():
    import zlib

    data = random.Random(0).randbytes(1 << 20)
    for piece in (b"", data[:1], data[:1000], data):
        assert fmt.crc32(piece) == zlib.crc32(piece)
        assert fmt.crc32(piece, 12345) == zlib.crc32(piece, 12345)


def test_out_of_descriptors_blocks_are_cached_unshared(packed, monkeypatch):
    import resource

    import blockfs.serve.cache.block_memory

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(
        blockfs.serve.cache.block_memory, "FDS_KEPT_FREE", soft - blockfs.serve.cache.block_memory.FDS_PER_MEMFD
    )  # room for one
    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        ds = ds.reading_through(cache)
        try:
            os.close(cache.share(0))
            with pytest.raises(NotShared, match="cannot be shared"):
                cache.share(1)
            a = ds.index.arrays
            entry = int(np.flatnonzero((a["block"] == 1) & (a["kind"] == KIND_FILE) & (a["size"] > 0))[0])
            data = ds.read_entry(entry)
            head = ds.store.header(1)
            slot = int(ds.index.arrays["slot"][entry])
            start = int(head.offsets[slot])
            assert data == block_data(ds, 1)[start : start + int(head.sizes[slot])]  # still served from memory
            assert cache.stats()["counters"]["block_loads"] == 2
        finally:
            cache.close()


# --- a hostile or careless neighbour ------------------------------------------------------------------
def test_many_loaders_are_answered_by_a_fixed_number_of_threads(serving):
    import threading

    from blockfs.serve.control.share import ANSWER_THREADS

    ds, _cache, server = serving
    before = threading.active_count()
    clients = [SharedBlocks(server.address) for _ in range(300)]
    try:
        for k, client in enumerate(clients):  # each its own connection, all open at once
            assert bytes(client.get(k % ds.n_blocks)) == block_data(ds, k % ds.n_blocks)
        assert server.open_connections() == len(clients)
        assert threading.active_count() <= before + ANSWER_THREADS  # the pool, not a thread per loader
    finally:
        for client in clients:
            client.close()


def test_connections_past_the_cap_close_the_longest_idle(packed):
    import socket

    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        server = ShareServer(cache.share, ds.n_blocks, max_connections=8)
        idle = []
        try:
            for _ in range(12):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(server.address)
                idle.append(s)
            wait_until(lambda: server.open_connections() == 8, "the mount to keep 8 connections open")
            idle[0].settimeout(10)
            assert idle[0].recv(16) == b""  # the first was closed by the mount
            client = SharedBlocks(server.address)  # a loader that asks is still answered
            assert bytes(client.get(1)) == block_data(ds, 1)
            client.close()
        finally:
            for s in idle:
                s.close()
            server.close()
            cache.close()


def test_a_slow_load_for_one_loader_does_not_hold_another(packed):
    import threading

    release, loading = threading.Event(), threading.Event()
    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)

        def share(block: int) -> int:
            if block == 0:
                loading.set()
                assert release.wait(30)  # a load that takes as long as the test needs
            return cache.share(block)

        server = ShareServer(share, ds.n_blocks)
        slow, fast = SharedBlocks(server.address), SharedBlocks(server.address)
        waiting = threading.Thread(target=slow.get, args=(0,))
        try:
            waiting.start()
            assert loading.wait(10)
            assert bytes(fast.get(2)) == block_data(ds, 2)  # answered while block 0 still loads
            assert waiting.is_alive()
        finally:
            release.set()
            waiting.join()
            slow.close()
            fast.close()
            server.close()
            cache.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_refused_users_are_logged_a_bounded_number_of_times(serving, caplog):
    import logging
    import socket

    _ds, _cache, server = serving
    n = 1000
    with caplog.at_level(logging.WARNING):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            status = 1
            try:
                os.setuid(65534)
                for _ in range(n):
                    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                        s.connect(server.address)
                status = 0
            finally:
                os._exit(status)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        wait_until(lambda: server.refusals.refused >= n, f"{n} refusals")
        assert server.refusals.refused == n
    lines = [r for r in caplog.records if "block share refused" in r.getMessage()]
    assert 1 <= len(lines) <= 2


def test_a_loader_closed_for_being_idle_asks_again(packed):
    import socket

    with PackedDataset(packed) as ds:
        cache = BlockCache(ds.store, 1 << 30, "cache-once", lock_memory=False)
        server = ShareServer(cache.share, ds.n_blocks, max_connections=2)
        client = SharedBlocks(server.address)
        others = []
        try:
            assert client.get(0) is not None

            def closed_by_the_mount() -> bool:
                try:
                    return client._conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    return False

            # New connections push out the one idle longest: the client's, once its answer is complete
            # (a connection waiting on its answer is never the one closed).
            def one_more_then_closed() -> bool:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(server.address)
                others.append(s)
                return closed_by_the_mount()

            wait_until(one_more_then_closed, "the mount to close the idle client")
            assert bytes(client.get(3)) == block_data(ds, 3) and client.failed is None
        finally:
            for s in others:
                s.close()
            client.close()
            server.close()
            cache.close()
