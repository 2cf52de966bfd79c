"""Index copies kept for the next mount (blockfs/core/kept_copies.py): a re-open of the same index maps the
copy an earlier one made, checked and kept, without copying or hashing the index again; a kept copy that is
not exactly as it was kept is never used, and the index is copied and hashed again; the bound holds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading

import pytest
from mountutil import mapped_file
from polling import wait_until

import blockfs
from blockfs.core import digest as dg
from blockfs.core import index_copy, kept_copies
from blockfs.core.checked_indexes import CheckedIndexes
from blockfs.core.dataset import PackedDataset
from blockfs.core.index_copy import IndexCopies


@pytest.fixture
def packed(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    return tmp_path / "p"


@pytest.fixture
def work(monkeypatch):
    """Bytes of an index copied into a copy, and bytes hashed behind a copy, by every open."""
    counts = {"copied": 0, "hashed": 0}
    real_copy, real_filling = index_copy._copy, dg.FillingDigest

    def copying(src, dst, size, on_copied=None):
        counts["copied"] += size
        return real_copy(src, dst, size, on_copied)

    class Counting(real_filling):
        def _update(self, start, end):
            counts["hashed"] += end - start
            super()._update(start, end)

    monkeypatch.setattr(index_copy, "_copy", copying)
    monkeypatch.setattr(dg, "FillingDigest", Counting)
    return counts


def opened(packed, copies) -> tuple[bytes, str | None]:
    """The index's bytes as an open of ``packed`` holds them, and the file its map is of."""
    with PackedDataset(packed, copies=copies) as ds:
        assert ds.index.find(ds.index.path(ds.index.n_entries - 1)) == ds.index.n_entries - 1
        held = bytes(ds.index.raw), mapped_file(ds.index.raw)
    kept_copies.wait_kept()  # a copy to keep is named once synced, on a thread of its own
    return held


def digest_of(packed) -> str:
    """The index's digest as blockfs.json records it (read without opening the index)."""
    return json.loads((packed / "blockfs.json").read_bytes())["index"]["blake3"]


def test_a_reopen_of_the_same_index_neither_copies_nor_hashes_it(packed, tmp_path, work):
    original = (packed / "index.bfi").read_bytes()
    copies = IndexCopies(tmp_path / "copies")
    first, where = opened(packed, copies)
    assert first == original and work == {"copied": len(original), "hashed": len(original)}
    digest = digest_of(packed)
    kept = tmp_path / "copies" / "kept" / digest
    assert sorted(os.listdir(tmp_path / "copies" / "kept")) == [digest, digest + ".id"]
    assert kept.stat().st_mode & 0o777 == 0o400 and kept.stat().st_nlink == 1
    assert dg.digest(kept.read_bytes()).hex() == digest

    again, where = opened(packed, copies)
    assert again == original and work == {"copied": len(original), "hashed": len(original)}  # nothing more
    assert where == os.path.realpath(kept)


def test_an_open_opens_the_copy_directory_once_with_or_without_a_kept_copy(packed, tmp_path, work, monkeypatch):
    """A mount with no kept copy opened (and checked) the copy directory twice: to look for a kept copy, then
    to copy the index."""
    real, opens = index_copy.open_owned_dir, []

    def counted(path, *args, **kwargs):
        opens.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(index_copy, "open_owned_dir", counted)
    copies = IndexCopies(tmp_path / "copies")
    for kept in (False, True):  # a first open copies (and keeps); the next maps the kept copy
        opens.clear()
        opened(packed, copies)
        assert opens == [str(tmp_path / "copies")], kept
    assert work["copied"] == (packed / "index.bfi").stat().st_size  # once: the second open mapped the kept copy


def test_the_kept_copy_is_the_index_blockfs_json_names_whatever_index_bfi_holds_now(packed, tmp_path, work):
    """The copy was hashed and found to be the index blockfs.json names: index.bfi is not read again.  A
    dataset packed anew (another blockfs.json, another digest) is copied and kept anew."""
    original = (packed / "index.bfi").read_bytes()
    copies = IndexCopies(tmp_path / "copies")
    opened(packed, copies)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    (packed / "index.bfi").write_bytes(bytes(damaged))
    assert opened(packed, copies)[0] == original

    tree = tmp_path / "other"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"another dataset")
    blockfs.pack(tree, packed, block_size=2000, force=True)
    before = work["copied"]
    assert opened(packed, copies)[0] == (packed / "index.bfi").read_bytes()
    assert work["copied"] > before
    assert digest_of(packed) + ".id" in os.listdir(tmp_path / "copies" / "kept")


def _write(path, damaged: bytes) -> None:
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.write(damaged)
    os.chmod(path, 0o400)


CHANGES = ["written", "truncated", "chmod", "replaced", "symlink", "hard link", "no record", "other boot", "foreign"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_kept_copy_not_as_it_was_kept_is_not_used(packed, tmp_path, work, monkeypatch, change):
    """Each change leaves bytes that would be served wrong (or a file not the one checked): the index is
    copied and hashed again, the bytes served are the index's, and the copy kept anew is good."""
    original = (packed / "index.bfi").read_bytes()
    copies = IndexCopies(tmp_path / "copies")
    opened(packed, copies)
    digest = digest_of(packed)
    kept = tmp_path / "copies" / "kept" / digest
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    if change == "written":  # in place, the same size, the mode put back
        _write(kept, bytes(damaged))
    elif change == "truncated":
        os.chmod(kept, 0o600)
        os.truncate(kept, len(original) // 2)
        os.chmod(kept, 0o400)
    elif change == "chmod":
        os.chmod(kept, 0o600)
    elif change == "replaced":  # another file, as the kept one was made: 0400, one link, epoch mtime
        other = tmp_path / "copies" / "kept" / "other"
        other.write_bytes(bytes(damaged))
        os.chmod(other, 0o400)
        os.utime(other, ns=(0, 0))
        os.replace(other, kept)
    elif change == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(original)
        kept.unlink()
        kept.symlink_to(elsewhere)
    elif change == "hard link":
        os.link(kept, tmp_path / "another-name")
    elif change == "no record":
        (tmp_path / "copies" / "kept" / (digest + ".id")).unlink()
    elif change == "other boot":
        monkeypatch.setattr(kept_copies, "boot_id", lambda: b"another-boot")
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(kept, 12345, 12345)
    before = dict(work)
    assert opened(packed, copies)[0] == original
    assert work["copied"] == before["copied"] + len(original) and work["hashed"] == before["hashed"] + len(original)
    monkeypatch.undo()
    if change == "hard link":
        assert (tmp_path / "another-name").exists()  # what the other name holds is left alone
    assert not kept.is_symlink() and kept.read_bytes() == original and kept.stat().st_nlink == 1
    if change == "symlink":
        assert (tmp_path / "elsewhere").read_bytes() == original
    assert opened(packed, copies)[0] == original and work["copied"] == before["copied"] + len(original)


def test_at_most_the_bound_is_kept_least_recently_used_first(tmp_path, edge_tree, work):
    datasets = []
    for i in range(4):
        with open(os.path.join(edge_tree, b"one-more"), "wb") as f:
            f.write(b"another file, another index %d" % i)
        blockfs.pack(edge_tree, tmp_path / f"p{i}", block_size=2000)
        datasets.append(tmp_path / f"p{i}")
    size = max((d / "index.bfi").stat().st_size for d in datasets)
    # The copy directory may be one the user keeps other files in: a SHA-256-named one, say (64 hex digits,
    # a kept copy's name without a record), which no sweep of blockfs's may touch.
    (tmp_path / "copies").mkdir(mode=0o700)
    theirs = tmp_path / "copies" / ("ab" * 32)
    theirs.write_bytes(b"the user's")
    copies = IndexCopies(tmp_path / "copies", kept=2)
    digests = [digest_of(d) for d in datasets]
    for d in datasets[:2]:
        opened(d, copies)
    opened(datasets[0], copies)  # used again: now the most recent
    opened(datasets[2], copies)
    kept = {n for n in os.listdir(tmp_path / "copies" / "kept") if not n.endswith(".id")}
    assert kept == {digests[0], digests[2]}
    assert set(os.listdir(tmp_path / "copies" / "kept")) == kept | {d + ".id" for d in kept}

    by_bytes = IndexCopies(tmp_path / "copies", kept=10, kept_bytes=size + size // 2)  # room for one
    opened(datasets[3], by_bytes)
    assert {n for n in os.listdir(tmp_path / "copies" / "kept") if not n.endswith(".id")} == {digests[3]}
    assert theirs.read_bytes() == b"the user's"


def test_keep_none_keeps_nothing_and_uses_nothing_kept(packed, tmp_path, work, monkeypatch):
    original = (packed / "index.bfi").read_bytes()
    opened(packed, IndexCopies(tmp_path / "copies"))  # one kept
    monkeypatch.setenv(kept_copies.KEPT_ENV, "0")
    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(tmp_path / "copies"))
    none = IndexCopies.default()
    assert none is not None and none.kept_count == 0
    before = work["copied"]
    data, where = opened(packed, none)
    assert data == original and work["copied"] == before + len(original)
    assert where is not None and where.endswith("(deleted)")  # an unnamed copy, made O_EXCL: never linked
    opened(packed, IndexCopies(tmp_path / "fresh", kept=0))
    assert os.listdir(tmp_path / "fresh") == []


@pytest.mark.parametrize("value, count", [("", kept_copies.KEPT), ("0", 0), ("7", 7), ("many", kept_copies.KEPT)])
def test_the_count_kept_comes_from_the_environment(monkeypatch, value, count):
    monkeypatch.setenv(kept_copies.KEPT_ENV, value)
    assert kept_copies.kept_count() == count


def test_a_copy_directory_moved_to_another_machine_is_not_believed(packed, tmp_path, work):
    """Its inode numbers and device differ: copied (by cp, which keeps no inode) and refused."""
    original = (packed / "index.bfi").read_bytes()
    opened(packed, IndexCopies(tmp_path / "copies"))
    shutil.copytree(tmp_path / "copies", tmp_path / "moved", copy_function=shutil.copy2)
    before = work["copied"]
    assert opened(packed, IndexCopies(tmp_path / "moved"))[0] == original
    assert work["copied"] == before + len(original)


@pytest.mark.parametrize("keep", ["", "0"], ids=["seeded", "none-kept"])
def test_a_pack_seeds_the_copy_its_first_mount_here_maps(tmp_path, edge_tree, work, monkeypatch, keep):
    """The pack hashes its index from a copy it keeps (it is writing the digest into blockfs.json): the first
    open of the dataset on this machine neither copies nor hashes it.  Keeping none, the pack hashes the
    file and keeps nothing; the digest is the same either way."""
    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(tmp_path / "copies"))
    monkeypatch.setenv(kept_copies.KEPT_ENV, keep)
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "checked"))
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    original = (tmp_path / "p" / "index.bfi").read_bytes()
    assert digest_of(tmp_path / "p") == dg.digest(original).hex()
    # And it ran a mount's checks on that copy, and recorded them: the first mount here skips them too.
    # Keeping no copy, it does not (it would read the whole index into its memory): the mount checks.
    assert CheckedIndexes(tmp_path / "checked").has(digest_of(tmp_path / "p")) == (not keep)
    listed = sorted(os.listdir(tmp_path / "copies" / "kept")) if (tmp_path / "copies" / "kept").exists() else []
    assert listed == ([digest_of(tmp_path / "p"), digest_of(tmp_path / "p") + ".id"] if not keep else [])
    before = dict(work)
    monkeypatch.delenv(kept_copies.KEPT_ENV)
    copies, checked = IndexCopies(tmp_path / "copies"), CheckedIndexes(tmp_path / "checked")
    with PackedDataset(tmp_path / "p", copies=copies, checked=checked) as ds:  # as a mount opens it
        assert bytes(ds.index.raw) == original
        assert ds.index.checks_skipped == (not keep)
    copied = work["copied"] - before["copied"]
    assert copied == (0 if not keep else len(original))


def _resident_kib(address: int) -> int:
    """This process's resident KiB of the mapping holding ``address`` (``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head[0]) > 8 and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start <= address < end
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError("no mapping holds the index")


def test_a_packs_checks_leave_no_page_of_the_index_in_its_map(tmp_path, monkeypatch):
    """The pack checks the copy it kept as a mount would (so the first mount here skips the checks), and
    drops the pages each piece touched from its map after it: its resident memory never holds the whole
    index (1.5 GB at 10 M files, over the pack's own peak).  One thread, so no piece runs meanwhile."""
    from blockfs.core import index_checks, treecheck
    from blockfs.packing import destination

    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(tmp_path / "copies"))
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "checked"))
    monkeypatch.setattr(treecheck, "THREADS", 1)
    monkeypatch.setattr(treecheck, "PIECE", 64)
    monkeypatch.setattr(index_checks, "VALIDATE_PIECE", 64)
    resident: list[int] = []
    real = destination.check_contents

    def watched(arrays, where, n_blocks, release):
        address = arrays["paths"].ctypes.data  # inside the map of the kept copy

        def measured() -> None:
            release()
            resident.append(_resident_kib(address))

        real(arrays, where, n_blocks, measured)

    monkeypatch.setattr(destination, "check_contents", watched)
    for d in range(8):  # ~500 entries: pieces of 64
        (tmp_path / "src" / f"d{d}").mkdir(parents=True)
        for f in range(60):
            (tmp_path / "src" / f"d{d}" / f"f{f:03}").write_bytes(b"x" * f)
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=4096)
    entries = PackedDataset(tmp_path / "p").index.n_entries
    assert CheckedIndexes(tmp_path / "checked").has(digest_of(tmp_path / "p"))
    assert len(resident) >= 4 * (entries // 64)  # after every piece of the four checks in pieces
    assert set(resident) == {0}


def test_an_index_that_fails_the_packs_checks_is_not_recorded_and_the_pack_stands(
    tmp_path, edge_tree, monkeypatch, caplog
):
    from blockfs.core import index_checks
    from blockfs.errors import IndexFormatError

    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(tmp_path / "copies"))
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "checked"))

    def forged(a, where, release=None):
        raise IndexFormatError(f"{where}: array 'block_files' is not in slot order (forged for the test)")

    monkeypatch.setattr(index_checks, "check_block_layout", forged)
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    assert not CheckedIndexes(tmp_path / "checked").has(digest_of(tmp_path / "p"))
    assert "fails a mount's checks" in caplog.text and "forged for the test" in caplog.text
    monkeypatch.undo()
    with PackedDataset(tmp_path / "p") as ds:  # the dataset is committed and opens (the real checks pass)
        assert ds.index.n_entries > 1


def test_a_packs_seed_leaves_no_page_of_the_copy_in_its_map(tmp_path, edge_tree, monkeypatch):
    """The pack only hashes the copy it keeps: each hashed piece's pages leave its map at once, so the
    pack's resident memory never holds the whole index (1.5 GB at 10 M files: over its own peak)."""
    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(tmp_path / "copies"))
    monkeypatch.setattr(index_copy, "PIECE", 4096)  # many pieces, one page each
    dropped: list[tuple[int, int]] = []
    real = index_copy._unmapper

    def watched(held):
        drop = real(held)

        def record(start: int, end: int) -> None:
            dropped.append((start, end))
            drop(start, end)

        return record

    monkeypatch.setattr(index_copy, "_unmapper", watched)
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000)
    size = (tmp_path / "p" / "index.bfi").stat().st_size
    assert len(os.listdir(tmp_path / "copies" / "kept")) == 2  # kept
    assert size > 4096 and len(dropped) >= size // 4096
    covered = 0
    for start, end in sorted(dropped):
        assert start <= covered < end
        covered = end
    assert covered == size


def test_a_copy_is_named_and_recorded_only_once_synced_and_serves_meanwhile(packed, tmp_path, monkeypatch):
    """The copy is synced (fdatasync) before its name and record are made, on a thread: the open does not wait
    for it, and its map serves meanwhile.  Before, the record was written at once over pages not yet on disk."""
    started, go = threading.Event(), threading.Event()
    real = os.fdatasync

    def held(fd: int) -> None:
        started.set()
        assert go.wait(60)
        real(fd)

    monkeypatch.setattr(kept_copies, "_sync", held, raising=False)
    original = (packed / "index.bfi").read_bytes()
    kept = tmp_path / "copies" / "kept"
    try:
        with PackedDataset(packed, copies=IndexCopies(tmp_path / "copies")) as ds:
            assert os.listdir(kept) == []  # neither name nor record before the sync
            assert bytes(ds.index.raw) == original and ds.index.find(ds.index.path(1)) == 1
            wait_until(started.is_set, "the copy's sync to start")
            assert os.listdir(kept) == []
            go.set()
            kept_copies.wait_kept()
            assert sorted(os.listdir(kept)) == [digest_of(packed), digest_of(packed) + ".id"]
            assert bytes(ds.index.raw) == original
    finally:
        go.set()
        kept_copies.wait_kept()
    assert opened(packed, IndexCopies(tmp_path / "copies"))[1] == os.path.realpath(kept / digest_of(packed))


def test_a_mounts_keep_writes_back_once_it_serves(packed, tmp_path, monkeypatch):
    """Between ``defer_syncs`` (a mount's server, as it starts) and ``allow_syncs`` (once it serves), a keep
    waits before its write-back: its CPU (~0.7 s at 10 M files) no longer lengthens the start-up."""
    synced, waiting = threading.Event(), threading.Event()
    real_sync, real_gate = os.fdatasync, kept_copies._may_sync

    class Gate:
        def wait(self, timeout: float) -> bool:
            waiting.set()
            return real_gate.wait(timeout)

        def set(self) -> None:
            real_gate.set()

    def sync(fd: int) -> None:
        synced.set()
        real_sync(fd)

    monkeypatch.setattr(kept_copies, "_sync", sync)
    monkeypatch.setattr(kept_copies, "_may_sync", Gate())
    real_gate.clear()  # as kept_copies.defer_syncs() does
    try:
        with PackedDataset(packed, copies=IndexCopies(tmp_path / "copies")) as ds:
            wait_until(waiting.is_set, "the keep to wait for the mount to serve")
            assert not synced.is_set() and os.listdir(tmp_path / "copies" / "kept") == []
            assert ds.index.find(ds.index.path(1)) == 1
            real_gate.set()  # as kept_copies.allow_syncs() does, once the mount serves
            wait_until(synced.is_set, "the write-back once allowed")
    finally:
        real_gate.set()
        kept_copies.wait_kept()
    assert len(os.listdir(tmp_path / "copies" / "kept")) == 2


def test_a_copy_whose_sync_fails_is_not_kept(packed, tmp_path, monkeypatch, caplog):
    """A write-back error (EIO; ENOSPC on a thin disk) leaves pages that read back as other bytes once the
    kernel drops them: such a copy is never named for a later mount; this one serves from its map."""

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(kept_copies, "_sync", failing, raising=False)
    original = (packed / "index.bfi").read_bytes()
    assert opened(packed, IndexCopies(tmp_path / "copies"))[0] == original
    assert os.listdir(tmp_path / "copies" / "kept") == []
    assert "not kept for the next mount: Input/output error" in caplog.text


def _unnamed_copy(dir_fd: int, data: bytes) -> int:
    """An unnamed file of ``dir_fd`` holding ``data``, made as IndexCopies.hold makes a copy to keep."""
    fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o400, dir_fd=dir_fd)
    os.write(fd, data)
    os.fchmod(fd, 0o400)
    return fd


@pytest.fixture
def kept_dir(tmp_path):
    (tmp_path / "kept").mkdir(mode=0o700)
    fd = os.open(tmp_path / "kept", os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_a_second_keep_of_the_same_index_leaves_the_valid_copy_kept(kept_dir):
    data = b"the same index, copied by two mounts of it"
    digest = dg.digest(data).hex()
    first, second = _unnamed_copy(kept_dir, data), _unnamed_copy(kept_dir, data)
    try:
        kept_copies.keep(kept_dir, first, digest)
        kept_copies.wait_kept()
        kept_copies.keep(kept_dir, second, digest)
        kept_copies.wait_kept()
        found = kept_copies.find(kept_dir, digest)
        assert found is not None
        assert os.fstat(found).st_ino == os.fstat(first).st_ino  # the first stays: a live mount may map it
        os.close(found)
    finally:
        os.close(first)
        os.close(second)


def test_concurrent_keeps_of_the_same_index_leave_one_valid_copy(kept_dir, monkeypatch):
    """The first keeper stopped between naming its copy and recording it, the second keeps the same digest:
    it unlinked the first's fresh copy as stale and named its own, and the first's record, written last,
    then matched no copy (the next mount copied again).  Now the directory's lock orders them."""
    data = b"the same index, copied by two mounts at once"
    digest = dg.digest(data).hex()
    recording, go = threading.Event(), threading.Event()
    real_write, real_locked = kept_copies.write_file_at, getattr(kept_copies, "_locked", None)
    locking: list[str] = []

    def slow_first_record(*args, **kwargs):
        if not recording.is_set():
            recording.set()
            assert go.wait(60)
        return real_write(*args, **kwargs)

    def watched_lock(dir_fd):
        locking.append(threading.current_thread().name)
        return real_locked(dir_fd)

    monkeypatch.setattr(kept_copies, "write_file_at", slow_first_record)
    monkeypatch.setattr(kept_copies, "_locked", watched_lock, raising=False)
    first, second = _unnamed_copy(kept_dir, data), _unnamed_copy(kept_dir, data)
    keepers: list[threading.Thread] = []

    def keeper(copy: int) -> threading.Thread:
        def keep() -> None:
            kept_by = kept_copies.keep(kept_dir, copy, digest)
            getattr(kept_by, "join", lambda: None)()  # a thread of its own names it (the old code: done)

        thread = threading.Thread(target=keep)
        thread.start()
        return thread

    try:
        keepers.append(keeper(first))
        wait_until(recording.is_set, "the first keeper to name its copy")
        keepers.append(keeper(second))
        # The second has kept its copy, or waits for the lock the first holds.
        wait_until(lambda: len(locking) >= 2 or not keepers[-1].is_alive(), "the second keeper")
        if len(locking) < 2:
            keepers[-1].join(60)
    finally:
        go.set()
        for keeper in keepers:
            keeper.join(60)
        kept_copies.wait_kept()
    try:
        found = kept_copies.find(kept_dir, digest)
        assert found is not None, os.listdir(kept_dir)
        os.close(found)
    finally:
        os.close(first)
        os.close(second)


def _server_index_map(pid: int, copies) -> str:
    """The file the server maps from ``copies`` (its index: the unnamed copy it made, or a kept one)."""
    where = os.path.realpath(copies) + "/"
    with open(f"/proc/{pid}/maps") as f:
        found = {" ".join(line.split()[5:]) for line in f if where in line}
    assert len(found) == 1, found
    return found.pop()


@pytest.mark.fuse
def test_a_remount_serves_from_the_kept_copy_and_a_changed_one_is_copied_again(tmp_path, edge_tree, monkeypatch):
    """Through a real mount (the route BLOCKFS_FUSE names): the first mount copies the index and keeps the
    copy, the second maps that copy by its name, and after the kept copy is written the third copies again;
    every mount reads every file right."""
    from capability import has_fuse, require
    from mountutil import mounted

    require(has_fuse(), "needs FUSE")
    copies = tmp_path / "copies"
    monkeypatch.setenv(index_copy.DIRECTORY_ENV, str(copies))
    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "checked"))
    monkeypatch.setenv(kept_copies.KEPT_ENV, "0")  # the pack seeds nothing: the first mount copies
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000, fsync=False)
    monkeypatch.delenv(kept_copies.KEPT_ENV)
    digest = digest_of(tmp_path / "p")
    kept = copies / "kept" / digest
    sources = {
        os.path.relpath(os.path.join(d, f), edge_tree): os.path.join(d, f)
        for d, _, fs in os.walk(edge_tree)
        for f in fs
        if not os.path.islink(os.path.join(d, f))
    }

    def mount_and_read(n: int) -> str:
        with mounted(tmp_path / "p", tmp_path / f"mnt{n}") as m:
            where = _server_index_map(m.pid, copies)
            for rel, src in sources.items():
                with open(src, "rb") as a, open(os.path.join(os.fsencode(m.path), os.fsencode(rel)), "rb") as b:
                    assert a.read() == b.read(), rel
        return where

    assert mount_and_read(1).endswith("(deleted)") and kept.exists()
    assert mount_and_read(2) == os.path.realpath(kept)
    damaged = bytearray(kept.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    _write(kept, bytes(damaged))
    assert mount_and_read(3).endswith("(deleted)")
    assert dg.digest(kept.read_bytes()).hex() == digest  # kept anew
