"""Issue 23: a dataset you can pin.  A file changed with its CRC fixed up (``forgery.forge``) passes every
CRC-32 check, so these tests fail on a blockfs without digests; with them it is refused on every path, a
wrong ``--expect`` is one line naming both names, and a dataset packed before digests still opens."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import zlib
from pathlib import Path

import pytest
from capability import has_fuse, require
from fuzz.forgery import forge
from fuzz.indexutil import strip_digests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockfs
from blockfs import cli
from blockfs.core import digest as dg
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.errors import BlockfsError, CorruptBlockError, IdentityError

VICTIM = "class1/f0007.bin"


def make_tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(23)
    contents = {}
    for i in range(30):
        rel = f"class{i % 3}/f{i:04d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(40, 3000))
        (root / rel).write_bytes(data)
        os.utime(root / rel, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
        contents[rel] = data
    return contents


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    contents = make_tree(root / "src")
    result = blockfs.pack(root / "src", root / "pristine", files_per_block=8, fsync=False)
    return root, contents, result.digest


@pytest.fixture
def dest(packed, tmp_path) -> Path:
    root, _, _ = packed
    shutil.copytree(root / "pristine", tmp_path / "ds")
    return tmp_path / "ds"


def forge_file(dest: Path, rel: str) -> bytes:
    """Change ``rel``'s bytes in its block file, its CRC-32 kept: every CRC check of the block still passes.
    Returns the block file's new bytes."""
    with PackedDataset(dest) as ds:
        e = ds.lookup(rel)
        block, slot = int(ds.index.arrays["block"][e]), int(ds.index.arrays["slot"][e])
        head = ds.store.header(block)
    path = fmt.block_path(dest, block)
    raw = bytearray(Path(path).read_bytes())
    start = head.data_start + int(head.offsets[slot])
    size = int(head.sizes[slot])
    raw[start : start + size] = forge(bytes(raw[start : start + size]))
    Path(path).write_bytes(bytes(raw))
    return bytes(raw)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(args)
    out, err = capsys.readouterr()
    return rc, out, err


# --- the forgery itself, and that CRC-32 alone does not see it ------------------------------------------
def test_without_digests_a_crc_forged_file_is_served(dest, packed):
    """Today's format: the forged bytes pass every CRC and are served (what the digests are for)."""
    _, contents, _ = packed
    forge_file(dest, VICTIM)
    strip_digests(dest)
    with blockfs.open_dataset(dest) as ds:
        got = ds.read(VICTIM)
    assert got != contents[VICTIM] and zlib.crc32(got) == zlib.crc32(contents[VICTIM])


# --- every path refuses it ----------------------------------------------------------------------------
def test_cat_refuses_a_crc_forged_file_in_one_line(dest, packed, capsys):
    _, contents, name = packed
    forge_file(dest, VICTIM)
    for pin in ([], ["--expect", name]):
        rc, out, err = run_cli(["cat", *pin, str(dest), VICTIM], capsys)
        assert rc == 2 and out == "" and "checksum mismatch" in err and len(err.strip().splitlines()) == 1
    other = next(r for r in contents if r != VICTIM and not r.startswith("class1"))
    with blockfs.open_dataset(dest, expect=name) as ds:
        assert ds.read(other) == contents[other]  # only the forged file's reads fail


def test_unpack_and_verify_refuse_a_crc_forged_file(dest, packed, tmp_path, capsys):
    _, _, name = packed
    forge_file(dest, VICTIM)
    rc, out, err = run_cli(["verify", "--expect", name, str(dest)], capsys)
    assert rc == 1 and "BAD block" in out and VICTIM in out
    named = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    assert named == [VICTIM]  # the forged file, not every file of its block
    rc, out, err = run_cli(["unpack", "--expect", name, str(dest), str(tmp_path / "out")], capsys)
    assert rc == 2 and "checksum mismatch" in err
    assert not (tmp_path / "out" / VICTIM).exists() or (tmp_path / "out" / VICTIM).read_bytes() != forge(b"x" * 8)


def test_a_whole_block_read_refuses_it_and_so_does_a_file_read_alone(dest, packed):
    _, contents, name = packed
    forge_file(dest, VICTIM)
    with blockfs.open_dataset(dest, expect=name) as ds:
        block = ds.stat(VICTIM).block
        with pytest.raises(CorruptBlockError, match="data checksum mismatch"):
            ds.store.verified_crcs(block)
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            ds.read(VICTIM)


# --- the remote store and the disk tier ------------------------------------------------------------------
def test_a_remote_block_forged_in_the_bucket_is_refused(s3, packed, tmp_path):
    from s3server import upload_tree

    root, contents, name = packed
    bucket = s3.new_bucket()
    upload_tree(s3, bucket, "ds", root / "pristine")
    local = tmp_path / "copy"
    shutil.copytree(root / "pristine", local)
    forged = forge_file(local, VICTIM)
    with PackedDataset(local) as ds:
        block = ds.stat(VICTIM).block
    s3.client().put_object(Bucket=bucket, Key=f"ds/blocks/{block:08d}.blk", Body=forged)
    url = f"s3://{bucket}/ds"
    for cache in (None, tmp_path / "disk"):
        kwargs = {"disk_cache": cache, "disk_cache_size": 1 << 30} if cache else {}
        with blockfs.open_dataset(url, expect=name, **kwargs) as ds:
            with pytest.raises(CorruptBlockError, match="checksum mismatch"):
                ds.read(VICTIM)
            with pytest.raises(CorruptBlockError, match="checksum mismatch"):
                ds.store.verified_crcs(block)
            if cache:
                assert not ds.disk_tier.has(block)  # nothing forged is kept in any tier


def test_a_poisoned_disk_tier_copy_is_refused_and_replaced(s3, packed, tmp_path):
    from s3server import upload_tree

    root, contents, name = packed
    bucket = s3.new_bucket()
    upload_tree(s3, bucket, "ds", root / "pristine")
    url, cache = f"s3://{bucket}/ds", tmp_path / "disk"
    with blockfs.open_dataset(url, expect=name, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        block = ds.stat(VICTIM).block
        ds.store.verified_crcs(block)  # the tier keeps a copy
        copy = Path(ds.disk_tier.path(block))
        assert copy.exists()
    good = copy.read_bytes()
    local = tmp_path / "copy"
    shutil.copytree(root / "pristine", local)
    copy.write_bytes(forge_file(local, VICTIM))  # a shared cache directory written by someone else
    with blockfs.open_dataset(url, expect=name, disk_cache=cache, disk_cache_size=1 << 30) as ds:
        assert ds.read(VICTIM) == contents[VICTIM]  # refused, read from the store
        ds.store.verified_crcs(block)  # a whole read puts a good copy back
        assert ds.disk_tier.has(block)
    assert copy.read_bytes() == good


# --- pins -------------------------------------------------------------------------------------------------
def test_a_wrong_expect_is_refused_in_one_line_naming_both(dest, packed, capsys):
    _, _, name = packed
    wrong = "blake3:" + "ab" * 32
    for command in (
        ["cat", "--expect", wrong, str(dest), VICTIM],
        ["verify", "--expect", wrong, str(dest)],
        ["unpack", "--expect", wrong, str(dest), str(dest.parent / "out")],
    ):
        rc, out, err = run_cli(command, capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and name in err and wrong in err, command
    with pytest.raises(IdentityError, match=wrong):
        blockfs.open_dataset(dest, expect=wrong)
    with blockfs.open_dataset(dest, expect=name.removeprefix("blake3:").upper()) as ds:  # bare hex works too
        assert ds.digest == name


def test_changed_metadata_changes_the_name_and_a_pin_refuses_it(dest, packed):
    _, _, name = packed
    meta = dest / fmt.METADATA_NAME
    meta.write_bytes(meta.read_bytes().replace(b'"seed": 0', b'"seed": 1'))
    with blockfs.open_dataset(dest) as ds:
        assert ds.digest != name
    with pytest.raises(IdentityError, match="not the pinned"):
        blockfs.open_dataset(dest, expect=name)


def test_a_dataset_with_no_name_is_refused_under_a_pin_in_words():
    # A mount's control directory without metadata gives the loader no name: the refusal says so (it said
    # "is None").
    pin = "blake3:" + "0" * 64
    with pytest.raises(IdentityError, match="has no name") as refused:
        dg.check_name("the dataset mounted at /mnt", None, pin)
    assert "None" not in str(refused.value) and pin in str(refused.value)
    dg.check_name("the dataset mounted at /mnt", None, None)  # nothing pinned: nothing to check


def test_pack_and_info_print_the_name_and_packing_is_deterministic(packed, tmp_path, capsys):
    root, _, name = packed
    rc, out, _ = run_cli(
        ["pack", "--files-per-block", "8", "--no-fsync", str(root / "src"), str(tmp_path / "again")], capsys
    )
    assert rc == 0 and f"dataset {name}" in out  # the same files, the same options: the same name
    again = blockfs.pack(root / "src", tmp_path / "threads", files_per_block=8, fsync=False, workers=1)
    assert again.digest == name
    rc, out, _ = run_cli(["info", str(tmp_path / "again")], capsys)
    assert rc == 0 and name in out
    other = blockfs.pack(root / "src", tmp_path / "other", files_per_block=8, fsync=False, seed=1)
    assert other.digest != name


# --- today's format ---------------------------------------------------------------------------------------
def test_todays_format_opens_with_one_notice_and_upgrade_restores_the_name(dest, packed, caplog, capsys):
    _, contents, name = packed
    strip_digests(dest)
    blocks_before = {p.name: p.read_bytes() for p in (dest / "blocks").iterdir()}
    with caplog.at_level(logging.WARNING, logger="blockfs"):
        with blockfs.open_dataset(dest) as ds:
            assert ds.read(VICTIM) == contents[VICTIM] and not ds.has_digests
    notices = [r for r in caplog.records if "accidents only" in r.getMessage()]
    assert len(notices) == 1 and "blockfs upgrade" in notices[0].getMessage()
    with pytest.raises(IdentityError, match="upgrade"):  # its own name, but nothing below it can be pinned
        blockfs.open_dataset(dest, expect=dg.name_of((dest / fmt.METADATA_NAME).read_bytes()))
    rc, out, _ = run_cli(["upgrade", str(dest)], capsys)
    assert rc == 0 and name in out  # the same index and metadata a pack writes: the same name
    assert {p.name: p.read_bytes() for p in (dest / "blocks").iterdir()} == blocks_before  # no block rewritten
    with blockfs.open_dataset(dest, expect=name) as ds:
        assert all(ds.read(rel) == data for rel, data in contents.items())
    rc, out, _ = run_cli(["upgrade", str(dest)], capsys)
    assert rc == 0 and "already" in out


def test_an_upgrade_cut_between_its_two_renames_is_finished_by_the_next(dest, packed, monkeypatch, capsys):
    import blockfs.core.upgrade as up

    _, contents, name = packed
    strip_digests(dest)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(up, "write_file_at", cut)
    with pytest.raises(KeyboardInterrupt):
        up.upgrade(dest)
    monkeypatch.undo()
    assert (dest / up.BACKUP_NAME).exists()
    assert up.upgrade(dest) == (name, True)
    assert not (dest / up.BACKUP_NAME).exists()


def test_upgrade_refuses_a_crc_damaged_block(dest, packed):
    strip_digests(dest)
    path = Path(fmt.block_path(dest, 0))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    from blockfs.core.upgrade import upgrade

    with pytest.raises(CorruptBlockError):
        upgrade(dest)


# --- a mount under every policy --------------------------------------------------------------------------
@pytest.mark.fuse
@pytest.mark.parametrize("policy", ["cache-once", "lru", "fifo", "none"])
def test_a_mount_refuses_a_crc_forged_file_under_every_policy(dest, packed, tmp_path, policy):
    require(has_fuse(), "FUSE")
    from mountutil import mounted

    _, contents, name = packed
    forge_file(dest, VICTIM)
    with mounted(dest, tmp_path / "mnt", "--policy", policy, "--expect", name) as m:
        with pytest.raises(OSError) as err:
            (m.path / VICTIM).read_bytes()
        assert err.value.errno == errno.EIO
        for rel, data in contents.items():
            if not rel.startswith("class1"):
                assert (m.path / rel).read_bytes() == data
        stats = json.loads(Path(m.path, ".blockfs", "stats.json").read_text())
        assert stats["dataset"]["digest"] == name


@pytest.mark.fuse
def test_a_mount_with_a_wrong_pin_does_not_start(dest, tmp_path, capsys):
    require(has_fuse(), "FUSE")
    wrong = "blake3:" + "cd" * 32
    (tmp_path / "mnt").mkdir()
    rc, _, err = run_cli(["mount", "--expect", wrong, str(dest), str(tmp_path / "mnt")], capsys)
    assert rc == 2 and wrong in err and len(err.strip().splitlines()) == 1
    assert not os.path.ismount(tmp_path / "mnt")


@pytest.mark.fuse
def test_the_loader_pins_the_mounted_dataset_and_its_state_names_it(dest, packed, tmp_path):
    require(has_fuse(), "FUSE")
    from mountutil import mounted

    from blockfs.loader.mount_client import BlockfsMount

    _, _, name = packed
    with mounted(dest, tmp_path / "mnt") as m:
        assert BlockfsMount(m.path, expect=name).digest == name
        with pytest.raises(IdentityError, match="not the pinned"):
            BlockfsMount(m.path, expect="blake3:" + "ef" * 32)


@pytest.mark.fuse
def test_the_loader_checks_the_mounts_index_once_a_machine(dest, tmp_path, monkeypatch):
    """The loader opens the mount's index against the digest its blockfs.json records; the first open here
    runs every check and records it, the next (a worker's reopen, the next run) skips them."""
    require(has_fuse(), "FUSE")
    from mountutil import mounted

    from blockfs.core.checked_indexes import CheckedIndexes
    from blockfs.loader.mount_client import BlockfsMount

    monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "mount-record"))
    with mounted(dest, tmp_path / "mnt") as m:
        monkeypatch.setenv("BLOCKFS_CHECKED_DIR", str(tmp_path / "loader-record"))  # this process's own
        first = BlockfsMount(m.path)
        again = pickle.loads(pickle.dumps(first))  # as a spawned worker reopens it
        assert not first.index.checks_skipped and first.index.checks_recorded
        assert again.index.checks_skipped and again.read(int(again.file_ids[0])) == first.read(int(first.file_ids[0]))
        assert CheckedIndexes(tmp_path / "loader-record").has(first.metadata["index"]["blake3"])
        first.close()
        again.close()


# --- property: no forged byte is served under a pin -------------------------------------------------------
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(rnd=st.randoms(use_true_random=False), what=st.sampled_from(["block", "block-crc-kept", "index", "metadata"]))
def test_under_a_pin_no_forged_byte_is_served(packed, tmp_path_factory, rnd, what):
    root, contents, name = packed
    dest = tmp_path_factory.mktemp("prop") / "ds"
    shutil.copytree(root / "pristine", dest)
    if what == "index":
        target = dest / fmt.INDEX_NAME
    elif what == "metadata":
        target = dest / fmt.METADATA_NAME
    else:
        target = Path(fmt.block_path(dest, rnd.randrange(len(os.listdir(dest / "blocks")))))
    raw = bytearray(target.read_bytes())
    if what == "block-crc-kept":
        lo = rnd.randrange(0, len(raw) - 8)
        hi = min(len(raw), lo + rnd.randint(8, 600))
        raw[lo:hi] = forge(bytes(raw[lo:hi]), changed_at=0, fix_at=hi - lo - 4)
    else:
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
    target.write_bytes(bytes(raw))
    try:
        ds = blockfs.open_dataset(dest, expect=name)
    except BlockfsError:
        return  # refused whole: nothing served
    with ds:
        for rel, data in contents.items():
            try:
                got = ds.read(rel)
            except BlockfsError:
                continue
            assert got == data, f"{what}: forged bytes served for {rel}"


@pytest.mark.fuse
@pytest.mark.torch
def test_the_loader_gets_an_error_never_the_forged_bytes(dest, packed, tmp_path, torch_module):
    require(has_fuse(), "FUSE")
    from mountutil import mounted

    from blockfs.loader.block_loader import BlockShuffleDataset

    _, contents, name = packed
    forge_file(dest, VICTIM)
    with mounted(dest, tmp_path / "mnt", "--expect", name) as m:
        data = BlockShuffleDataset(m.path, expect=name)
        served = {}
        with pytest.raises(OSError) as err:
            for sample, _label, i in data:
                served[os.path.relpath(data.mount.path(int(i)), m.path)] = sample
        assert err.value.errno == errno.EIO
        assert all(contents[rel] == got for rel, got in served.items())
        data.close()


def test_a_piece_of_a_big_file_is_checked_by_its_chunks_on_every_read(tmp_path, monkeypatch):
    """A big file read in pieces is never served from bytes checked on an earlier read: the block changed
    after a first piece was read (its CRC kept) is refused on the next piece that touches the change."""
    import blockfs.core.store as store_module

    monkeypatch.setattr(store_module, "VERIFY_PIECE", 64 << 10)
    data = random.Random(1).randbytes(3 * fmt.CHUNK_SIZE + 12345)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    name = blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False).digest
    with blockfs.open_dataset(tmp_path / "p", expect=name) as ds:
        piece = 100_000
        got = b"".join(ds.read("big.bin", off, piece) for off in range(0, len(data), piece))
        assert got == data
        head = ds.store.header(0)
        path = Path(ds.store.block_paths[0])
        raw = bytearray(path.read_bytes())
        at = head.data_start + 2 * fmt.CHUNK_SIZE + 500  # inside chunk 2
        raw[at : at + 64] = forge(bytes(raw[at : at + 64]))
        path.write_bytes(bytes(raw))
        assert ds.read("big.bin", 0, piece) == data[:piece]  # chunk 0 is still the packed bytes
        with pytest.raises(CorruptBlockError, match="chunk 2"):
            ds.read("big.bin", 2 * fmt.CHUNK_SIZE, piece)


def test_a_local_block_is_hashed_piece_by_piece_behind_its_read(tmp_path, monkeypatch):
    """A local block's data is read in pieces, each hashed on a hashing thread while the next is read: every
    piece is checked (a forgery in the last one is refused, naming its chunk), and a read that fails half
    way returns only once every hash has let go of the caller's buffer."""
    import blockfs.core.store as store_module
    from blockfs.errors import BlockReadError
    from blockfs.storage.blockfiles import LocalBlockFiles

    monkeypatch.setattr(store_module, "READ_PIECE", 2 * fmt.CHUNK_SIZE)
    rng = random.Random(5)
    (tmp_path / "src").mkdir()
    for i in range(5):
        (tmp_path / "src" / f"f{i}.bin").write_bytes(rng.randbytes(fmt.CHUNK_SIZE + 1000 * i))
    name = blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False).digest
    hashed: list = []
    later = dg.chunk_digests_later
    monkeypatch.setattr(dg, "chunk_digests_later", lambda data, chunk: hashed.append(later(data, chunk)) or hashed[-1])
    with blockfs.open_dataset(tmp_path / "p", expect=name) as ds:
        head = ds.store.header(0)
        expected = [zlib.crc32((tmp_path / "src" / f"f{i}.bin").read_bytes()) for i in range(5)]
        assert sorted(ds.store.verified_crcs(0).tolist()) == sorted(expected)
        assert len(hashed) == -(-head.data_size // (2 * fmt.CHUNK_SIZE)) >= 3  # one hash per piece

        reads = []
        real_read_into = LocalBlockFiles.read_into

        def failing_second_piece(self, block, view, offset):
            reads.append(offset)
            if len(reads) == 2:
                raise OSError(errno.EIO, "injected")
            real_read_into(self, block, view, offset)

        hashed.clear()
        monkeypatch.setattr(LocalBlockFiles, "read_into", failing_second_piece)
        with pytest.raises(BlockReadError):
            ds.store.verified_crcs(0)
        assert hashed and all(f.done() for f in hashed)  # nothing still reads the buffer
        monkeypatch.setattr(LocalBlockFiles, "read_into", real_read_into)

        path = Path(ds.store.block_paths[0])
        raw = bytearray(path.read_bytes())
        last_chunk = fmt.n_chunks(head.data_size) - 1
        at = head.data_start + last_chunk * fmt.CHUNK_SIZE + 10
        raw[at : at + 64] = forge(bytes(raw[at : at + 64]))
        path.write_bytes(bytes(raw))
        ds.store._files.discard(0)
        with pytest.raises(CorruptBlockError, match=f"chunk {last_chunk}"):
            ds.store.verified_crcs(0)


def test_a_pack_to_a_url_has_the_name_of_the_same_pack_on_disk(s3, packed, tmp_path, capsys):
    root, contents, name = packed
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/ds"
    assert blockfs.pack(root / "src", url, files_per_block=8).digest == name
    with blockfs.open_dataset(url, expect=name) as ds:
        assert ds.read(VICTIM) == contents[VICTIM]
    rc, _, err = run_cli(["upgrade", url], capsys)
    assert rc == 2 and "local directory" in err and len(err.strip().splitlines()) == 1
