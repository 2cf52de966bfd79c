"""blockfs.serve.fuse.kernel_adapter: the kernel-protocol route — what the kernel is sent, counted by the server.

These tests check mechanisms, not speed: a listed file is never looked up, a file whose block is loaded is
never read through the server (its pages were pushed), files are right whatever the kernel keeps or drops.
Counts are read with the stats xattr (a GETXATTR: it moves neither the lookup nor the read count), from
a mount only this test reads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from capability import has_fuse, require
from mountutil import mounted
from pagecache import resident_pages
from polling import wait_until
from treeutil import make_class_tree

import blockfs
from blockfs import cli, protocol
from blockfs.client import control_dir

pytestmark = pytest.mark.fuse


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    require(has_fuse(), "/dev/fuse")
    root = tmp_path_factory.mktemp("kfs")
    make_class_tree(root / "src", files=300, seed=3, sizes=(1, 40_000))
    blockfs.pack(root / "src", root / "packed", block_size=256 << 10, fsync=False)  # ~20 blocks
    return root / "src", root / "packed"


def stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(control_dir(mnt), protocol.STATS_XATTR))


def requests(mnt: Path) -> dict:
    return stats(mnt)["requests"]


@contextlib.contextmanager
def in_process(dataset: Path, mountpoint: Path) -> Iterator[tuple[Any, Any]]:
    """The kernel route's filesystem for ``dataset``, assembled but not mounted, and the :class:`KernelCalls`
    that send it requests in-process: 64 MiB of cache, nothing prefilled or locked."""
    from kernelcalls import KernelCalls

    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    options = MountOptions(cache_bytes=64 << 20, prefill=False, lock_memory=False)
    with assembled(dataset, mountpoint, options, route="kernel") as fs:
        yield fs, KernelCalls(fs)


def walk(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def same_bytes(mnt: Path, src: Path, names: list[str]) -> None:
    for name in names:
        assert (mnt / name).read_bytes() == (src / name).read_bytes(), name


@pytest.mark.serial  # counts READs the kernel sends again once memory pressure (other tests') drops pages
def test_after_a_listing_with_attributes_no_lookup_and_no_read_reaches_the_server(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", "--listing", "plus", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        names = walk(m.path)  # READDIRPLUS: the kernel learns every node with its attributes
        assert names == walk(src)
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == len(names), "every listed file pushed")
        before = requests(m.path)
        # The kernel may drop pushed pages under memory pressure (another process's, or the machine's own
        # reclaim), and then a read asks the server again, rightly: each file still held is read alone, and
        # must send no READ.
        held = 0
        for name in names:
            if all(resident_pages(m.path / name)):
                reads = requests(m.path).get("read", 0)
                same_bytes(m.path, src, [name])
                assert requests(m.path).get("read", 0) == reads, name
                held += 1
            else:
                same_bytes(m.path, src, [name])
        after = requests(m.path)
        assert held > 0  # pushed: a listing reads no file's data, so only the pushes put pages there
        assert after.get("lookup", 0) == before.get("lookup", 0)
        assert after.get("readdirplus", 0) > 0 and "readdir" not in after
        assert after.get("open", 0) <= 1 and after.get("opendir", 0) <= 1  # ENOSYS once, then never sent


def test_a_default_listing_is_names_only_pushes_nothing_and_each_file_is_looked_up_once(packed, tmp_path):
    """--listing plain, the default (chosen by the whole pass, docs/benchmarks.md): the kernel is sent READDIR,
    never READDIRPLUS, so it links no inode for a listed entry and nothing is pushed for the listing with every
    block in memory; a file read after the listing is looked up once, then read."""
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        before = requests(m.path)
        names = walk(m.path)
        assert names == walk(src)
        listed = requests(m.path)
        assert listed.get("readdir", 0) > before.get("readdir", 0) and "readdirplus" not in listed
        dirs = sum(len(d) for _, d, _ in os.walk(src))
        # os.walk needs no stat (d_type suffices): only the directories it enters are looked up
        assert listed.get("lookup", 0) - before.get("lookup", 0) <= dirs
        same_bytes(m.path, src, names)
        s = stats(m.path)
        pushes = s["page_cache"]
        # Nothing pushed for the listing: only files opened (at their isatty ioctl, pushed before it is answered)
        assert pushes["files_pushed"] == pushes["pushed_at_open"] and s["mount"]["listing"] == "plain"
        assert s["requests"]["lookup"] - listed.get("lookup", 0) >= len(names)


def test_a_file_whose_block_is_not_loaded_is_read_through_the_server(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", "--no-prefill", binding="kernel") as m:
        names = walk(src)
        same_bytes(m.path, src, names)  # looked up by path: no listing, every block loaded on its first miss
        s = stats(m.path)
        assert s["requests"]["read"] > 0 and s["requests"]["lookup"] >= len(names)
        assert s["counters"]["block_loads"] == s["dataset"]["blocks"]


def test_pushes_to_nodes_the_kernel_never_learned_are_skipped_without_error(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        assert stats(m.path)["page_cache"]["files_pushed"] == 0  # no node known: nothing pushed, nothing failed
        name = walk(src)[7]
        assert (m.path / name).read_bytes() == (src / name).read_bytes()
        assert stats(m.path)["page_cache"]["push_errors"] == 0


def test_files_read_right_after_the_kernel_drops_their_pages(packed, tmp_path):
    src, dest = packed
    with mounted(dest, tmp_path / "mnt", "--listing", "plus", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        names = walk(m.path)
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == len(names), "every listed file pushed")
        reads = requests(m.path).get("read", 0)
        for name in names:  # drop every page the push put there
            fd = os.open(m.path / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        same_bytes(m.path, src, names)
        assert requests(m.path).get("read", 0) > reads  # the pages were gone: the server answered again


@pytest.mark.parametrize("policy", ["cache-once", "lru", "none"])
def test_every_policy_serves_every_file_right_on_the_kernel_route(packed, tmp_path, policy):
    src, dest = packed
    size = sum((src / n).stat().st_size for n in walk(src))
    with mounted(
        dest, tmp_path / "mnt", "--policy", policy, "--cache-size", str(size // 3), "--no-retain", binding="kernel"
    ) as m:
        names = walk(m.path)
        assert names == walk(src)
        same_bytes(m.path, src, names[::-1])
        assert stats(m.path)["mount"]["binding"] == "kernel"


def test_the_kernel_route_refuses_an_option_it_cannot_honour_in_one_line(packed, tmp_path, capsys):
    _, dest = packed
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = cli.main(["mount", str(dest), str(mnt), "--fuse", "kernel", "-o", "fsname=ok,uid=0", "--foreground"])
    assert done != 0
    assert not os.path.ismount(mnt)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'uid=0' is not one the kernel route takes" in err, err


def test_the_kernel_route_applies_fsname_subtype_and_noexec_and_ignores_libfuse_settings(packed, tmp_path):
    """Issue 29, 8: an fstab line written for libfuse (``fsname=`` is common) mounts on the kernel route."""
    from blockfs.serve.daemon import mount_entry

    _, dest = packed
    with mounted(
        dest, tmp_path / "mnt", "-o", "fsname=imagenet,subtype=bfs,noexec,kernel_cache,max_threads=4", binding="kernel"
    ) as m:
        assert mount_entry(m.path) == {"fstype": "fuse.bfs", "source": "imagenet"}
        with open("/proc/self/mounts") as f:
            options = next(line.split()[3] for line in f if line.split()[1] == str(m.path)).split(",")
        assert {"ro", "nosuid", "nodev", "noexec"} <= set(options), options
        assert len(walk(m.path)) == 300
        ignored = [line for line in m.log_text().splitlines() if "changes nothing on the kernel route" in line]
    assert len(ignored) == 2 and "'kernel_cache'" in ignored[0] and "'max_threads=4'" in ignored[1], ignored


def test_an_empty_files_check_never_reads_storage_on_a_request_thread(tmp_path):
    """Issue 29, 1, in-process: with no block header in memory, READDIRPLUS gives the empty file without
    attributes (node 0) and its LOOKUP is answered from a data thread; every storage read happens there.
    Once the header is in memory, both answer at once with the entry."""
    import threading

    from kernelcalls import KernelCalls

    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "empty").write_bytes(b"")
    (tmp_path / "src" / "d" / "full").write_bytes(b"0123456789")
    blockfs.pack(tmp_path / "src", tmp_path / "packed", fsync=False)
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with assembled(tmp_path / "packed", tmp_path / "mnt", options, route="kernel") as fs:
        calls = KernelCalls(fs)
        files = fs.view.ds.store._files
        readers: list[str] = []
        for name in ("pread", "read_into", "size"):

            def counted(*args, _real=getattr(files, name)):  # noqa: B008 (bound now: one per name)
                readers.append(threading.current_thread().name)
                return _real(*args)

            setattr(files, name, counted)
        err, d = calls.lookup_path(b"d")
        assert err == 0
        assert [(n, bool(c)) for n, c, _m in calls.listdir(d)[1]] == [(b"empty", False), (b"full", True)]
        assert readers == []  # the listing read nothing
        assert calls.lookup_path(b"d/empty")[0] == 0
        assert readers and all(t.startswith("blockfs-data") for t in readers), readers
        assert [(n, bool(c)) for n, c, _m in calls.listdir(d)[1]] == [(b"empty", True), (b"full", True)]


def test_a_file_the_kernel_will_not_take_keeps_no_other_file_of_its_block_out(tmp_path, caplog):
    """One file's failed push (a struct.error was what a file of 4 GiB got) is counted and said once, in
    one line; every other file of the job is still pushed.  In-process: the push is called as the pusher
    thread calls it, with a stand-in session (no /dev/fuse)."""
    import logging
    import struct

    from kernelcalls import KernelCalls

    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    src = tmp_path / "src"
    src.mkdir()
    names = [f"f{i}.bin" for i in range(6)]
    for i, name in enumerate(names):
        (src / name).write_bytes(bytes([i]) * (1000 + i))
    blockfs.pack(src, tmp_path / "packed", fsync=False)  # one block
    options = MountOptions(cache_bytes=64 << 20, prefill=False, lock_memory=False)
    with (
        caplog.at_level(logging.DEBUG),
        assembled(tmp_path / "packed", tmp_path / "mnt", options, route="kernel") as fs,
    ):
        calls = KernelCalls(fs)
        nodes = [calls.lookup_path(name.encode())[1] for name in names]
        assert calls.read(names[0].encode()) == (src / names[0]).read_bytes()  # loads the block
        stored: list[int] = []

        def store(nodeid: int, data, offset: int = 0) -> bool:
            if nodeid == nodes[1]:
                raise struct.error("'I' format requires 0 <= number <= 4294967295")
            stored.append(nodeid)
            return True

        calls.session.store = store  # type: ignore[method-assign]
        assert fs.pusher.push([n - 1 for n in nodes]) == []
        assert sorted(stored) == sorted(nodes[:1] + nodes[2:])
        assert fs.pusher.counts["push_errors"] == 1 and fs.pusher.counts["files_pushed"] == len(names) - 1
    said = [r for r in caplog.records if "page cache" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(said) == 1 and names[1] in said[0].getMessage() and not said[0].exc_info


def test_a_file_of_several_store_pieces_is_pushed_whole_and_read_with_no_read_sent(tmp_path):
    """The kernel takes a file pushed in pieces (offsets advancing, the last page partial): a file of
    two pieces and a bit is read from the page cache alone, exact."""
    from blockfs.serve.fuse import wire

    require(has_fuse(), "/dev/fuse")
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(2 * wire.STORE_PIECE + 12_345)
    (src / "big.bin").write_bytes(big)
    (src / "small.bin").write_bytes(b"beside it")
    blockfs.pack(src, tmp_path / "packed", fsync=False)
    with mounted(tmp_path / "packed", tmp_path / "mnt", "--listing", "plus", binding="kernel") as m:
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == 1, "prefill to load the block", timeout=60)
        assert sorted(os.listdir(m.path)) == ["big.bin", "small.bin"]  # the kernel learns both nodes
        wait_until(lambda: stats(m.path)["page_cache"]["files_pushed"] == 2, "both files pushed", timeout=60)
        reads = requests(m.path).get("read", 0)
        assert (m.path / "big.bin").read_bytes() == big and (m.path / "small.bin").read_bytes() == b"beside it"
        assert requests(m.path).get("read", 0) == reads and stats(m.path)["page_cache"]["push_errors"] == 0


def test_a_lookup_pushes_nothing_its_read_would_outrun(packed, tmp_path):
    # A file looked up (no listing) is read at once: the READ reaches the server before a push from the pusher
    # thread could land, so the lookup queues none (the block's own load still pushes what the kernel holds).

    src, dest = packed
    names = walk(src)
    with in_process(dest, tmp_path / "mnt") as (fs, calls):
        assert calls.read(names[0].encode()) == (src / names[0]).read_bytes()  # loads the block
        block = fs.view.block_slot(fs.view.lookup(names[0].encode()))[0]
        same_block = [n for n in names[1:] if fs.view.block_slot(fs.view.lookup(n.encode()))[0] == block]
        assert same_block and fs.view.cache.holds(block)
        while not fs.pusher.jobs.empty():  # the block's load queued its push (the pusher thread is not running here)
            fs.pusher.jobs.get()
        for name in same_block:
            assert calls.lookup_path(name.encode())[0] == 0
        assert fs.pusher.jobs.empty()


def test_opening_a_cached_file_again_sends_only_pythons_isatty(packed, tmp_path):
    # Epoch 2 on the kernel route: a file whose pages the kernel holds is opened and read with no request but
    # the TCGETS ioctl that CPython < 3.14's open() sends for isatty().  That one cannot be stopped by the
    # server: the kernel forwards every ioctl of a FUSE file and turns ENOSYS into ENOTTY without remembering
    # it (fs/fuse/ioctl.c, fuse_send_ioctl), so the session answers it before any dispatch.
    import sys

    src, dest = packed
    name = walk(src)[5]
    n = 200
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        path = m.path / name
        assert path.read_bytes() == (src / name).read_bytes()  # looked up, and read (or pushed) once
        before = requests(m.path)
        for _ in range(n):
            fd = os.open(path, os.O_RDONLY)
            try:
                while os.read(fd, 1 << 20):
                    pass
            finally:
                os.close(fd)
        middle = requests(m.path)
        for _ in range(n):
            with open(path, "rb") as f:
                f.read()
        after = requests(m.path)

    def sent(a: dict, b: dict) -> dict:
        return {k: b[k] - a.get(k, 0) for k in b if k != "getxattr" and b[k] != a.get(k, 0)}  # getxattr: the stats

    assert sum(sent(before, middle).values()) <= n // 10, sent(before, middle)
    by_open = sent(middle, after)
    assert sum(v for k, v in by_open.items() if k != "ioctl") <= n // 10, by_open
    if sys.version_info < (3, 14):
        assert by_open.get("ioctl", 0) >= n, by_open  # isatty(): one per open, answered in the request loop


def test_a_file_read_whole_through_the_server_is_not_pushed_again(packed, tmp_path):
    # Its pages are in the kernel's cache from the READ's answer: a push when its block loads (or is listed)
    # would copy the same bytes again.  A file only looked up is still pushed (the recording session refuses).

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    with in_process(dest, tmp_path / "mnt") as (fs, calls):
        fs.view.cache.preload(lambda n: None)  # every block in memory: reads are answered by the reader
        read, looked_up = names[0], names[1]
        assert calls.read(read.encode()) == (src / read).read_bytes()
        assert calls.lookup_path(looked_up.encode())[0] == 0
        entry = {n: fs.view.lookup(n.encode()) for n in (read, looked_up)}
        assert fs.pusher.push([entry[read], entry[looked_up]]) == [entry[looked_up]]  # only the unread one was tried


def test_a_lookup_and_a_read_from_memory_build_no_path_and_skip_the_read_layers(packed, tmp_path, monkeypatch):
    # Reads from a list cost a LOOKUP and a READ per file, so both are answered from the index's columns: the
    # lookup hashes the name from its directory's kept hash (no path built, once per directory at most), the
    # read copies from the cached block (not read_entry, not the cache's read_file) — checked and counted as
    # every read is.

    from blockfs.core.dataset import PackedDataset
    from blockfs.core.index import PackedIndex
    from blockfs.serve.cache.block_cache import BlockCache

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    with in_process(dest, tmp_path / "mnt") as (fs, calls):
        fs.view.cache.preload(lambda n: None)
        made: list[str] = []

        def counted(cls: type, name: str) -> None:
            method = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda *a, **k: made.append(name) or method(*a, **k))

        counted(PackedIndex, "path")
        counted(PackedDataset, "read_entry")
        counted(BlockCache, "read_file")
        before = fs.view.stats()["counters"]
        for name in names:
            assert calls.read(name.encode()) == (src / name).read_bytes(), name
        after = fs.view.stats()["counters"]
    directories = {os.path.dirname(n) for n in names}
    assert made.count("path") <= len(directories), made.count("path")  # one lookup of each built a path before
    assert "read_entry" not in made and "read_file" not in made
    for counter in ("files_served", "file_hits", "reads"):
        assert after[counter] - before[counter] == len(names), counter
    assert after["bytes_served"] - before["bytes_served"] == sum((src / n).stat().st_size for n in names)


def test_a_size_the_block_disagrees_with_is_never_served_from_memory(tmp_path):
    # The read from memory serves only cached blocks, and a block whose header disagrees with the index's sizes
    # is never cached (its header check, before any load, calls it foreign): a forged size answers EIO.
    from fuzz.indexutil import patch_array, resign

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}").write_bytes(bytes([65 + i]) * (1000 + i))
    blockfs.pack(src, tmp_path / "p", fsync=False)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        e = ds.lookup("f1")
    patch_array(tmp_path / "p" / "index.bfi", "size", lambda a: a.__setitem__(e, a[e] - 1))
    resign(tmp_path / "p")
    with in_process(tmp_path / "p", tmp_path / "mnt") as (fs, calls):
        fs.view.cache.preload(lambda n: None)
        with pytest.raises(OSError) as raised:
            calls.read(b"f1")
        assert raised.value.errno == errno.EIO
        assert not fs.view.cache.holds(0)


def test_reads_of_retained_files_and_of_cached_blocks_are_answered_on_the_request_thread(packed, tmp_path, monkeypatch):
    # With a budget smaller than the dataset the plan retains small files (the retainer) and caches blocks with
    # the rest: a read of a retained file is copied from the retainer's arena and one of a cached block's file
    # from the block, both by the reader thread that took it (never DEFERRED to the data pool), without
    # read_entry or the cache's read_file, and counted as each tier counts a hit.
    from kernelcalls import KernelCalls

    from blockfs.core.dataset import PackedDataset
    from blockfs.serve.cache.block_cache import BlockCache
    from blockfs.serve.fuse import wire
    from blockfs.serve.fuse.session import DEFERRED
    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    total = sum((src / n).stat().st_size for n in names)
    options = MountOptions(
        cache_bytes=total * 3 // 4,
        retain_strategy="threshold",
        retain_threshold=4000,
        prefill=False,
        preload=True,  # the blocks the cache holds, then every retained file
        lock_memory=False,
    )
    with assembled(dest, tmp_path / "mnt", options, route="kernel") as fs:
        view, calls = fs.view, KernelCalls(fs)
        assert view.retainer is not None and view.retainer.targets > 0
        retained = cached = None
        for name in names:
            e = view.lookup(name.encode())
            block, slot = view.block_slot(e)
            if retained is None and view.retainer.holds(block, slot):
                retained = name
            elif cached is None and not view.retainer.is_target(block, slot) and view.cache.holds(block):
                cached = name
        assert retained is not None and cached is not None, "the plan should retain some files and cache some blocks"
        made: list[str] = []
        for cls, method_name in ((PackedDataset, "read_entry"), (BlockCache, "read_file")):
            method = getattr(cls, method_name)
            monkeypatch.setattr(
                cls, method_name, lambda *a, _m=method, _n=method_name, **k: made.append(_n) or _m(*a, **k)
            )
        before = view.stats()
        for name in (retained, cached):
            err, node = calls.lookup_path(name.encode())
            assert err == 0
            out = fs.read(node, memoryview(wire.READ_IN.pack(0, 0, 1 << 20, 0) + bytes(16)), 1)
            assert out is not DEFERRED, f"{name}: its read waited for the data pool"
            assert bytes(out) == (src / name).read_bytes(), name
        after = view.stats()
    assert made == [], made
    assert after["retained"]["retained_hits"] - before["retained"]["retained_hits"] == 1
    assert after["counters"]["file_hits"] - before["counters"]["file_hits"] == 2


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14's open() sends no isatty ioctl to push at")
def test_a_file_opened_with_python_is_pushed_at_its_isatty_and_sends_no_read(packed, tmp_path):
    # Reads from a list, no listing, every block in memory: a LOOKUP, then open()'s isatty ioctl, then the READ.
    # The ioctl is taken by the pusher, which pushes the file's pages and only then answers, so the reader's
    # first read finds them: no READ is sent (a push after the LOOKUP answer lost that race 97-99 % of the time).
    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    with mounted(dest, tmp_path / "mnt", binding="kernel") as m:
        n_blocks = stats(m.path)["dataset"]["blocks"]
        wait_until(lambda: stats(m.path)["cache"]["cached_blocks"] == n_blocks, "prefill to load every block")
        before, pushed = requests(m.path), stats(m.path)["page_cache"]
        for name in names:
            with open(m.path / name, "rb") as f:
                assert f.read() == (src / name).read_bytes(), name
        after, now = requests(m.path), stats(m.path)["page_cache"]
    assert after.get("ioctl", 0) - before.get("ioctl", 0) >= len(names)
    assert after.get("read", 0) - before.get("read", 0) <= len(names) // 10, (before, after)
    assert now["pushed_at_open"] - pushed["pushed_at_open"] >= len(names) * 9 // 10, now
    assert now["push_errors"] == 0


def test_an_ioctl_taken_for_a_push_is_always_answered(packed, tmp_path):
    # The pusher takes an opened file's isatty ioctl and answers it after the push, whatever the push does:
    # pushed, refused by the kernel, or failed.  Nodes past the dataset's entries and files already pushed
    # are not taken (the session answers them at once).
    import errno as errnos
    import threading

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    with in_process(dest, tmp_path / "mnt") as (fs, calls):
        fs.view.cache.preload(lambda n: None)
        stored: list[int] = []
        outcomes = iter([True, False, OSError(errnos.EIO, "refused"), True])

        def store(nodeid: int, data, offset: int = 0) -> bool:
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            stored.append(nodeid)
            return outcome

        calls.session.store = store
        while not fs.pusher.jobs.empty():  # the blocks' loads queued their pushes: only the opens' are wanted here
            fs.pusher.jobs.get()
        pusher = threading.Thread(target=fs.pusher.run, daemon=True)
        pusher.start()
        try:
            nodes = [calls.lookup_path(n.encode())[1] for n in names[:3]]
            for unique, node in enumerate(nodes, start=1000):
                assert fs.pusher.opened(node, unique)
                assert calls.session.wait(unique) == (errnos.ENOTTY, b"")
            assert stored == nodes[:2]
            assert not fs.pusher.opened(nodes[0], 2000)  # pushed: its pages are in the kernel
            assert fs.pusher.opened(nodes[1], 2001)  # refused: tried again at its next open
            assert calls.session.wait(2001) == (errnos.ENOTTY, b"")
            assert stored == [*nodes[:2], nodes[1]]
            assert not fs.pusher.opened(fs.view.n_entries + 1, 2002)  # the control directory's node
            counts = fs.pusher.counts
            assert counts["pushed_at_open"] == 2 and counts["push_errors"] == 1
        finally:
            fs.pusher.jobs.put(None)
            pusher.join(10)


def test_an_ioctl_is_taken_only_for_bytes_in_memory_and_answered_once_the_pusher_ends(packed, tmp_path):
    # Taken ioctls wait behind every push queued (a loaded block's files): an open whose file is not in memory
    # (nothing to push) or a directory's is answered at once.  Once the pusher thread ends, whatever it took
    # is answered and nothing more is taken: no opener waits for as long as the mount lives.
    import errno as errnos
    import threading

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    with in_process(dest, tmp_path / "mnt") as (fs, calls):
        node = calls.lookup_path(names[0].encode())[1]
        assert not fs.pusher.opened(node, 1000)  # its block is not loaded: nothing to push
        assert not fs.pusher.opened(1, 1001)  # the root directory
        fs.view.cache.preload(lambda n: None)
        while not fs.pusher.jobs.empty():  # the loads' block pushes: not wanted here
            fs.pusher.jobs.get()
        assert fs.pusher.opened(node, 1002)  # in memory now: taken, to push before answering
        fs.pusher.jobs.put(None)  # the pusher ends (unmounted) before it reaches that ioctl...
        fs.pusher.jobs.put(("open", (node - 1, 1003)))  # ...and one taken just as it ended
        pusher = threading.Thread(target=fs.pusher.run, daemon=True)
        pusher.start()
        pusher.join(30)
        assert calls.session.wait(1002, timeout=10) == (errnos.ENOTTY, b"")
        assert calls.session.wait(1003, timeout=10) == (errnos.ENOTTY, b"")
        assert not fs.pusher.opened(node, 1004)  # the session answers it at once


def test_one_reader_thread_answers_lookups_and_memory_reads_while_a_read_waits_on_storage(packed, tmp_path):
    """The kernel route reads its requests with one thread (a second only passes the GIL back and forth with
    it: docs/benchmarks.md, "The GIL's hand-offs"), which is safe because no request holds it: while a read
    waits on storage (on a data thread), lookups, the statistics and reads of cached bytes are answered."""
    import threading

    from blockfs.serve.mount_options import MountOptions
    from blockfs.serve.server import assembled

    src, dest = packed
    names = [n for n in walk(src) if (src / n).stat().st_size > 0]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    options = MountOptions(cache_bytes=64 << 20, prefill=False, lock_memory=False, readahead=0)
    with assembled(dest, mnt, options, route="kernel") as fs:
        block_of = {n: fs.view.index.read_fields(fs.view.ds.lookup(n))[1] for n in names}
        first = names[0]
        same = next(n for n in names[1:] if block_of[n] == block_of[first])
        slow = next(n for n in names if block_of[n] != block_of[first])
        looked_up = next(n for n in names if n not in (first, same, slow))
        gate, waiting, callers = threading.Event(), threading.Semaphore(0), []
        gate.set()
        files = fs.view.ds.store._files
        for name in ("pread", "read_into", "size"):

            def gated(*args, _real=getattr(files, name)):  # noqa: B008 (bound now: one per name)
                callers.append(threading.current_thread().name)
                if not gate.is_set():
                    waiting.release()
                    gate.wait(30)
                return _real(*args)

            setattr(files, name, gated)
        server = threading.Thread(target=fs.run, args=(str(mnt), "blockfs-one-reader"), daemon=True)
        server.start()
        got: list[bytes] = []
        reader: threading.Thread | None = None
        try:
            wait_until(lambda: fs.served, "the mount to serve")
            assert (mnt / first).read_bytes() == (src / first).read_bytes()  # its block is now in memory
            gate.clear()
            reader = threading.Thread(target=lambda: got.append((mnt / slow).read_bytes()), daemon=True)
            reader.start()
            assert waiting.acquire(timeout=10), "the read of a block not in memory never reached storage"
            assert (mnt / looked_up).stat().st_size == (src / looked_up).stat().st_size
            assert stats(mnt)["requests"]["read"] >= 2
            assert (mnt / same).read_bytes() == (src / same).read_bytes()
            assert not got  # all of that while the read still waits on storage
            readers = [t.name for t in threading.enumerate() if t.name.startswith("blockfs-fuse-")]
            assert readers == ["blockfs-fuse-0"], readers
        finally:
            gate.set()
            if reader is not None:  # the read let go must end before the unmount: on a busy machine it came after
                reader.join(30)
            fs.session.unmount()
            server.join(10)
        assert got == [(src / slow).read_bytes()]
        assert not server.is_alive() and not os.path.ismount(mnt)
    assert callers and not any(c.startswith("blockfs-fuse-") for c in callers), callers


def test_a_file_from_before_1970_is_looked_up_with_its_time(tmp_path):
    """A LOOKUP packs its time one entry at a time: a time before 1970 (a tar's, a restored archive's) was a
    struct.error there, answered EIO, while a listing of the same directory showed it."""
    import struct

    from blockfs.serve.fuse import wire

    (tmp_path / "src").mkdir()
    old = tmp_path / "src" / "old.txt"
    old.write_bytes(b"from 1960\n")
    os.utime(old, ns=(0, -315_619_199_250_000_000))
    blockfs.pack(tmp_path / "src", tmp_path / "ds", fsync=False)
    with in_process(tmp_path / "ds", tmp_path / "mnt") as (fs, calls):
        assert calls.read(b"old.txt") == b"from 1960\n"
        err, entry = calls.call(fs.lookup, wire.ROOT_ID, b"old.txt\0")
        assert err == 0
        at = wire.ENTRY_OUT_HEAD.size  # fuse_attr: mtime at 32 (s64 as the kernel reads it), mtimensec at 52
        mtime, mtimensec = struct.unpack_from("=q", entry, at + 32)[0], struct.unpack_from("=I", entry, at + 52)[0]
        assert mtime * 10**9 + mtimensec == -315_619_199_250_000_000
