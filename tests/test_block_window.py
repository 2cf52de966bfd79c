"""blockfs.serve.cache.block_window: the cache's window of other nodes' blocks, checked in-process (no FUSE).

A block is read whole on its second miss (its first, once blocks before it were read out), once, and its
other files are memory reads; the window holds at
most its room (taken out of the cache's budget) and never drops a block still being read to load another.
The peers' side (a mount asking its owner for the data section, a bad one dropped) is tests/test_peers.py's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from polling import wait_until

import blockfs
from blockfs.core.dataset import PackedDataset
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.cache.block_window import AHEAD_GRACE, IDLE_READS, READ_OUT_STREAK


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """120 files of 1-3 KiB in blocks of 16 KiB: a dozen blocks of about ten files."""
    root = tmp_path_factory.mktemp("window")
    for i in range(120):
        path = root / "src" / f"c{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(1024 + (i * 97) % 2048))
    blockfs.pack(root / "src", root / "p", block_size="16KiB", fsync=False)
    return root


@contextlib.contextmanager
def windowed(
    root, blocks: int, eligible=lambda block: True
) -> Iterator[tuple[PackedDataset, BlockCache, list[list[int]]]]:
    """The dataset read through a cache whose whole budget is a window of ``blocks`` of the largest block (the
    cache's own policy then admits nothing: every block another node's), and each block's file entries; both
    closed on the way out."""
    ds = PackedDataset(root / "p")
    largest = max(ds.store.header(b).data_size for b in range(ds.n_blocks))
    cache = BlockCache(ds.store, blocks * largest, window_bytes=blocks * largest, window_for=eligible)
    off, files = ds.layout
    entries = [files[off[b] : off[b + 1]].tolist() for b in range(ds.n_blocks)]
    reading = ds.reading_through(cache)
    try:
        yield reading, cache, entries
    finally:
        reading.close()
        cache.close()


def read(ds: PackedDataset, root, entries: list[int]) -> None:
    for e in entries:
        assert ds.read_entry(e) == (root / "src" / os.fsdecode(ds.path_of(e))).read_bytes()


def counters(cache: BlockCache) -> dict:
    return cache.stats()["counters"]


def test_a_block_is_read_whole_once_and_the_window_stays_in_its_room(packed):
    with windowed(packed, 2) as (ds, cache, entries):
        assert cache.budget_bytes == 0  # the window's room is the budget's, not more
        room = cache.stats()["cache"]["window"]["capacity_bytes"]
        for n, files in enumerate(entries, 1):  # every block's files in turn (a block-shuffled order)
            read(ds, packed, files)
            c = counters(cache)
            assert c["window_loads"] == n  # each block once
            window = cache.stats()["cache"]["window"]
            assert window["held_bytes"] <= room and window["blocks"] <= 2
        # One file of each block alone before it is fetched whole, until READ_OUT_STREAK blocks were dropped
        # read out (the third and fourth): then a block's first miss fetches it.
        assert counters(cache)["file_reads"] == 2 + READ_OUT_STREAK < len(entries)


def test_a_block_still_being_read_is_never_dropped_for_another(packed):
    with windowed(packed, 2) as (ds, cache, entries):
        a, b, c = entries[:3]
        read(ds, packed, a[:2] + b[:2])  # two blocks being read fill the window
        assert counters(cache)["window_loads"] == 2
        read(ds, packed, c[:3])  # a third block's files are read alone: nothing is dropped or fetched again
        assert counters(cache)["window_loads"] == 2 and counters(cache)["file_reads"] == 2 + 3
        read(ds, packed, a[2:])  # a is read out: its room goes to c
        read(ds, packed, c[3:4])
        assert counters(cache)["window_loads"] == 3
        read(ds, packed, b[2:] + c[4:])  # still held, both
        assert counters(cache)["window_loads"] == 3 and counters(cache)["file_reads"] == 2 + 3
        read(ds, packed, entries[3][:2])  # both read out: room for the next
        assert counters(cache)["window_loads"] == 4


def test_a_block_left_half_read_is_dropped_once_idle(packed):
    with windowed(packed, 2) as (ds, cache, entries):
        a, b, c = entries[:3]
        read(ds, packed, a[:2] + b[:2] + c[:1])  # a and b half read, in the window
        tries = 0
        while counters(cache)["window_loads"] == 2:  # c's second file, again and again: alone while a, b are recent
            read(ds, packed, c[1:2])
            tries += 1
            assert tries <= IDLE_READS + 2
        assert tries >= IDLE_READS - 4


def test_blocks_dropped_mostly_unread_make_a_block_wait_for_its_third_miss(packed):
    with windowed(packed, 2, eligible=lambda block: block != 0) as (ds, cache, entries):  # block 0: this node's own
        own, (a, b, c, d, e) = entries[0], entries[1:6]

        def loads_after(files: list[int]) -> int:
            read(ds, packed, files)
            return counters(cache)["window_loads"]

        def age() -> None:  # IDLE_READS reads of this node's own block: every block in the window goes idle
            read(ds, packed, (own * (IDLE_READS // len(own) + 2))[: IDLE_READS + 1])

        assert loads_after(a[:2] + b[:2]) == 2
        age()
        assert loads_after(c[:2]) == 3  # a dropped, two of its files read: wasted
        age()
        assert loads_after(d[:2]) == 4  # b too: a random order, it seems
        age()
        assert loads_after(e[:2]) == 4  # a second miss no longer fetches a block whole
        assert loads_after(e[2:3]) == 5  # a third does


def test_no_block_is_windowed_unless_it_is_another_nodes(packed):
    with windowed(packed, 2, eligible=lambda block: False) as (ds, cache, entries):
        read(ds, packed, entries[0])
        assert counters(cache)["window_loads"] == 0 and counters(cache)["file_reads"] == len(entries[0])


def test_announced_blocks_are_fetched_ahead_within_the_room_and_their_reads_ask_no_one(packed):
    with windowed(packed, 2) as (ds, cache, entries):
        a, b, c = entries[:3]
        cache.prefetch([0, 1, 2])  # a loader's announcement: these three blocks next, in this order
        wait_until(lambda: counters(cache)["window_loads"] == 2, what="the first two fetched ahead")
        window = cache.stats()["cache"]["window"]
        assert window["blocks"] == 2 and window["held_bytes"] <= window["capacity_bytes"]  # c waits for room
        assert counters(cache)["file_reads"] == 0  # before any read
        read(ds, packed, a[:-1] + b[:2])  # a and b being read: c is not fetched in their place
        assert counters(cache)["window_loads"] == 2
        read(ds, packed, a[-1:])  # a read out: its room goes to c, ahead of c's first read
        wait_until(lambda: counters(cache)["window_ahead_loads"] == 3, what="c fetched ahead once a was read out")
        read(ds, packed, b[2:] + c)
        c_ = counters(cache)
        assert c_["window_loads"] == c_["window_ahead_loads"] == 3 and c_["file_reads"] == 0  # from memory, once


def test_an_announcement_fetches_nothing_ahead_that_is_not_another_nodes(packed):
    with windowed(packed, 2, eligible=lambda block: block != 1) as (ds, cache, entries):
        cache.prefetch([1, 2])
        wait_until(lambda: cache.holds(2), what="block 2 fetched ahead")
        assert not cache.holds(1) and counters(cache)["window_ahead_loads"] == 1
        cache.prefetch([3])  # a new announcement replaces the last
        wait_until(lambda: cache.holds(3), what="block 3 fetched ahead")
        assert counters(cache)["window_ahead_loads"] == 2


def test_files_read_alone_before_a_block_is_fetched_count_toward_reading_it_out(packed):
    with windowed(packed, 1) as (ds, cache, entries):
        a, b, c = entries[:3]
        read(ds, packed, a[:2])  # a fetched on its second miss: the window is full
        read(ds, packed, b[:-1])  # b's files but its last, read alone while a is being read
        assert counters(cache)["window_loads"] == 1 and counters(cache)["file_reads"] == 1 + len(b) - 1
        read(ds, packed, a[2:] + b[-1:])  # a read out; b fetched for its last file: b is read out too
        assert counters(cache)["window_loads"] == 2
        read(ds, packed, c[:2])  # so c takes b's room at once (not IDLE_READS later)
        assert counters(cache)["window_loads"] == 3


def test_a_block_fetched_ahead_is_never_dropped_unread_for_a_later_one(packed):
    with windowed(packed, 2, eligible=lambda block: block != 3) as (ds, cache, entries):  # block 3: this node's own
        cache.prefetch([0, 1])
        wait_until(lambda: counters(cache)["window_ahead_loads"] == 2, what="blocks 0 and 1 fetched ahead")
        own = entries[3]
        read(ds, packed, (own * (AHEAD_GRACE // len(own) + 2))[: AHEAD_GRACE + 8])  # 0 and 1 go idle, unread
        asked = iter([True])  # one look for room, then no longer current
        assert cache.window_ahead(2, lambda: next(asked, False)) is None  # 0 and 1 come before it: kept
        assert cache.holds(0) and cache.holds(1)
        read(ds, packed, entries[0] + entries[1])
        assert counters(cache)["window_loads"] == 2  # each fetched once, its files read from memory


def test_an_announcement_keeps_the_blocks_it_names_for_their_new_reads(packed):
    with windowed(packed, 2) as (ds, cache, entries):
        a, b = entries[:2]
        read(ds, packed, a + b[:2])  # a read out (a last pass), b being read
        assert counters(cache)["window_loads"] == 2
        cache.prefetch([0, 2])  # the next pass reads a again, then block 2; not b
        wait_until(lambda: cache.holds(2), what="block 2 fetched ahead")
        assert cache.holds(0) and not cache.holds(1)  # b's room went to block 2; a kept for its new reads
        read(ds, packed, a)
        assert counters(cache)["window_loads"] == 3 and counters(cache)["window_ahead_loads"] == 1
