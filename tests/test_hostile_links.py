"""Links planted in a dataset directory (or in unpack's OUT) never send a write, a truncation or a removal
outside it.

A dataset received from someone else may ship a symbolic link or a hard link under any name blockfs writes
there; another user sharing the directory may rename a directory and put a link in its place while a
command runs.  Each test plants one such link to a file (or directory) outside, runs the command, and
checks the outside bytes (and the directory's listing, mode and times) are exactly as before, and that the
command either refused in one line or replaced the link without following it:

- ``upgrade`` keeps a dataset, so a link where its own files or its backup should be is refused, naming
  it (blockfs never writes a link there; the dataset is not the one blockfs wrote).  Scratch names it
  once used, or another process's temporary names, are left alone.
- ``pack --force`` throws the old dataset away, so a link among its files is removed itself, like the
  file it stands for, and never followed; the new dataset is written through DEST's descriptor.
- ``unpack`` creates every name with ``O_EXCL|O_NOFOLLOW`` under descriptors reached without following a
  link: a name planted meanwhile fails the unpack in one line.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from fuzz.indexutil import strip_digests
from fuzz.invariant import run_cli

import blockfs
from blockfs.core import format as fmt
from blockfs.core.dataset import PackedDataset
from blockfs.core.unpack import UnpackError, unpack
from blockfs.core.upgrade import BACKUP_NAME
from blockfs.packing import destination
from blockfs.storage.owned import temp_name

BLOCK_0 = os.path.basename(fmt.block_path("", 0))  # 00000000.blk
PRECIOUS = b"precious bytes of someone else's file\n"


def make_tree(root: Path) -> dict[str, bytes]:
    contents = {f"d{i % 2}/f{i}.bin": bytes([i]) * (100 + 37 * i) for i in range(12)}
    for rel, data in contents.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return contents


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("links")
    contents = make_tree(root / "src")
    blockfs.pack(root / "src", root / "pristine", files_per_block=4, fsync=False)
    return root, contents


class Outside:
    """A file and a directory outside the dataset, and what they were before the command."""

    def __init__(self, root: Path) -> None:
        root.mkdir()
        self.file = root / "victim"
        self.file.write_bytes(PRECIOUS)
        self.dir = root / "victim_dir"
        self.dir.mkdir()
        (self.dir / "keep").write_bytes(PRECIOUS)
        self.before = self.snapshot()

    def snapshot(self) -> tuple:
        """Bytes, mode and times (not the link count: a planted hard link is one more, until removed)."""
        st, dst = os.stat(self.file), os.stat(self.dir)
        listing = sorted((p.name, p.read_bytes()) for p in self.dir.iterdir())
        return self.file.read_bytes(), st.st_mode, st.st_mtime_ns, listing, dst.st_mode, dst.st_mtime_ns

    def untouched(self) -> bool:
        return self.snapshot() == self.before


def plant(path: Path, kind: str, outside: Outside) -> None:
    """A symbolic link to the outside file, a hard link to it, or a symbolic link to the outside directory."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "symlink":
        path.symlink_to(outside.file)
    elif kind == "hardlink":
        os.link(outside.file, path)
    else:
        path.symlink_to(outside.dir, target_is_directory=True)


def one_line(err: str) -> bool:
    """One error line and no traceback (a format-1 dataset's notice may be logged before it)."""
    return sum(": error: " in line for line in err.splitlines()) == 1 and "Traceback" not in err


def reads_right(dest: Path, contents: dict[str, bytes]) -> bool:
    with blockfs.open_dataset(dest) as ds:
        return all(ds.read(rel) == data for rel, data in contents.items())


# --- upgrade ----------------------------------------------------------------------------------------------
def _this_process_temp(name: str) -> str:
    return temp_name(name)  # the name this process (main thread) would write ``name`` through


# (name, whether upgrade must refuse it): scratch names are ignored, the dataset's own names and the backup
# refused when they are links, this process's temporary names make the write fail (O_EXCL).
UPGRADE_NAMES = [
    (fmt.INDEX_NAME + ".upgrade", False),  # the scratch name upgrade wrote through before
    (fmt.INDEX_NAME + ".tmp", False),
    (fmt.METADATA_NAME + ".tmp", False),
    (BACKUP_NAME, True),
    (fmt.INDEX_NAME, True),
    (fmt.METADATA_NAME, True),
    ("TEMP:" + fmt.INDEX_NAME, True),
    ("TEMP:" + fmt.METADATA_NAME, True),
]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "dirlink"])
@pytest.mark.parametrize(("name", "refused"), UPGRADE_NAMES, ids=[n for n, _ in UPGRADE_NAMES])
def test_upgrade_never_writes_through_a_link_planted_in_the_dataset(packed, tmp_path, name, refused, kind):
    root, contents = packed
    dest = tmp_path / "ds"
    shutil.copytree(root / "pristine", dest)
    strip_digests(dest)
    outside = Outside(tmp_path / "outside")
    if name in (fmt.INDEX_NAME, fmt.METADATA_NAME):
        # The dataset's own file, moved outside and linked back: the dataset still opens through it.
        outside.file.write_bytes((dest / name).read_bytes())
        outside.before = outside.snapshot()
    if name.startswith("TEMP:"):
        name = _this_process_temp(name[len("TEMP:") :])
    plant(dest / name, kind, outside)
    hard_own_file = kind == "hardlink" and name in (fmt.INDEX_NAME, fmt.METADATA_NAME)

    o = run_cli("upgrade", dest)

    assert outside.untouched()
    if refused and not hard_own_file and not (kind == "hardlink" and name == BACKUP_NAME):
        assert o.rc == 2 and one_line(o.err) and name in o.err, o
    else:  # a regular file (a hard link is one) in place: the upgrade goes on, and replaces it by rename
        assert o.rc == 0, o
        assert reads_right(dest, contents)
        assert not (dest / BACKUP_NAME).exists()


def test_an_interrupted_upgrade_of_a_dataset_with_a_linked_index_refuses_in_one_line(packed, tmp_path):
    """The old code linked the backup to what ``index.bfi`` pointed to (os.link follows links): a later
    restore would have made an outside file the dataset's index.  Now the index link is refused first."""
    root, _ = packed
    dest = tmp_path / "ds"
    shutil.copytree(root / "pristine", dest)
    strip_digests(dest)
    outside = Outside(tmp_path / "outside")
    outside.file.write_bytes((dest / fmt.INDEX_NAME).read_bytes())
    outside.before = outside.snapshot()
    plant(dest / fmt.INDEX_NAME, "symlink", outside)
    o = run_cli("upgrade", dest)
    assert o.rc == 2 and one_line(o.err) and "symbolic link" in o.err, o
    assert not (dest / BACKUP_NAME).exists() and not (dest / BACKUP_NAME).is_symlink()
    assert outside.untouched()


# --- pack --force -----------------------------------------------------------------------------------------
PACK_NAMES = [
    fmt.PACKING_MARKER,  # opened "wb" before: a link there truncated its target
    fmt.INDEX_NAME + ".tmp",
    fmt.METADATA_NAME + ".tmp",
    fmt.INDEX_NAME,
    fmt.METADATA_NAME,
    fmt.BLOCKS_DIR,
    f"{fmt.BLOCKS_DIR}/{BLOCK_0}",
    f"{fmt.BLOCKS_DIR}/{BLOCK_0}.tmp",
]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "dirlink"])
@pytest.mark.parametrize("name", PACK_NAMES)
def test_pack_force_removes_links_of_the_old_dataset_and_never_follows_them(packed, tmp_path, name, kind):
    root, contents = packed
    dest = tmp_path / "ds"
    shutil.copytree(root / "pristine", dest)
    outside = Outside(tmp_path / "outside")
    plant(dest / name, kind, outside)

    o = run_cli("pack", root / "src", dest, "--force", "--files-per-block", "4", "--no-fsync")

    assert outside.untouched()
    assert o.rc == 0, o
    assert reads_right(dest, contents)
    if name not in (fmt.INDEX_NAME + ".tmp", fmt.METADATA_NAME + ".tmp"):  # names the pack no longer writes
        assert not (dest / name).is_symlink()
    assert not (dest / fmt.PACKING_MARKER).exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_writes_its_blocks_into_the_directory_it_made_even_if_it_is_swapped_for_a_link(
    packed, tmp_path, monkeypatch, workers
):
    """A rename trick: once DEST is claimed, its ``blocks/`` is renamed away and a link to an outside
    directory put in its place.  Block files go to the directory the pack made (through its descriptor)."""
    root, _ = packed
    dest = tmp_path / "ds"
    outside = Outside(tmp_path / "outside")
    claim = destination.LocalDestination.claim

    def claim_then_swap(self, *args):
        claim(self, *args)
        os.rename(dest / fmt.BLOCKS_DIR, dest / "blocks.moved")
        (dest / fmt.BLOCKS_DIR).symlink_to(outside.dir, target_is_directory=True)

    monkeypatch.setattr(destination.LocalDestination, "claim", claim_then_swap)
    blockfs.pack(root / "src", dest, files_per_block=4, fsync=True, workers=workers)
    assert outside.untouched()
    assert sorted(os.listdir(dest / "blocks.moved")) == [os.path.basename(fmt.block_path("", b)) for b in range(3)]


# --- unpack -----------------------------------------------------------------------------------------------
def _entries(ds: PackedDataset) -> list[str]:
    return [os.fsdecode(ds.path_of(e)) for e in range(1, ds.index.n_entries)]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "dirlink"])
def test_unpack_fails_in_one_line_on_a_name_planted_while_it_runs(packed, tmp_path, kind):
    """After the first file, every name still to be written is planted as a link: the next one fails the
    unpack with an error naming it, and nothing outside changes."""
    root, _ = packed
    outside = Outside(tmp_path / "outside")
    out = tmp_path / "out"
    planted: list[str] = []

    def plant_the_rest(e: int) -> None:
        if planted:
            return
        done = os.fsdecode(ds.path_of(e))
        for rel in _entries(ds)[_entries(ds).index(done) + 1 :]:
            parent = (out / rel).parent  # a real directory under OUT, not one of the links planted here
            inside = (os.path.realpath(parent) + "/").startswith(os.path.realpath(out) + "/")
            if parent.is_dir() and inside and not os.path.lexists(out / rel):
                plant(out / rel, kind, outside)
                planted.append(rel)

    with PackedDataset(root / "pristine") as ds:
        with pytest.raises(UnpackError) as raised:
            unpack(ds, out, on_file=plant_the_rest)
    assert planted and "\n" not in str(raised.value) and "already exists" in str(raised.value)
    assert outside.untouched()


def test_unpack_never_follows_a_directory_swapped_for_a_link(packed, tmp_path):
    """A rename trick: once ``d0/`` holds a file, it is renamed away and a link to an outside directory put
    in its place.  Nothing is created, chmod-ed or touched in the outside directory."""
    root, _ = packed
    outside = Outside(tmp_path / "outside")
    out = tmp_path / "out"
    swapped = threading.Event()

    def swap(e: int) -> None:
        if not swapped.is_set() and (out / "d0").is_dir() and any((out / "d0").iterdir()):
            os.rename(out / "d0", out / "d0.moved")
            (out / "d0").symlink_to(outside.dir, target_is_directory=True)
            swapped.set()

    with PackedDataset(root / "pristine") as ds:
        with pytest.raises(UnpackError) as raised:
            unpack(ds, out, on_file=swap)
    assert swapped.is_set() and "'d0'" in str(raised.value) and "\n" not in str(raised.value)
    assert outside.untouched()


# --- a FIFO where the dataset's files should be -----------------------------------------------------------
def _finishes(action, fifo: Path) -> tuple[bool, BaseException | None]:
    """Run ``action`` on a thread; whether it finished within a minute (else the FIFO is opened for writing,
    which lets a reader blocked in its open go), and what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    finished = not thread.is_alive()
    if not finished:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the blocked open
        thread.join(timeout=60)
    return finished, raised[0] if raised else None


@pytest.mark.parametrize("name", [fmt.METADATA_NAME, fmt.INDEX_NAME, f"{fmt.BLOCKS_DIR}/{BLOCK_0}"])
def test_a_fifo_planted_as_a_dataset_file_fails_the_open_or_the_read_instead_of_blocking(packed, tmp_path, name):
    """A FIFO blocks its reader's open until a writer comes: planted as ``blockfs.json`` or ``index.bfi`` it
    held every command on the dataset, as a block file every read of the mount (behind the descriptors'
    lock).  Each is now refused as not a regular file."""
    root, contents = packed
    dest = tmp_path / "ds"
    shutil.copytree(root / "pristine", dest)
    with blockfs.open_dataset(dest) as ds:
        victim = os.fsdecode(sorted(ds.files_in_block(0))[0])
    (dest / name).unlink()
    os.mkfifo(dest / name)

    def read() -> None:
        with blockfs.open_dataset(dest) as ds:
            ds.read(victim)

    finished, error = _finishes(read, dest / name)
    assert finished, f"reading {victim} blocked on the FIFO {name}"
    assert isinstance(error, OSError | ValueError) and "not a regular file" in str(error), error
    assert "\n" not in str(error)
