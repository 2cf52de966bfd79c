"""blockfs.serve.fuse.wire: the FUSE kernel structures have the sizes and layout <linux/fuse.h> gives them."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from blockfs.serve.fuse import wire


def test_structure_sizes_are_the_kernels():
    assert wire.IN_HEADER.size == 40 and wire.OUT_HEADER.size == 16
    assert wire.ATTR.size == 88 and wire.ENTRY_OUT_SIZE == 128
    assert len(wire.attr_out(wire.attr(1, 2, stat.S_IFREG | 0o444, 1, 0, 0, 0), 1)) == 104
    assert wire.INIT_OUT.size == 64 and wire.KSTATFS.size == 80
    assert wire.READ_IN.size == 24 and wire.NOTIFY_STORE_OUT.size == 24


def test_attr_splits_nanoseconds_and_counts_512_byte_blocks():
    fields = wire.ATTR.unpack(wire.attr(7, 1025, stat.S_IFREG | 0o644, 2, 1_600_000_000_123_456_789, 5, 6))
    ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, nlink, uid, gid = fields[:13]
    assert (ino, size, blocks, nlink, uid, gid) == (7, 1025, 3, 2, 5, 6)
    assert atime == mtime == ctime == 1_600_000_000 and mtimensec == 123_456_789 == atimensec == ctimensec
    assert stat.S_ISREG(mode)
    dir_fields = wire.ATTR.unpack(wire.attr(1, 4096, stat.S_IFDIR | 0o755, 2, 0, 0, 0))
    assert dir_fields[2] == 0  # a directory's size is not data


def test_direntplus_records_are_8_byte_aligned_and_name_their_next_offset():
    entry = wire.entry_out(5, wire.attr(5, 3, stat.S_IFREG | 0o444, 1, 0, 0, 0), 10)
    for name in (b"a", b"abcdefg", b"abcdefgh", "é".encode()):
        one = wire.direntplus(entry, 5, 9, name, stat.S_IFREG | 0o444)
        assert len(one) % 8 == 0 and len(one) >= wire.DIRENTPLUS_FIXED + len(name)
        ino, off, namelen, dtype = wire.DIRENT_HEAD.unpack_from(one, wire.ENTRY_OUT_SIZE)
        assert (ino, off, namelen, dtype) == (5, 9, len(name), stat.S_IFREG >> 12)
        assert one[wire.DIRENTPLUS_FIXED : wire.DIRENTPLUS_FIXED + len(name)] == name
    assert len(wire.dirent(1, 1, b"abc", stat.S_IFDIR)) % 8 == 0


def test_notify_store_header_counts_the_data_that_follows():
    head = wire.notify_store_header(9, 4096, 100)
    length, code, unique = wire.OUT_HEADER.unpack_from(head)
    assert (code, unique) == (wire.NOTIFY_STORE, 0)
    assert length == len(head) + 100
    assert wire.NOTIFY_STORE_OUT.unpack_from(head, wire.OUT_HEADER.size) == (9, 4096, 100, 0)


@pytest.mark.parametrize(
    "mode, size",
    [(stat.S_IFREG | 0o444, 513), (stat.S_IFREG | 0o444, 0), (stat.S_IFDIR | 0o555, 4096), (stat.S_IFLNK | 0o777, 9)],
)
def test_an_entry_packed_at_once_is_the_entry_of_its_attributes(mode, size):
    """wire.entry (a LOOKUP's answer in one pack) is entry_out(attr(...)) byte for byte."""
    fields = (77, size, mode, 2, 1_700_000_000_123_456_789, 1000, 1001)
    assert wire.entry(9, 86400, *fields) == wire.entry_out(9, wire.attr(*fields), 86400)
    assert len(wire.entry(9, 86400, *fields)) == wire.ENTRY_OUT_SIZE == 128


def test_a_negative_entry_names_node_zero():
    assert wire.ENTRY_OUT_HEAD.unpack_from(wire.negative_entry(30))[:3] == (0, 0, 30)


def test_notify_store_header_refuses_more_than_one_piece():
    """A size the kernel cannot take in one message (a u32, and write(2) stops at 2 GiB) is refused here,
    by name, instead of a struct.error or a message cut short (Session.store sends pieces)."""
    assert wire.STORE_PIECE % (64 << 10) == 0  # whole pages of any page size
    wire.notify_store_header(2, 0, wire.STORE_PIECE)
    for size in (wire.STORE_PIECE + 1, 3 << 30, 5 << 30):
        with pytest.raises(ValueError, match="FUSE_NOTIFY_STORE"):
            wire.notify_store_header(2, 0, size)


def test_records_packed_a_reply_at_a_time_are_the_ones_packed_one_by_one():
    rng = np.random.default_rng(5)
    n = 60
    names = [bytes(rng.integers(1, 256, size=k, dtype=np.uint8)).replace(b"/", b"x") for k in rng.integers(1, 256, n)]
    names[:3] = [b"a", b"abcdefg", b"abcdefgh"]  # the padding's edges
    length = np.array([len(name) for name in names])
    start = np.cumsum(length) - length + 3  # the names anywhere in a table
    table = np.frombuffer(b"xyz" + b"".join(names), dtype=np.uint8)
    ino = rng.integers(1, 1 << 40, n, dtype=np.uint64)
    size = rng.integers(0, 1 << 33, n, dtype=np.uint64)
    mode = rng.choice([stat.S_IFREG | 0o444, stat.S_IFDIR | 0o555, stat.S_IFLNK | 0o777], n).astype(np.uint32)
    nlink = rng.integers(1, 9, n).astype(np.uint32)
    mtime = rng.integers(0, 1 << 62, n, dtype=np.int64)
    nxt = np.arange(3, n + 3, dtype=np.uint64)
    dirents = wire.dirent_rows(ino, nxt, length, mode)
    one_by_one = [wire.dirent(int(ino[i]), int(nxt[i]), names[i], int(mode[i])) for i in range(n)]
    assert wire.records(dirents, table, start, length) == b"".join(one_by_one)
    assert wire.record_ends(length, plus=False)[-1] == sum(map(len, one_by_one))

    rows = np.zeros(n, dtype=wire.DIRENTPLUS_ROW)
    rows["dirent"] = dirents
    rows["entry"]["nodeid"] = ino + 1
    rows["entry"]["entry_valid"] = rows["entry"]["attr_valid"] = 9
    rows["entry"]["attr"] = wire.attr_rows(ino, size, mode, nlink, mtime, 7, 8)
    one_by_one = [
        wire.direntplus(
            wire.entry_out(
                int(ino[i]) + 1,
                wire.attr(int(ino[i]), int(size[i]), int(mode[i]), int(nlink[i]), int(mtime[i]), 7, 8),
                9,
            ),
            int(ino[i]),
            int(nxt[i]),
            names[i],
            int(mode[i]),
        )
        for i in range(n)
    ]
    assert wire.records(rows, table, start, length) == b"".join(one_by_one)
    assert wire.record_ends(length, plus=True)[-1] == sum(map(len, one_by_one))


def test_a_batch_forget_is_read_as_one_array():
    body = wire.BATCH_FORGET_IN.pack(3, 0) + b"".join(wire.FORGET_ONE.pack(n, c) for n, c in [(5, 1), (9, 2), (5, 3)])
    rows = wire.forgets(memoryview(body))
    assert rows["nodeid"].tolist() == [5, 9, 5] and rows["nlookup"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("mtime_ns", [-1, -1_500_000_000, -(2**63), 2**63 - 1])
def test_times_before_1970_are_packed_as_the_kernel_reads_them(mtime_ns):
    """The kernel reads fuse_attr's u64 times as time64_t: a time before 1970 is its two's complement.
    Packed one at a time (LOOKUP, GETATTR) exactly as a reply at a time (ATTR_ROW, listings); an extreme
    time in a re-signed index was a struct.error, answered EIO, for a name that lists fine."""
    fields = (3, 10, stat.S_IFREG | 0o444, 1, mtime_ns, 0, 0)
    sec, nsec = divmod(mtime_ns, 1_000_000_000)
    one = wire.ATTR.unpack(wire.attr(*fields))
    assert one[3:9] == (sec, sec, sec, nsec, nsec, nsec)
    row = np.frombuffer(wire.attr(*fields), dtype=wire.ATTR_ROW)[0]
    assert int(row["mtime"]) == sec and int(row["mtimensec"]) == nsec
    assert wire.entry(4, 1, *fields) == wire.entry_out(4, wire.attr(*fields), 1)
