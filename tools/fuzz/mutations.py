"""Mutations of a small packed dataset (issue 17), shared by the property tests and the fuzzer.

``tests/test_hostile_mutations.py`` runs a few derandomized examples per family, ``tools/fuzz_dataset.py``
thousands: both draw a mutation from a ``random.Random``, apply it to a fresh copy of a pristine pack, and
check every reader with :mod:`fuzz.invariant`. Hypothesis hands the tests a ``Random`` it controls
(``st.randoms``), so both find the same kinds of damage from one code path.

Two kinds of family: in an *authentic* one the index is the packer's or is refused by its CRC (index
bytes not re-signed, metadata, blocks), so a success must give back the source exactly. In a *forged*
one the index was edited and re-signed by someone who knows the format: names, modes and times are then
whatever the forger wrote, and only what no forger may cause is checked (see :mod:`fuzz.invariant`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import blockfs
from blockfs.core import format as fmt
from blockfs.core.index_format import DIGEST_ARRAYS

from .indexutil import read_toc, resign

BLOCK_SIZE = 600  # several blocks from a tree of a few dozen small files


# --- the tree and its packs -------------------------------------------------------------------------
def make_small_tree(root: Path) -> Path:
    """A few dozen files in three class directories, one symlink, one hard link and an empty directory."""
    rnd = random.Random(17)
    for c in range(3):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(9):
            (d / f"f{i:02d}.bin").write_bytes(rnd.randbytes(rnd.choice((0, 1, 7, 60, 200, 450))))
    (root / "class0" / "empty.bin").write_bytes(b"")
    (root / "top.txt").write_bytes(b"not in a class\n")
    os.symlink("f01.bin", root / "class1" / "link")
    os.link(root / "class2" / "f03.bin", root / "class0" / "hard.bin")
    (root / "empty_dir").mkdir()
    return root


@dataclass
class Pristine:
    """A source tree, its pack, and another pack of the same tree (whose blocks are foreign to the first)."""

    src: Path
    pack: Path
    other: Path
    files: dict[bytes, bytes] = field(default_factory=dict)  # relative path -> bytes, regular files
    snapshot: dict = field(default_factory=dict)  # treesnap.tree_snapshot of src
    dirs: list[bytes] = field(default_factory=list)  # b"" (the root) and every directory under it

    @property
    def readers(self) -> int:
        """Reader runs per mutation: info, plan, ls of each directory, cat of each file, verify, unpack."""
        return 4 + len(self.dirs) + len(self.files)


def make_pristine(root: Path) -> Pristine:
    from .treesnap import tree_snapshot

    src = make_small_tree(root / "src")
    blockfs.pack(src, root / "pack", block_size=BLOCK_SIZE, seed=0, fsync=False)
    blockfs.pack(src, root / "other", block_size=BLOCK_SIZE, seed=1, fsync=False)
    p = Pristine(src, root / "pack", root / "other", snapshot=tree_snapshot(src))
    for rel, ((kind, data), _mode, _mtime) in ((k, v) for k, v in p.snapshot.items() if k != "hardlink groups"):
        if kind == "file":
            p.files[rel] = data
        elif kind == "dir":
            p.dirs.append(rel)
    p.dirs.insert(0, b"")
    n_blocks = len(os.listdir(p.pack / fmt.BLOCKS_DIR))
    assert n_blocks >= 4 and n_blocks == len(os.listdir(p.other / fmt.BLOCKS_DIR)), n_blocks
    return p


def remove_tree(path: Path) -> None:
    """Remove a scratch directory; unpack restores modes, so a directory in it may be read-only."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                os.chmod(os.path.join(dirpath, d), 0o700)
    shutil.rmtree(path)


def fresh_copy(p: Pristine, work: Path) -> Path:
    dest = work / "ds"
    shutil.copytree(p.pack, dest)
    return dest


# --- mutations ---------------------------------------------------------------------------------------
# Each takes the copy to damage and a Random, damages it, and returns what it did (a reproduction).
INTERESTING_INTS = (0, 1, 2, 3, 7, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1)


def _poke(path: Path, rnd: random.Random, lo: int, hi: int) -> str:
    """Damage bytes [lo, hi) of a file: flip a bit, set a byte, or write an interesting little-endian word."""
    raw = bytearray(path.read_bytes())
    hi = min(hi, len(raw))
    if hi <= lo:
        return f"{path.name}: nothing in [{lo}, {hi})"
    pos = rnd.randrange(lo, hi)
    how = rnd.randrange(3)
    if how == 0:
        bit = rnd.randrange(8)
        raw[pos] ^= 1 << bit
        what = f"flip bit {bit} at {pos}"
    elif how == 1:
        value = rnd.randrange(256)
        raw[pos] = value
        what = f"byte {value} at {pos}"
    else:
        width = rnd.choice((4, 8))
        value = rnd.choice(INTERESTING_INTS) % (1 << (8 * width))
        word = value.to_bytes(width, "little")[: len(raw) - pos]
        raw[pos : pos + len(word)] = word
        what = f"u{8 * width} {value} at {pos}"
    path.write_bytes(bytes(raw))
    return f"{path.name}: {what}"


def _index_bytes(dest: Path, rnd: random.Random) -> list[str]:
    index = dest / fmt.INDEX_NAME
    _toc, toc_len = read_toc(index)
    steps = []
    for _ in range(rnd.randint(1, 3)):
        head = rnd.random() < 0.3  # the fixed header and the table of contents, else the arrays
        lo, hi = (0, 16 + toc_len) if head else (16 + toc_len, index.stat().st_size)
        steps.append(_poke(index, rnd, lo, hi))
    return steps


def mutate_index_resigned(dest: Path, rnd: random.Random) -> list[str]:
    steps = _index_bytes(dest, rnd)
    resign(dest)
    return steps + ["re-signed"]


def mutate_index_unsigned(dest: Path, rnd: random.Random) -> list[str]:
    return _index_bytes(dest, rnd)


def mutate_index_arrays(dest: Path, rnd: random.Random, digests: bool = False) -> list[str]:
    """Set one element of a chosen array (any column, uniformly: a byte flip lands mostly in the big ones)
    to a nearby or an extreme value, and re-sign.  ``digests``: only the digest arrays (a family of their
    own, so the other family's reproductions keep drawing what they drew before digests)."""
    index = dest / fmt.INDEX_NAME
    toc, _ = read_toc(index)
    steps = []
    for _ in range(rnd.randint(1, 2)):
        name = rnd.choice(
            sorted(n for n, spec in toc["arrays"].items() if spec[2] > 0 and (n in DIGEST_ARRAYS) == digests)
        )
        dtype, offset, count = toc["arrays"][name]
        i = rnd.randrange(count)
        info = np.iinfo(np.dtype(dtype))
        raw = bytearray(index.read_bytes())
        a = np.frombuffer(raw, dtype=dtype, count=count, offset=offset)  # a writable view of raw
        old = int(a[i])
        new = rnd.choice(
            (
                old + 1,
                old - 1,
                old ^ (1 << rnd.randrange(info.bits)),
                0,
                info.max,
                info.min,
                info.max // 2 + 1,
                rnd.randint(info.min, info.max),
            )
        )
        a[i] = min(max(new, info.min), info.max)
        index.write_bytes(bytes(raw))
        steps.append(f"{name}[{i}] {old} -> {int(a[i])}")
    resign(dest)
    return steps + ["re-signed"]


ODD_VALUES = (None, [], {}, "", "x", -1, 0, 1, 1.5, 2**31, 2**64, True, "8", [1, 2], {"a": 1})
DTYPES = ("xyz", 5, None, "|u1", "<u2", "<u4", "<i4", "<u8", "<i8", ">u4", ">u8", "<f8", "S4", "O", "V8", "<M8[ns]", [])


def _toc_edit(toc: dict, rnd: random.Random) -> str:
    arrays = toc.get("arrays")
    # Arrays whose spec is still [dtype, offset, count] (an earlier edit may have broken one).
    specs = arrays.items() if isinstance(arrays, dict) else ()
    names = sorted(n for n, v in specs if isinstance(v, list) and len(v) == 3)
    what = rnd.randrange(9) if names else 8
    if what < 5:
        name = rnd.choice(names)
        spec = arrays[name]
        if what == 0:
            spec[0] = rnd.choice(DTYPES)
            return f"{name} dtype = {spec[0]!r}"
        if what in (1, 2):
            i = what  # 1 = offset, 2 = count
            old = spec[i]
            near = old + rnd.choice((-64, -8, -1, 1, 8, 64)) if type(old) is int else 0
            spec[i] = rnd.choice((near, *ODD_VALUES, 2**40))
            return f"{name} {'offset' if i == 1 else 'count'} {old} -> {spec[i]!r}"
        if what == 3:
            arrays[name] = rnd.choice((spec[:2], spec + [0], "x", None, {}))
            return f"{name} spec = {arrays[name]!r}"
        other = rnd.choice(names)
        arrays[name], arrays[other] = arrays[other], spec
        return f"swap specs of {name} and {other}"
    if what == 5:
        name = rnd.choice(names)
        new = rnd.choice(("", "x", name.upper(), rnd.choice(names) + "_"))
        arrays[new] = arrays.pop(name)
        return f"rename array {name} -> {new!r}"
    if what == 6:
        name = rnd.choice(names)
        del arrays[name]
        return f"delete array {name}"
    if what == 7:
        old = toc.get("n_entries")
        toc["n_entries"] = rnd.choice(
            (old + 1 if isinstance(old, int) else 0, old - 1 if isinstance(old, int) else 0, *ODD_VALUES)
        )
        return f"n_entries {old!r} -> {toc['n_entries']!r}"
    key = rnd.choice(("arrays", "n_entries", "extra"))
    toc[key] = rnd.choice(ODD_VALUES)
    return f"toc[{key!r}] = {toc[key]!r}"


def mutate_toc(dest: Path, rnd: random.Random) -> list[str]:
    """Edit fields of the index's table of contents (re-signed: only the schema checks can see it)."""
    index = dest / fmt.INDEX_NAME
    toc, toc_len = read_toc(index)
    steps = [_toc_edit(toc, rnd) for _ in range(rnd.randint(1, 2))]
    text = json.dumps(toc).encode()
    if len(text) > toc_len:  # cannot happen with these edits on this tree: the room has slack
        raise AssertionError(f"edited table of contents does not fit: {steps}")
    raw = bytearray(index.read_bytes())
    raw[16 : 16 + toc_len] = text.ljust(toc_len)
    index.write_bytes(bytes(raw))
    resign(dest)
    return steps + ["re-signed"]


META_PLAUSIBLE = {
    "format_version": (0, 2, 99),
    "format": ("blockfs2", "tar"),
    "n_blocks": "count",
    "n_entries": "count",
    "n_files": "count",
    "n_dirs": "count",
    "n_symlinks": "count",
    "file_bytes": "count",
    "block_bytes": "count",
    "classes": (["class0"], ["class0", "class1"], ["a", "b", "c", "d"], [1, 2, 3], ["class0", None, "x"]),
    "index.file": ("../index.bfi", "/etc/hostname", "blocks/00000000.blk", "blockfs.json"),
    "index.crc32": "crc",
    "pack.block_size": (0, 1, -5),
    "pack.files_per_block": (0, -1, 1),
    "pack.seed": (1, -1),
}


def mutate_metadata(dest: Path, rnd: random.Random) -> list[str]:
    """Edit blockfs.json: a field deleted, given the wrong type, or a plausible wrong value; or the whole file."""
    path = dest / fmt.METADATA_NAME
    meta = json.loads(path.read_text())
    if rnd.random() < 0.08:
        text = path.read_text()
        cut = rnd.randrange(len(text))
        path.write_text(text[:cut] if rnd.random() < 0.5 else rnd.choice(("[]", "null", "1", '"x"', "{}")))
        return [f"blockfs.json cut to {cut} bytes or replaced"]
    steps = []
    for _ in range(rnd.randint(1, 2)):
        keys = [k for k in meta] + [
            f"{k}.{sub}" for k in ("index", "pack") if isinstance(meta.get(k), dict) for sub in meta[k]
        ]
        key = rnd.choice(keys)
        obj, leaf = (meta[key.split(".")[0]], key.split(".")[1]) if "." in key else (meta, key)
        old = obj[leaf]
        how = rnd.randrange(3)
        if how == 0:
            del obj[leaf]
            steps.append(f"delete {key}")
            continue
        plausible = META_PLAUSIBLE.get(key)
        if how == 1 and plausible == "count" and isinstance(old, int):
            obj[leaf] = old + rnd.choice((-1, 1, 2**32))
        elif how == 1 and plausible == "crc" and isinstance(old, int):
            obj[leaf] = old ^ (1 << rnd.randrange(32))
        elif how == 1 and isinstance(plausible, tuple):
            obj[leaf] = rnd.choice(plausible)
        else:
            obj[leaf] = rnd.choice(ODD_VALUES)
        steps.append(f"{key}: {old!r} -> {obj[leaf]!r}")
    path.write_text(json.dumps(meta))
    return steps


def _block_regions(block: Path) -> dict[str, tuple[int, int]]:
    raw = block.read_bytes()
    n = int.from_bytes(raw[32:36], "little")
    wide = bool(int.from_bytes(raw[10:12], "little") & fmt.FLAG_WIDE)
    word = 8 if wide else 4
    offsets = 36
    sizes = offsets + word * n
    labels = sizes + word * n
    data = labels + 4 * n
    return {
        "preamble": (0, 32),
        "count": (32, 36),
        "offsets": (offsets, sizes),
        "sizes": (sizes, labels),
        "labels": (labels, data),
        "data": (data, len(raw)),
    }


def _pick_block(dest: Path, rnd: random.Random) -> Path:
    return rnd.choice(sorted((dest / fmt.BLOCKS_DIR).iterdir()))


def mutate_block_header(dest: Path, rnd: random.Random) -> list[str]:
    steps = []
    for _ in range(rnd.randint(1, 2)):
        block = _pick_block(dest, rnd)
        region = rnd.choice(("preamble", "count", "offsets", "sizes", "labels"))
        lo, hi = _block_regions(block)[region]
        steps.append(f"{region}: " + _poke(block, rnd, lo, hi))
    return steps


def resign_block_header(block: Path) -> str:
    """Recompute a block's header checksum, as a forger who knows the format would: what the header CRC
    no longer catches, the checks against the index must."""
    raw = bytearray(block.read_bytes())
    if len(raw) < fmt.PREAMBLE_SIZE + 4:
        return "too short to re-sign"
    pre = np.frombuffer(bytes(raw[: fmt.PREAMBLE_SIZE]), dtype=fmt.PREAMBLE_DTYPE)[0]
    count = int.from_bytes(raw[32:36], "little")
    start = fmt.header_size(count, bool(int(pre["flags"]) & fmt.FLAG_WIDE), min(int(pre["data_size"]), 1 << 40))
    if start > len(raw):
        return "header longer than the file: not re-signed"
    raw[12:16] = fmt.crc32(bytes(raw[16:start]), fmt.crc32(bytes(raw[:12]))).to_bytes(4, "little")
    block.write_bytes(bytes(raw))
    return "header re-signed"


def mutate_block_header_resigned(dest: Path, rnd: random.Random) -> list[str]:
    steps = []
    for _ in range(rnd.randint(1, 2)):
        block = _pick_block(dest, rnd)
        region = rnd.choice(("preamble", "count", "offsets", "sizes", "labels"))
        lo, hi = _block_regions(block)[region]
        if region == "preamble":
            lo = 16  # past the header CRC, which is re-computed
        steps.append(f"{region}: " + _poke(block, rnd, lo, hi) + "; " + resign_block_header(block))
    return steps


def mutate_block_data(dest: Path, rnd: random.Random) -> list[str]:
    steps = []
    for _ in range(rnd.randint(1, 3)):
        block = _pick_block(dest, rnd)
        lo, hi = _block_regions(block)["data"]
        steps.append("data: " + _poke(block, rnd, lo, hi))
    return steps


def mutate_block_data_crc_kept(dest: Path, rnd: random.Random) -> list[str]:
    """Change a file inside a block and fix 4 of its bytes so that its CRC-32 stays (see forgery.py): every
    CRC of the block still holds, so only the digests can refuse it (issue 23)."""
    from .forgery import forge

    steps = []
    for _ in range(rnd.randint(1, 2)):
        block = _pick_block(dest, rnd)
        raw = bytearray(block.read_bytes())
        head = fmt.decode_header(bytes(raw), block.name)
        files = [s for s in range(head.count) if int(head.sizes[s]) >= 5]
        if not files:
            steps.append(f"{block.name}: no file of 5 bytes or more")
            continue
        slot = rnd.choice(files)
        start, size = head.data_start + int(head.offsets[slot]), int(head.sizes[slot])
        changed = rnd.randrange(size - 4)
        raw[start : start + size] = forge(bytes(raw[start : start + size]), changed_at=changed, fix_at=size - 4)
        block.write_bytes(bytes(raw))
        steps.append(f"{block.name}: slot {slot} forged at {changed}, its CRC kept")
    return steps


def mutate_block_length(dest: Path, rnd: random.Random) -> list[str]:
    """A block file truncated, grown or missing."""
    block = _pick_block(dest, rnd)
    size = block.stat().st_size
    how = rnd.randrange(4)
    if how == 3:
        block.unlink()
        return [f"{block.name}: deleted"]
    if how == 2:
        extra = rnd.randint(1, 64)
        with open(block, "ab") as f:
            f.write(bytes(rnd.randrange(256) for _ in range(extra)))
        return [f"{block.name}: {extra} bytes appended"]
    new = rnd.choice((0, rnd.randrange(size), size - 1, 31, 35))
    os.truncate(block, min(new, size - 1))
    return [f"{block.name}: truncated to {min(new, size - 1)} of {size}"]


def mutate_block_foreign(dest: Path, rnd: random.Random, other: Path) -> list[str]:
    """A block replaced by the block of the same number from another pack of the same tree."""
    steps = []
    for _ in range(rnd.randint(1, 2)):
        block = _pick_block(dest, rnd)
        shutil.copyfile(other / fmt.BLOCKS_DIR / block.name, block)
        steps.append(f"{block.name}: replaced by {other.name}'s")
    return steps


@dataclass(frozen=True)
class Family:
    name: str
    mutate: Callable[[Path, random.Random, Pristine], list[str]]
    authentic: bool  # the index is the packer's, or refused by its CRC


FAMILIES = {
    f.name: f
    for f in (
        Family("index-bytes-resigned", lambda d, r, p: mutate_index_resigned(d, r), authentic=False),
        Family("index-bytes-unsigned", lambda d, r, p: mutate_index_unsigned(d, r), authentic=True),
        Family("index-arrays-resigned", lambda d, r, p: mutate_index_arrays(d, r), authentic=False),
        Family("index-digests-resigned", lambda d, r, p: mutate_index_arrays(d, r, digests=True), authentic=False),
        Family("toc-fields", lambda d, r, p: mutate_toc(d, r), authentic=False),
        Family("metadata-fields", lambda d, r, p: mutate_metadata(d, r), authentic=True),
        Family("block-header", lambda d, r, p: mutate_block_header(d, r), authentic=True),
        Family("block-header-resigned", lambda d, r, p: mutate_block_header_resigned(d, r), authentic=True),
        Family("block-data", lambda d, r, p: mutate_block_data(d, r), authentic=True),
        Family("block-data-crc-kept", lambda d, r, p: mutate_block_data_crc_kept(d, r), authentic=True),
        Family("block-length", lambda d, r, p: mutate_block_length(d, r), authentic=True),
        Family("block-foreign", lambda d, r, p: mutate_block_foreign(d, r, p.other), authentic=True),
    )
}


# --- the disk tier's copies and fetched bytes (issue 21) ----------------------------------------------
# A remote store hands over bytes that may have changed in transit, and a disk tier keeps copies that may
# rot or be replaced on disk.  Here the "remote" is the pristine pack read through :class:`FlakyFetches`
# (each fetch flips one bit with some probability); the tier is a real DiskTier in a scratch directory.
TIER_KEY = "0123456789abcdef0123"


class FlakyFetches:
    """The pristine pack's blocks as a remote store would fetch them: each fetch (a ``pread`` or a
    ``read_into``) has one bit flipped with probability ``rate``.  Quacks like RemoteBlockFiles."""

    reads_in_pieces = False  # a remote store's: a whole block is one fetch

    def __init__(self, pack: Path, n_blocks: int, rnd: random.Random, rate: float) -> None:
        from blockfs.storage.blockfiles import LocalBlockFiles

        self._files = LocalBlockFiles([fmt.block_path(pack, b) for b in range(n_blocks)])
        self.names = self._files.names
        self.rnd, self.rate = rnd, rate
        self.fetches = self.flips = 0

    def _flip(self, buf) -> None:
        self.fetches += 1
        if len(buf) and self.rnd.random() < self.rate:
            i = self.rnd.randrange(len(buf))
            buf[i] ^= 1 << self.rnd.randrange(8)
            self.flips += 1

    def size(self, block: int) -> int:
        return self._files.size(block)

    def pread(self, block: int, size: int, offset: int) -> bytes:
        data = bytearray(self._files.pread(block, size, offset))
        self._flip(data)
        return bytes(data)

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        self._files.read_into(block, view, offset)
        self._flip(view)

    def discard(self, block: int) -> None:
        self._files.discard(block)

    def version(self, block: int):
        return self._files.version(block)

    def stats(self) -> dict:
        return {"remote": {"fetches": self.fetches, "flips": self.flips}}

    def close(self) -> None:
        self._files.close()


def tiered_store(p: Pristine, tier_dir: Path, rnd: random.Random, rate: float, budget: int = 1 << 30):
    """(store, fetches, tier): the pristine pack behind flaky fetches, with a disk tier in ``tier_dir``."""
    from blockfs.core.dataset import PackedDataset
    from blockfs.core.store import BlockStore
    from blockfs.storage.disk_tier import DiskTier
    from blockfs.storage.tiered import TieredBlockFiles

    with PackedDataset(p.pack) as ds:
        arrays = {k: np.array(v) for k, v in ds.index.arrays.items()}  # kept past the dataset's close
    fetches = FlakyFetches(p.pack, len(arrays["block_sizes"]), rnd, rate)
    tier = DiskTier(tier_dir, budget, TIER_KEY, "test://pristine")
    return BlockStore(TieredBlockFiles(fetches, tier), arrays), fetches, tier


def mutate_tier_copies(tier_root: Path, rnd: random.Random, p: Pristine, outside: Path) -> list[str]:
    """Damage the tier's copies as a disk (or another process) might: the block mutations above, and a
    copy replaced by a link to a file outside the tier, or by a FIFO."""
    if not (tier_root / fmt.BLOCKS_DIR).is_dir() or not any((tier_root / fmt.BLOCKS_DIR).iterdir()):
        return ["no copies to damage"]
    how = rnd.randrange(6)
    if how == 0:
        return mutate_block_header(tier_root, rnd)
    if how == 1:
        return mutate_block_data(tier_root, rnd)
    if how == 2:
        return mutate_block_length(tier_root, rnd)
    if how == 3:
        return mutate_block_foreign(tier_root, rnd, p.other)
    block = _pick_block(tier_root, rnd)
    block.unlink()
    if how == 4:
        os.symlink(outside, block)
        return [f"{block.name}: replaced by a link to {outside}"]
    os.mkfifo(block)
    return [f"{block.name}: replaced by a FIFO"]
