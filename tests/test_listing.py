"""Listings at scale: a directory of 200,000 entries lists completely, in order and from any position on
both routes; the kernel route's node table is arrays (a listing leaves no object per entry) and honours
FORGET (no count below zero, a forgotten node found again by a later lookup).

The dataset is synthetic (a :class:`Source` that makes its entries up, nothing on a disk to walk): 200,000
one-byte files packed in about 5 s.  Mechanisms, not speed: ``tools/bench/bench_listing.py`` times them.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from capability import has_fuse, require
from kernelcalls import KernelCalls
from mountutil import mounted
from polling import wait_until

import blockfs
from blockfs.core.index import KIND_DIR, KIND_FILE
from blockfs.packing.sources import Source, SourceEntry
from blockfs.serve.daemon import unmount, wait_until_mounted
from blockfs.serve.fuse import wire
from blockfs.serve.mount_options import MountOptions
from blockfs.serve.server import assembled

N = 200_000
MTIME_NS = 1_700_000_000_000_000_001


def name_of(i: int) -> bytes:
    """Names of 7 to 17 bytes (records of every padding), in the index's (byte) order."""
    return b"%07d%s" % (i, b"x" * (i % 11))


class ManyFiles(Source):
    """``big/``: ``n`` one-byte files (the last byte of the name), and ``small/`` beside it."""

    description = "a made-up directory of many files"

    def __init__(self, n: int = N) -> None:
        self.n = n

    def entries(self):
        yield SourceEntry(b"", KIND_DIR, stat.S_IFDIR | 0o755, MTIME_NS)
        yield SourceEntry(b"big", KIND_DIR, stat.S_IFDIR | 0o755, MTIME_NS)
        for i in range(self.n):
            yield SourceEntry(b"big/" + name_of(i), KIND_FILE, stat.S_IFREG | 0o644, MTIME_NS, size=1)
        yield SourceEntry(b"small", KIND_DIR, stat.S_IFDIR | 0o755, MTIME_NS)
        yield SourceEntry(b"small/one", KIND_FILE, stat.S_IFREG | 0o644, MTIME_NS, size=1)

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        buf[:] = entry.path[-1:] * len(buf)
        return len(buf)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("listing") / "packed"
    blockfs.pack(ManyFiles(), dest, fsync=False)
    return dest


RECLAIMED = 40_000  # the memory-pressure test's directory: ~48 MB of the kernel's slab once listed


@pytest.fixture(scope="module")
def reclaimable(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("reclaimable") / "packed"
    blockfs.pack(ManyFiles(RECLAIMED), dest, fsync=False)
    return dest


# --- through the mount (CI runs this on both routes: BLOCKFS_FUSE) --------------------------------------
class _Dirent(ctypes.Structure):
    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    ]


class _Dir:
    """opendir(3), readdir(3), telldir(3) and seekdir(3), which the os module does not offer."""

    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype, libc.opendir.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    libc.readdir.restype, libc.readdir.argtypes = ctypes.POINTER(_Dirent), [ctypes.c_void_p]
    libc.telldir.restype, libc.telldir.argtypes = ctypes.c_long, [ctypes.c_void_p]
    libc.seekdir.restype, libc.seekdir.argtypes = None, [ctypes.c_void_p, ctypes.c_long]
    libc.closedir.argtypes = [ctypes.c_void_p]

    def __init__(self, path: Path) -> None:
        self.handle = self.libc.opendir(bytes(path))
        assert self.handle, f"opendir {path}: errno {ctypes.get_errno()}"

    def next(self) -> bytes | None:
        ctypes.set_errno(0)
        one = self.libc.readdir(self.handle)
        if not one:
            assert ctypes.get_errno() == 0, f"readdir: errno {ctypes.get_errno()}"
            return None
        return one.contents.d_name

    def tell(self) -> int:
        return self.libc.telldir(self.handle)

    def seek(self, where: int) -> None:
        self.libc.seekdir(self.handle, where)

    def close(self) -> None:
        self.libc.closedir(self.handle)


@pytest.mark.fuse
def test_a_directory_of_200000_entries_lists_completely_in_order_and_from_where_telldir_was(big, tmp_path):
    require(has_fuse(), "/dev/fuse")
    expected = [b".", b".."] + [name_of(i) for i in range(N)]
    with mounted(big, tmp_path / "mnt", "--no-prefill") as m:
        d = _Dir(m.path / "big")
        try:
            names, marks = [], {}
            for position in range(len(expected)):  # cold: every entry comes from the server
                if position in (3, N // 2 + 1, N):
                    marks[position] = d.tell()
                name = d.next()
                assert name is not None, f"the listing ended after {position} entries"
                names.append(name)
            assert d.next() is None
            assert names == expected
            for position, where in sorted(marks.items(), reverse=True):
                d.seek(where)
                again = [d.next() for _ in range(min(2000, len(expected) - position) + 1)]
                assert again[:-1] == expected[position : position + 2000], f"seekdir to entry {position}"
                assert again[-1] == (None if position == N else expected[position + 2000])
        finally:
            d.close()
        assert (m.path / "big" / name_of(N - 1).decode()).read_bytes() == b"x"
        assert sorted(p.name for p in (m.path / "small").iterdir()) == ["one"]


# --- the kernel route in-process (tests/kernelcalls.py) ---------------------------------------------------
@pytest.fixture
def kernel(big, tmp_path):
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    with assembled(big, tmp_path / "mnt", options, route="kernel") as fs:
        yield fs, KernelCalls(fs)


def index_mapping(index) -> tuple[str, int]:
    """(the path of the mapping that holds ``index``'s bytes, its anonymous kB) from /proc/self/smaps."""
    address = np.frombuffer(index.raw, dtype=np.uint8, count=1).ctypes.data
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                start, end = (int(x, 16) for x in head[0].split("-"))
                found = (" ".join(head[5:]), start <= address < end)
            elif line.startswith("Anonymous:") and found is not None and found[1]:
                return found[0], int(head[1])
    raise AssertionError("the index's bytes are in no mapping")


def test_a_mount_holds_few_bytes_an_entry_and_its_index_outside_anonymous_memory(big, tmp_path):
    """Issue 30: the server's own memory <= 64 bytes a file.  The index (~147 bytes an entry) is a map of a
    private copy (page cache the kernel can reclaim, blockfs/core/index_copy.py), and the mount
    keeps no array over every file beyond the node table: the plan's (block, slot, size) of every file
    (24 bytes a file) went with the plan.  Before: the index in anonymous memory and ~33 bytes an entry."""
    options = MountOptions(cache_bytes=1 << 30, prefill=False, lock_memory=False)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with assembled(big, tmp_path / "mnt", options, route="kernel") as fs:
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
            n = fs.view.n_entries
            where, anonymous_kb = index_mapping(fs.view.index)
    finally:
        tracemalloc.stop()
    assert held / n < 16, f"the assembled mount holds {held / n:.1f} bytes an entry"
    copies = os.environ["BLOCKFS_INDEX_COPY_DIR"]
    digest = json.loads((big / "blockfs.json").read_bytes())["index"]["blake3"]
    # The copy this mount made (unnamed), or the one kept by the pack or an earlier mount (blockfs/core/kept_copies.py).
    assert where.startswith(os.path.realpath(copies) + "/"), where
    assert where.endswith("(deleted)") or where == os.path.join(os.path.realpath(copies), "kept", digest), where
    assert anonymous_kb == 0


@pytest.mark.parametrize("listing", [None, "plain", "plus", "auto"])
def test_kernel_route_asks_the_kernel_for_the_listing_its_option_names(big, tmp_path, listing):
    """--listing is what the INIT answer asks for: READDIR only by default (plain: no flag, so the kernel
    links no inode for a listed entry), READDIRPLUS always (plus), or as the kernel decides (auto)."""
    extra = {"listing": listing} if listing else {}
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False, **extra)
    with assembled(big, tmp_path / "mnt", options, route="kernel") as fs:
        offered = (1 << 32) - 1  # a kernel that offers every flag
        answer = fs.session.init_answer(
            memoryview(wire.INIT_IN.pack(wire.KERNEL_MAJOR, wire.KERNEL_MINOR, 1 << 17, offered))
        )
        flags = wire.INIT_OUT.unpack(answer)[3]
        assert fs.view.route.facts["listing"] == (listing or "plain")
    plus, auto = bool(flags & wire.DO_READDIRPLUS), bool(flags & wire.READDIRPLUS_AUTO)
    assert (plus, auto) == {None: (False, False), "plain": (False, False), "plus": (True, False), "auto": (True, True)}[
        listing
    ]
    assert flags & wire.NO_OPEN_SUPPORT and flags & wire.NO_OPENDIR_SUPPORT  # the rest unchanged


def _records(data: bytes, plus: bool) -> list[tuple[int, int, bytes]]:
    """(node id, next offset, name) of each record of a READDIR(PLUS) reply (node id 0 for READDIR)."""
    out, pos = [], 0
    fixed = wire.DIRENTPLUS_FIXED if plus else wire.DIRENT_HEAD.size
    while pos < len(data):
        node = struct.unpack_from("=Q", data, pos)[0] if plus else 0
        _ino, offset, namelen, _type = wire.DIRENT_HEAD.unpack_from(data, pos + fixed - wire.DIRENT_HEAD.size)
        out.append((node, offset, data[pos + fixed : pos + fixed + namelen]))
        pos += (fixed + namelen + 7) & ~7
    return out


def _list_at(calls: KernelCalls, node: int, offset: int, size: int, plus: bool = True) -> list[tuple[int, int, bytes]]:
    handler = calls.fs.readdirplus if plus else calls.fs.readdir
    err, data = calls.call(handler, node, wire.READ_IN.pack(0, offset, size, 0) + bytes(16))
    assert err == 0
    return _records(data, plus)


@pytest.mark.parametrize("plus", [True, False])
def test_kernel_route_listing_resumes_at_any_offset_with_what_the_full_listing_holds_there(kernel, plus):
    fs, calls = kernel
    _, node = calls.lookup_path(b"big")
    first = _list_at(calls, node, 0, 4096, plus)
    assert [name for _n, _o, name in first[:3]] == [b".", b"..", name_of(0)]
    node_of_0 = first[2][0]  # children are one run of entries: node ids follow the names
    assert [offset for _n, offset, _name in first] == list(range(1, len(first) + 1))
    for offset in (1, 2, 3, 1000, N // 2 + 7, N, N + 1):
        for size in (200, 4096, 1 << 17):
            got = _list_at(calls, node, offset, size, plus)
            assert got, (offset, size)
            for k, (child, next_offset, name) in enumerate(got):
                i = offset + k - 2  # the child's position in the directory
                assert next_offset == offset + k + 1
                assert name == ({-2: b".", -1: b".."}[i] if i < 0 else name_of(i))
                if plus:  # children only: "." and ".." carry node 0
                    assert child == (node_of_0 + i if i >= 0 else 0)
    assert _list_at(calls, node, N + 2, 4096, plus) == []  # past the end: the end
    assert _list_at(calls, node, N + 50, 4096, plus) == []


def test_kernel_route_listing_reads_only_the_slice_a_request_covers(kernel, monkeypatch):
    """Not quadratic: a READDIRPLUS never builds the directory's whole name list (each request used to,
    43 ms a request at 120,000 entries), nor touches more entries than its reply can hold."""
    fs, calls = kernel
    _, node = calls.lookup_path(b"big")
    index = fs.view.index

    def whole_directory(*args):
        raise AssertionError("a listing request built the whole directory's names")

    spans = []
    name_spans = index.name_spans
    monkeypatch.setattr(index, "names", whole_directory)
    monkeypatch.setattr(index, "joined_names", whole_directory)
    monkeypatch.setattr(
        index, "name_spans", lambda e, first, stop: spans.append(stop - first) or name_spans(e, first, stop)
    )
    got = _list_at(calls, node, N // 2, 4096)
    assert got[0][2] == name_of(N // 2 - 2) and len(got) > 10
    assert spans and max(spans) <= 4096 // (wire.DIRENTPLUS_FIXED + 8)


def test_kernel_route_listing_of_200000_entries_leaves_no_object_per_entry(kernel):
    """The node table is arrays sized at mount: a full listing (every entry counted as a lookup) leaves
    neither Python objects nor allocated memory per entry behind."""
    fs, calls = kernel
    _, node = calls.lookup_path(b"big")
    _list_at(calls, node, 0, 1 << 15)  # anything made once, on the first request
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        offset, listed = 0, 0
        while records := _list_at(calls, node, offset, 1 << 15):  # as the kernel asks: 32 KiB at a time
            listed += sum(1 for child, _o, _n in records if child)
            offset = records[-1][1]
        del records
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert listed == N
    first_child = _list_at(calls, node, 2, 200)[0][0]
    assert fs.lookups(first_child) == 3 and fs.lookups(first_child + N - 1) == 1  # 3: the first request, twice
    assert grown < N, f"{grown} bytes still allocated after listing {N} entries"
    assert len(gc.get_objects()) - objects < 1000


def test_kernel_route_forget_drops_counts_never_below_zero_and_a_forgotten_node_is_found_again(kernel):
    fs, calls = kernel
    _, big_node = calls.lookup_path(b"big")
    _, node = calls.lookup_path(b"big/" + name_of(5))
    _, other = calls.lookup_path(b"big/" + name_of(6))
    calls.lookup_path(b"big/" + name_of(5))
    assert fs.lookups(node) == 2 and fs.lookups(other) == 1
    _list_at(calls, big_node, 0, 4096)  # lists both: one lookup more each
    assert fs.lookups(node) == 3 and fs.lookups(other) == 2

    fs.forget(node, memoryview(wire.FORGET_IN.pack(1)), 0)  # answered by nothing, as the kernel expects
    assert fs.lookups(node) == 2
    rows = [(node, 1), (other, 7), (node, 1), (0, 1), (1 << 40, 1), (node + N * 10, 3)]  # unknown ids: ignored
    body = wire.BATCH_FORGET_IN.pack(len(rows), 0) + b"".join(wire.FORGET_ONE.pack(n, c) for n, c in rows)
    fs.batch_forget(0, memoryview(body), 0)
    assert fs.lookups(node) == 0 and fs.lookups(other) == 0  # other: 2 - 7 stops at 0
    fs.forget(other, memoryview(wire.FORGET_IN.pack(3)), 0)
    assert fs.lookups(other) == 0

    assert calls.lookup_path(b"big/" + name_of(5)) == (0, node)  # found again: the same node, counted anew
    assert fs.lookups(node) == 1 and fs.lookups(other) == 0
    assert fs.lookups(big_node) == 5  # every path lookup went through "big"; none was forgotten
    assert calls.read(b"big/" + name_of(5)) == name_of(5)[-1:]


def test_kernel_route_lookup_counts_are_32_bit_and_held_at_their_most_never_wrapped(kernel):
    """The node table's counts are int32 (4 bytes a file of the server's memory): a count at its most
    stays there through lookups and listings (the node is then believed held: never forgotten by a wrap),
    and a FORGET of more than it holds leaves 0."""
    from blockfs.serve.fuse.dir_replies import LOOKUP_MAX

    fs, calls = kernel
    _, big_node = calls.lookup_path(b"big")
    _, node = calls.lookup_path(b"big/" + name_of(3))
    assert fs._lookups.dtype == np.int32
    fs._lookups[node - 1] = LOOKUP_MAX - 1
    calls.lookup_path(b"big/" + name_of(3))
    calls.lookup_path(b"big/" + name_of(3))
    assert fs.lookups(node) == LOOKUP_MAX
    _list_at(calls, big_node, 0, 4096)  # lists it: counted, held at the most
    assert fs.lookups(node) == LOOKUP_MAX
    rows = [(node, 1 << 40), (node, 5)]
    body = wire.BATCH_FORGET_IN.pack(len(rows), 0) + b"".join(wire.FORGET_ONE.pack(n, c) for n, c in rows)
    fs.batch_forget(0, memoryview(body), 0)
    assert fs.lookups(node) == 0


# --- FORGET under memory pressure (issue 30 item 4) -------------------------------------------------------
LISTER = r"""
import json, os, sys
top = sys.argv[1]
names = [e.name for e in os.scandir(top)]  # READDIRPLUS: the kernel links an inode and a dentry per entry
wrong = []
for name in names:  # by then most of those inodes were reclaimed and forgotten: looked up again
    with open(os.path.join(top, name), "rb") as f:
        if f.read() != name.encode()[-1:]:
            wrong.append(name)
print(json.dumps({"listed": len(names), "wrong": wrong[:5], "n_wrong": len(wrong)}))
"""


class MemoryCgroup:
    """A memory cgroup (v2 or v1) of ``limit`` bytes; kernel memory (slab: inodes, dentries) is charged to it
    too, so a listing inside it has its inodes reclaimed once they pass the limit.  Root only."""

    def __init__(self, limit: int) -> None:
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
        name = f"blockfs-test-{os.getpid()}"
        if (v2 / "cgroup.subtree_control").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            self.path, limit_file = v2 / name, "memory.max"
        elif (v1 / "memory.limit_in_bytes").exists():
            self.path, limit_file = v1 / name, "memory.limit_in_bytes"
        else:
            raise OSError("no memory cgroup controller")
        self.path.mkdir()
        (self.path / limit_file).write_text(str(limit))

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        self.path.rmdir()  # its one process has exited


def _memory_cgroup(limit: int) -> MemoryCgroup:
    require(os.geteuid() == 0, "root (a memory cgroup)")
    try:
        return MemoryCgroup(limit)
    except OSError as e:
        require(False, f"a memory cgroup ({e})")
        raise


def _list_and_read_in(group: MemoryCgroup, top: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", LISTER, str(top)], preexec_fn=group.enter, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


class NodeAudit:
    """Wraps a kernel-route server's handlers: every FORGET that asks to drop more lookups than the server
    counted, and every request about a node the server counts as forgotten (the kernel holds no such
    node: the server's count went wrong), is written down."""

    HANDLES_UNKNOWN = {wire.LOOKUP, wire.FORGET, wire.BATCH_FORGET, wire.INIT, wire.DESTROY, wire.STATFS}

    def __init__(self, fs) -> None:
        self.fs, self.faults, self.forgotten = fs, [], 0
        n = len(fs._lookups)
        handlers = fs.session._handlers
        for opcode, handler in list(handlers.items()):
            handlers[opcode] = self._wrap(opcode, handler, n)

    def _wrap(self, opcode: int, handler, n: int):
        lookups = self.fs._lookups

        def audited(nodeid: int, body: memoryview, unique: int):
            if opcode == wire.FORGET and 0 < nodeid <= n:
                (count,) = wire.FORGET_IN.unpack_from(body)
                if count > lookups[nodeid - 1]:
                    self.faults.append(("forget past zero", nodeid, count, int(lookups[nodeid - 1])))
                self.forgotten += count
            elif opcode == wire.BATCH_FORGET:
                for node, count in zip(*(wire.forgets(body)[k].tolist() for k in ("nodeid", "nlookup")), strict=True):
                    if 0 < node <= n and count > lookups[node - 1]:
                        self.faults.append(("batch forget past zero", node, count, int(lookups[node - 1])))
                    self.forgotten += count
            elif opcode not in self.HANDLES_UNKNOWN and 1 < nodeid <= n and lookups[nodeid - 1] <= 0:
                self.faults.append(("request for a forgotten node", opcode, nodeid))
            return handler(nodeid, body, unique)

        return audited


@pytest.mark.fuse
@pytest.mark.parametrize("binding", ["kernel", "mfusepy"])
def test_under_memory_pressure_reclaimed_inodes_are_forgotten_and_every_file_still_reads_right(
    reclaimable, tmp_path, binding
):
    """Issue 30: a listing of 40,000 entries with attributes (READDIRPLUS) inside a memory cgroup of 24 MiB,
    where the kernel holds ~1.2 KB of slab per listed entry (48 MB), so it reclaims most of them and sends FORGET;
    every file is then opened and read (each reclaimed one looked up again) and must read right.  On the
    kernel route the server is audited: FORGETs arrived, none took a count below zero, no request named a
    node after its last FORGET, and most nodes are forgotten at the end (ignoring FORGETs fails here)."""
    require(has_fuse(), "/dev/fuse")
    group = _memory_cgroup(24 << 20)
    try:
        if binding == "mfusepy":
            with mounted(reclaimable, tmp_path / "mnt", "--no-prefill", binding="mfusepy") as m:
                got = _list_and_read_in(group, m.path / "big")
        else:
            options = MountOptions(cache_bytes=16 << 20, prefill=False, lock_memory=False, listing="plus")
            mnt = tmp_path / "mnt"
            mnt.mkdir()
            with assembled(reclaimable, mnt, options, route="kernel") as fs:
                audit = NodeAudit(fs)
                server = threading.Thread(target=fs.run, args=(str(mnt), "blockfs-test"), daemon=True)
                server.start()
                try:
                    wait_until_mounted(mnt, None, 30)
                    got = _list_and_read_in(group, mnt / "big")
                    # The last FORGETs the kernel queued are read by the server's threads a moment later.
                    held = wait_until(
                        lambda: (n := int(np.count_nonzero(fs._lookups > 0))) < RECLAIMED // 2 and n,
                        "most listed nodes forgotten (FORGETs honoured)",
                        timeout=60,
                    )
                    requests = dict(fs.session.requests)
                finally:
                    unmount(mnt)
                    server.join(30)
            assert not server.is_alive()
            assert requests.get(wire.FORGET, 0) + requests.get(wire.BATCH_FORGET, 0) > 0, requests
            assert audit.forgotten > RECLAIMED // 2  # reclaimed under the limit, and told
            assert audit.faults == [], audit.faults[:5]
            assert int(fs._lookups.min()) >= 0
            assert 0 < held < RECLAIMED // 2
    finally:
        group.close()
    assert got["listed"] == RECLAIMED and got["n_wrong"] == 0, got
