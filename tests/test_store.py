"""blockfs.core.store: verified block reads, blocks checked against the index, failed reads told from damage."""

from __future__ import annotations

import errno
import os
import random
import shutil

import pytest
from capability import require
from fuzz.indexutil import patch_array, resign
from pagecache import resident_pages

import blockfs
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.core.verify import verify
from blockfs.errors import BlockReadError, CorruptBlockError, IndexFormatError

FILES = 400


def make_tree(root, seed: int = 0, files: int = FILES) -> dict[str, bytes]:
    rng = random.Random(seed)
    contents = {}
    for i in range(files):
        rel = f"class{i % 4}/f{i:04d}.bin"
        data = rng.randbytes(rng.randint(100, 5000))
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        contents[rel] = data
    return contents


def pack(src, dest, seed: int = 0, **kw) -> None:
    blockfs.pack(src, dest, files_per_block=100, seed=seed, fsync=False, **kw)


@pytest.fixture(scope="module")
def two_packs(tmp_path_factory):
    """A tree packed twice with different seeds (issue 17's reproduction): same files, other blocks."""
    root = tmp_path_factory.mktemp("store")
    contents = make_tree(root / "src")
    pack(root / "src", root / "A", seed=0)
    pack(root / "src", root / "B", seed=1)
    return root, contents


@pytest.fixture
def dest(two_packs, tmp_path):
    """A fresh copy of pack A (tests damage it)."""
    root, _contents = two_packs
    shutil.copytree(root / "A", tmp_path / "A")
    return tmp_path / "A"


def read_all(ds: PackedDataset, contents: dict[str, bytes]) -> tuple[dict[str, Exception], int]:
    """Every file read once: the failures by path, and how many files came back with wrong bytes."""
    failures, wrong = {}, 0
    for rel, data in contents.items():
        try:
            wrong += ds.read(rel) != data
        except (CorruptBlockError, BlockReadError) as e:
            failures[rel] = e
    return failures, wrong


def in_block(ds: PackedDataset, block: int) -> set[str]:
    return {os.fsdecode(p) for p in ds.files_in_block(block)}


def rewrite_index_column(dest, name: str, transform) -> None:
    """Change one array of the index and re-sign the metadata's index CRC, as a hostile writer would."""
    patch_array(dest / fmt.INDEX_NAME, name, transform)
    resign(dest)


# --- a block must belong to this index ------------------------------------------------------------------
def test_a_block_from_another_pack_is_never_served(two_packs, dest):
    root, contents = two_packs
    shutil.copy(root / "B" / "blocks" / "00000000.blk", dest / "blocks" / "00000000.blk")
    with PackedDataset(dest) as ds:
        failures, wrong = read_all(ds, contents)
        assert wrong == 0
        assert set(failures) == in_block(ds, 0)  # every file of the foreign block fails; no other file
        e = next(iter(failures.values()))
        assert isinstance(e, CorruptBlockError) and e.block == 0 and e.errno == errno.EIO
        assert "does not belong to this dataset" in str(e) and "pack it again" in str(e)


def test_a_block_with_the_same_sizes_but_other_bytes_is_refused(tmp_path):
    """Only the data checksum tells these apart: it is the CRC of the files' CRCs, the index holds each."""
    contents = make_tree(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "A")
    victim = "class1/f0001.bin"
    changed = bytearray(contents[victim])
    changed[0] ^= 0xFF
    (tmp_path / "src" / victim).write_bytes(bytes(changed))
    pack(tmp_path / "src", tmp_path / "B")  # the same seed: the same layout, one file's bytes differ
    with PackedDataset(tmp_path / "A") as ds:
        block = ds.stat(victim).block
    shutil.copy(fmt.block_path(tmp_path / "B", block), fmt.block_path(tmp_path / "A", block))
    with PackedDataset(tmp_path / "A") as ds:
        failures, wrong = read_all(ds, contents)
        assert wrong == 0 and set(failures) == in_block(ds, block)
        assert "checksums differ" in str(failures[victim])


def test_a_block_with_other_labels_is_refused(tmp_path):
    contents = make_tree(tmp_path / "src", files=40)
    labels = tmp_path / "labels.csv"
    labels.write_text("".join(f"{rel},{i % 3}\n" for i, rel in enumerate(sorted(contents))))
    pack(tmp_path / "src", tmp_path / "A", labels=str(labels))
    labels.write_text("".join(f"{rel},{(i + 1) % 3}\n" for i, rel in enumerate(sorted(contents))))
    pack(tmp_path / "src", tmp_path / "B", labels=str(labels))
    shutil.copy(fmt.block_path(tmp_path / "B", 0), fmt.block_path(tmp_path / "A", 0))
    with PackedDataset(tmp_path / "A") as ds:
        with pytest.raises(CorruptBlockError, match="labels differ"):
            ds.store.header(0)


def test_hard_links_keep_their_own_labels_and_their_block_still_belongs(tmp_path, edge_tree):
    blockfs.pack(edge_tree, tmp_path / "p", block_size=2000, fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        a = ds.index.arrays
        link = ds.lookup("class_c/hardlink_to_one")
        assert a["label"][link] != a["label"][ds.lookup("class_a/one.txt")]  # a label of its own
        for block in range(ds.n_blocks):
            ds.store.header(block)  # every block belongs
        assert ds.read("class_c/hardlink_to_one") == b"hello\n"


def test_a_size_flipped_in_the_index_fails_the_read_instead_of_cutting_the_file(dest, two_packs):
    _root, contents = two_packs
    with PackedDataset(dest) as ds:
        victim = ds.lookup("class2/f0002.bin")
        block = ds.stat_entry(victim).block
    rewrite_index_column(dest, "size", lambda size: size.__setitem__(victim, size[victim] ^ 0x40))
    with PackedDataset(dest) as ds:
        failures, wrong = read_all(ds, contents)
        assert wrong == 0 and "class2/f0002.bin" in failures
        assert set(failures) == in_block(ds, block)
        assert "the index says" in str(failures["class2/f0002.bin"])


def test_read_entry_checks_the_size_of_an_entry_the_layout_does_not_list(dest, two_packs, monkeypatch):
    """A hostile index can point an entry the block's layout does not list at another file's slot, with
    that file's CRC and a shorter size: the block still belongs, so the read must check the size itself."""
    with PackedDataset(dest) as ds:
        a = ds.index.arrays
        target = ds.lookup("class2/f0002.bin")
        stranger = next(e for e in ds.file_ids if a["block"][e] != a["block"][target])
        columns = {name: a[name][target] for name in ("block", "slot", "crc")}
        columns["size"] = a["size"][target] - 1
        path = os.fsdecode(ds.path_of(int(stranger)))
    for name, value in columns.items():
        rewrite_index_column(dest, name, lambda arr, value=value: arr.__setitem__(stranger, value))
    # The index's own layout check refuses it at open; were it opened, the read's size check would.
    with pytest.raises(IndexFormatError, match="block_files"):
        PackedDataset(dest)
    monkeypatch.setattr("blockfs.core.index_checks.check_block_layout", lambda a, where, release=None: None)
    monkeypatch.setattr("blockfs.core.index_checks.check_tree", lambda a, where, release=None: None)
    with PackedDataset(dest) as ds:
        with pytest.raises(CorruptBlockError, match="the index says"):
            ds.read(path)


# --- sizes are checked before they are trusted ----------------------------------------------------------
def test_a_header_claiming_billions_of_files_is_refused_before_any_big_read(dest, monkeypatch):
    path = fmt.block_path(dest, 1)
    with open(path, "r+b") as f:
        f.seek(fmt.PREAMBLE_SIZE)
        f.write((2**32 - 1).to_bytes(4, "little"))  # the file count
    size = os.path.getsize(path)
    asked = []
    real_pread = os.pread

    def pread(fd, n, offset):
        asked.append(n)
        if n > size:
            raise AssertionError(f"asked for {n} bytes of a {size}-byte block file")
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    with PackedDataset(dest) as ds:
        with pytest.raises(CorruptBlockError, match="truncated or damaged header") as raised:
            ds.store.header(1)
        assert raised.value.block == 1 and max(asked) <= size
        problems = verify(ds)  # verify reports the block and goes on
        assert [p.what for p in problems] == ["block 1"] and "damaged header" in problems[0].message


def test_a_truncated_block_is_damaged(dest):
    path = fmt.block_path(dest, 2)
    os.truncate(path, os.path.getsize(path) - 10)
    with PackedDataset(dest) as ds:
        with pytest.raises(CorruptBlockError, match="truncated"):
            ds.store.header(2)


# --- failed reads are not damage ---------------------------------------------------------------------
def test_a_missing_block_file_is_a_failed_read_and_the_next_read_tries_again(dest, two_packs):
    _root, contents = two_packs
    path = fmt.block_path(dest, 3)
    with PackedDataset(dest) as ds:
        name = sorted(in_block(ds, 3))[0]
        os.rename(path, f"{path}.away")
        with pytest.raises(BlockReadError) as raised:
            ds.read(name)
        e = raised.value
        assert not isinstance(e, CorruptBlockError) and isinstance(e, OSError)
        assert e.errno == errno.EIO and e.block == 3 and "cannot open" in str(e) and name in str(e)
        os.rename(f"{path}.away", path)
        assert ds.read(name) == contents[name]


def test_a_block_file_replaced_while_open_is_read_again_from_its_path(dest, two_packs):
    """After a failed read the store drops its descriptor: the next read opens the file afresh."""
    _root, contents = two_packs
    path = fmt.block_path(dest, 3)
    with PackedDataset(dest) as ds:
        name = sorted(in_block(ds, 3))[0]
        assert ds.read(name) == contents[name]  # the descriptor is open now
        shutil.copy(path, f"{path}.good")
        os.truncate(path, fmt.PREAMBLE_SIZE)  # cut under the open descriptor
        with pytest.raises(BlockReadError, match="the file ends"):
            ds.read(name)
        os.rename(f"{path}.good", path)  # a new file at the path
        assert ds.read(name) == contents[name]


def test_out_of_descriptors_fails_the_read_and_the_next_one_succeeds(dest, two_packs, monkeypatch):
    _root, contents = two_packs
    real_open = os.open
    refuse = {"on": True}

    def open_(path, flags, *args, **kw):
        if refuse["on"] and os.fsdecode(path).endswith(".blk"):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_)
    with PackedDataset(dest) as ds:
        name = sorted(in_block(ds, 0))[0]
        with pytest.raises(BlockReadError, match="Too many open files"):
            ds.read(name)
        refuse["on"] = False
        assert ds.read(name) == contents[name]


def test_emfile_closes_idle_descriptors_and_opens_again(dest, two_packs, monkeypatch):
    _root, contents = two_packs
    with PackedDataset(dest) as ds:
        names = [sorted(in_block(ds, b))[0] for b in range(ds.n_blocks)]
        assert ds.read(names[0]) == contents[names[0]]  # block 0's descriptor is open and idle
        real_open = os.open
        refusals = []

        def open_once(path, flags, *args, **kw):
            if not refusals:
                refusals.append(path)
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", open_once)
        assert ds.read(names[1]) == contents[names[1]]
        assert refusals and ds.read(names[0]) == contents[names[0]]  # block 0 reopened


def test_an_io_error_from_the_device_is_a_failed_read(dest, two_packs, monkeypatch):
    _root, contents = two_packs
    with PackedDataset(dest) as ds:
        head = ds.store.header(1)
        buf = bytearray(head.data_size)
        real = os.preadv
        calls = []

        def failing_once(fd, buffers, offset):
            calls.append(offset)
            if len(calls) == 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", failing_once)
        with pytest.raises(BlockReadError, match="read failed: Input/output error"):
            ds.store.read_data_into(1, head, buf)
        crcs = ds.store.read_data_into(1, head, buf)  # the same call again: it reads, nothing remembered
        assert crcs.tolist() == ds.store.index_crcs(1).tolist()
        first = sorted(in_block(ds, 1))[0]
        stat = ds.stat(first)
        a = ds.index.arrays
        start = int(head.offsets[int(a["slot"][stat.entry])])
        assert bytes(buf[start : start + stat.size]) == contents[first]


# --- whole blocks into the caller's memory -------------------------------------------------------------
def test_read_data_into_fills_the_callers_buffer_and_returns_the_file_crcs(dest):
    with PackedDataset(dest) as ds:
        head = ds.store.header(0)
        buf = bytearray(head.data_size)
        crcs = ds.store.read_data_into(0, head, buf)
        with open(fmt.block_path(dest, 0), "rb") as f:
            f.seek(head.data_start)
            assert bytes(buf) == f.read()
        assert crcs.tolist() == ds.store.index_crcs(0).tolist()
        with pytest.raises(ValueError, match="buffer"):
            ds.store.read_data_into(0, head, bytearray(head.data_size - 1))


def test_a_damaged_data_byte_fails_the_whole_block_read_and_only_its_file_alone(dest, two_packs):
    _root, contents = two_packs
    with PackedDataset(dest) as ds:
        head = ds.store.header(1)
        victim = ds.files_in_block(1)[0]
    with open(fmt.block_path(dest, 1), "r+b") as f:
        f.seek(head.data_start + int(head.offsets[0]))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with PackedDataset(dest) as ds:
        with pytest.raises(CorruptBlockError, match="data checksum mismatch"):
            ds.store.verified_crcs(1)
        failures, wrong = read_all(ds, contents)  # the store reads files alone, each by its own CRC
        assert wrong == 0 and set(failures) == {os.fsdecode(victim)}


def test_a_big_file_read_in_pieces_is_verified_once(tmp_path, monkeypatch):
    import blockfs.core.store as store_module

    monkeypatch.setattr(store_module, "VERIFY_PIECE", 64 << 10)
    data = os.urandom(300_000)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with PackedDataset(tmp_path / "p") as ds:
        e = ds.lookup("big.bin")
        block, slot, crc = (int(ds.index.arrays[k][e]) for k in ("block", "slot", "crc"))
        assert ds.store.verify_file(block, slot, crc) == len(data)
        assert ds.store.verify_file(block, slot, crc) == 0  # remembered
        got = b"".join(ds.read("big.bin", off, 50_000) for off in range(0, len(data), 50_000))
        assert got == data
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            ds.store.verify_file(block, slot, crc ^ 1)


@pytest.fixture
def cold_block(tmp_path):
    """(dataset, block file) of one block of 48 files of ~64 KiB, none of its pages in the page cache."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(5)
    for i in range(48):
        (src / f"f{i:02d}.bin").write_bytes(rng.randbytes(60_000 + rng.randint(0, 8000)))
    blockfs.pack(src, tmp_path / "packed", fsync=False)  # one block of ~3 MiB
    path = fmt.block_path(tmp_path / "packed", 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only: those are what DONTNEED drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    require(not any(resident_pages(path)), "a filesystem that drops a file's pages (not tmpfs)")
    return tmp_path / "packed", path


def read_alone(dest, slots) -> tuple[set[int], set[int], list[bool]]:
    """Read the files in ``slots`` of block 0 alone, in this order: (the pages of the header, the pages of
    those files, the pages of the block file in the page cache afterwards)."""
    import mmap

    page = mmap.PAGESIZE
    with PackedDataset(dest) as ds:
        a = ds.index.arrays
        head = ds.store.header(0)
        wanted = set(range(-(-head.data_start // page)))
        for slot in slots:
            e = int(a["block_files"][int(a["block_offsets"][0]) + slot])
            ds.store.read_file(0, slot, int(a["crc"][e]))
            start = head.data_start + int(head.offsets[slot])
            wanted |= set(range(start // page, (start + int(head.sizes[slot]) - 1) // page + 1))
        return set(range(-(-head.data_start // page))), wanted, resident_pages(fmt.block_path(dest, 0))


def test_files_read_alone_in_any_order_bring_no_other_file_of_their_block_from_the_disk(cold_block):
    """Issue 29, item 10: a cache-once epoch read 0.58-0.62 of the dataset from the disk where the mount
    read 0.50 — once a file's neighbours were cached, the kernel's readahead took the reads around it for a
    stream and fetched the files after it, which are retained or in cached blocks and never read from
    storage.  Files read alone here fill a run of the block out of order, the last one after the run:
    only their own pages and the header's are read."""
    dest, _ = cold_block
    _, wanted, resident = read_alone(dest, [10, 12, 14, 11, 13, 15])
    beyond = [p for p, r in enumerate(resident) if r and p not in wanted]
    assert not beyond, f"{len(beyond)} pages of other files read from the disk (pages {beyond[:5]}...)"


def test_files_read_alone_in_the_blocks_order_are_read_ahead(cold_block):
    """The stream the kernel's readahead was for (a tree packed in directory order and read in order, a
    big file read in windows) is still read ahead: the disk gets large requests, not one per file."""
    dest, _ = cold_block
    _, wanted, resident = read_alone(dest, range(10, 16))
    after = max(wanted) + 1
    assert all(resident[after : after + 64]), "the next 256 KiB after a stream of six files"
