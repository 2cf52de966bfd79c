"""An MXNet RecordIO file (``.rec``, with its ``.idx`` when present) as a pack source.

Written from the format's documented layout (dmlc-core ``recordio.h``, MXNet ``recordio.py``)::

    one part of a record, every part starting 4-byte aligned
    +-----------+---------------------------+----------------+--------------+
    | magic u32 | lrecord u32               | length bytes   | zero padding |
    | ced7230a  | cflag << 29 | length      | of payload     | to 4 bytes   |
    +-----------+---------------------------+----------------+--------------+
    cflag 0: a whole record.  1, 2, 3: first, middle, last part of a record the writer cut wherever the
    magic occurred in its payload at a 4-aligned offset (dropping it); the reader joins the parts and
    puts the magic back between them.

    an image record's payload (IRHeader, little-endian)
    0   4  flag u32   number of float32 labels that follow the header (0: one label, in `label`)
    4   4  label f32
    8   8  id u64
    16  8  id2 u64
    24  .  flag x f32 labels, when flag > 0
    ..     the image bytes

The ``.idx`` file beside the ``.rec`` has one ``key<TAB>byte offset`` line per record; without it the
records are found by walking from the start of the file (a damaged record is stepped over by scanning for
the next 4-aligned magic that begins a record).

Mounted names: ``<label>/<id>.<ext>`` — ``<label>`` is the first label (an integer when it is one),
``<ext>`` sniffed from the image bytes (``.jpg``, ``.png``, ... or ``.bin``), and a repeated id gets
``_1``, ``_2``, ... in file order.  The index label of a file is its first label when that is an integer
(else -1).  Records with several labels (flag > 0) or a label that is not an integer keep their full
float32 labels in ``labels.json`` in the packed dataset, named from ``blockfs.json`` and read by
:func:`read_record_labels`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ...core.digest import digest
from ...core.format import METADATA_NAME
from ...core.index import KIND_FILE
from ...errors import FormatError, SourceError
from ...storage.owned import USER_DIR_FLAGS, read_regular_at, write_file_at
from ..sources import SourceEntry
from .base import DIR_MODE, FILE_MODE, DamageLog, ListedOnce, TreeBuilder, WindowReader, pread_into

if TYPE_CHECKING:
    from ...core.dataset import PackedDataset

log = logging.getLogger(__name__)

RECORD_MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", RECORD_MAGIC)
LENGTH_MASK = (1 << 29) - 1
IR_HEADER = struct.Struct("<IfQQ")  # flag, label, id, id2
LABELS_FILE = "labels.json"
SCAN_CHUNK = 1 << 20
Parts = tuple[tuple[int, int], ...]  # (file offset, length) of each part of a record's payload
HEAD_BYTES = 128  # of a payload, read at once while listing
SIGNATURE_BYTES = 16  # of an image, enough to tell its type
Fill = Callable[[memoryview, int], int]  # fill(buf, file offset) -> bytes read

SIGNATURES = (
    (b"\xff\xd8\xff", ".jpg"),
    (b"\x89PNG\r\n\x1a\n", ".png"),
    (b"GIF87a", ".gif"),
    (b"GIF89a", ".gif"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
    (b"\x93NUMPY", ".npy"),
    (b"BM", ".bmp"),
)


def sniff_extension(head: bytes) -> str:
    """The file extension the first bytes of an image announce; ``.bin`` when none does."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return ".webp"
    for signature, ext in SIGNATURES:
        if head.startswith(signature):
            return ext
    return ".bin"


def label_name(value: float) -> str:
    """A label as a directory name: ``3`` for 3.0, the shortest float32 text otherwise."""
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return str(np.float32(value))


def index_label(value: float) -> int:
    """The int32 label the index keeps: the label when it is an integer >= -1, else -1."""
    if math.isfinite(value) and value == int(value) and -1 <= value < 2**31:
        return int(value)
    return -1


@dataclass(eq=False)
class RecordEntry(SourceEntry):
    """A record's file: the (offset, length) of each part of its payload, and the header bytes to skip."""

    parts: Parts = ()
    skip: int = 0


class DamagedRecord(Exception):
    def __init__(self, offset: int, problem: str) -> None:
        super().__init__(problem)
        self.offset, self.problem = offset, problem


def parse_parts(reader: WindowReader, pos: int, size: int) -> tuple[Parts, int]:
    """The payload parts of the record at ``pos`` and the offset of the record after it."""
    parts: list[tuple[int, int]] = []
    p = pos
    while True:
        head = reader.read(p, 8)
        if len(head) < 8:
            raise DamagedRecord(p, f"{_where(pos, p)}the file ends inside a record header")
        magic, lrecord = struct.unpack("<II", head)
        if magic != RECORD_MAGIC:
            raise DamagedRecord(p, f"{_where(pos, p)}bad magic 0x{magic:08x} (expected 0x{RECORD_MAGIC:08x})")
        cflag, length = lrecord >> 29, lrecord & LENGTH_MASK
        if p + 8 + length > size:
            raise DamagedRecord(p, f"{_where(pos, p)}length {length} runs past the end of the file ({size} bytes)")
        if cflag > 3 or (not parts and cflag in (2, 3)) or (parts and cflag in (0, 1)):
            raise DamagedRecord(p, f"{_where(pos, p)}continuation flag {cflag} out of sequence")
        parts.append((p + 8, length))
        p += 8 + length + (-length % 4)
        if cflag in (0, 3):
            return tuple(parts), p


def _where(pos: int, part: int) -> str:
    """How a damaged part is named after its own byte offset: "" or the record it belongs to."""
    return "" if part == pos else f"(a part of the record at byte offset {pos}) "


def read_payload(fill: Fill, parts: Parts, buf: memoryview, start: int) -> int:
    """Read the joined payload (magic between parts) from logical offset ``start`` into ``buf``."""
    if len(parts) == 1:
        off, length = parts[0]
        return fill(buf[: max(0, min(len(buf), length - start))], off + start)
    end = start + len(buf)
    cursor, pos = start, 0
    for k, (off, length) in enumerate(parts):
        for seg_len, seg_off in ((length, off), (4 if k < len(parts) - 1 else 0, -1)):
            if pos <= cursor < pos + seg_len:
                n = min(end, pos + seg_len) - cursor
                piece = buf[cursor - start : cursor - start + n]
                if seg_off < 0:
                    piece[:] = MAGIC_BYTES[cursor - pos : cursor - pos + n]
                elif fill(piece, seg_off + cursor - pos) != n:
                    return cursor - start
                cursor += n
                if cursor == end:
                    return len(buf)
            pos += seg_len
    return cursor - start


def find_record_start(fd: int, start: int, size: int) -> int:
    """The first 4-aligned offset from ``start`` holding the magic and a first-part flag, or ``size``."""
    pos = (start + 3) & ~3
    while pos < size:
        chunk = os.pread(fd, SCAN_CHUNK + 4, pos)  # 4 bytes of overlap: the lrecord after a last-word magic
        words = np.frombuffer(chunk, "<u4", len(chunk) // 4)
        for i in np.flatnonzero(words[:-1] == RECORD_MAGIC):
            if int(words[i + 1]) >> 29 in (0, 1):
                return pos + 4 * int(i)
        if len(chunk) < SCAN_CHUNK + 4:
            break
        pos += SCAN_CHUNK
    return size


class RecordIOSource(ListedOnce):
    """The image records of one RecordIO file, named ``<label>/<id>.<ext>``."""

    forkable = True  # read_into only preads descriptors opened before packing starts

    provides_labels = True

    def __init__(self, path: str | os.PathLike, *, idx_path: str | None = None, skip_damaged: bool = False) -> None:
        self.path = os.fspath(path)
        self.description = self.path
        if idx_path is None:
            candidate = os.path.splitext(self.path)[0] + ".idx"
            idx_path = candidate if os.path.isfile(candidate) else None
        self.idx_path = idx_path
        self._damage = DamageLog(self.path, skip_damaged)
        self._full_labels: dict[str, list[float]] = {}
        self._fd = -1

    # --- the Source interface ---------------------------------------------------------------------
    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        assert isinstance(entry, RecordEntry)
        return read_payload(partial(pread_into, self._fd), entry.parts, buf, entry.skip + offset)

    def damaged(self) -> list[str]:
        return list(self._damage.items)

    def write_metadata(self, dest: str, fsync: bool) -> dict:
        """Write ``labels.json`` (records with several or non-integer labels) into ``dest``; describe the source."""
        meta: dict = {
            "kind": "recordio",
            "indexed": self.idx_path is not None,
            "records": sum(1 for e in self._entries or () if e.kind == KIND_FILE),
            "skipped_damaged": self.damaged(),
        }
        if self._full_labels:
            labels = {"format": "blockfs-record-labels", "version": 1, "labels": self._full_labels}
            raw = (json.dumps(labels, sort_keys=True) + "\n").encode("utf-8")
            dir_fd = os.open(dest, USER_DIR_FLAGS)
            try:  # by name in DEST, never through a link planted there (storage.owned)
                write_file_at(dir_fd, LABELS_FILE, (raw,), mode=0o666, sync=fsync)
            finally:
                os.close(dir_fd)
            meta["labels_file"] = LABELS_FILE
            # A link of the chain that names the dataset (blockfs.json holds this): the labels are its data too.
            meta["labels_blake3"] = digest(raw).hex()
        return meta

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    # --- listing ---------------------------------------------------------------------------------
    def _load(self) -> list[SourceEntry]:
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise SourceError(f"cannot read source {self.path!r}: {e.strerror}") from e
        st = os.fstat(self._fd)
        self._reader = WindowReader(self._fd)
        tree = TreeBuilder(self.path)
        tree.set_root(DIR_MODE, st.st_mtime_ns)
        if self.idx_path is None:
            log.info("%s has no .idx beside it: finding its records by scanning", self.path)
        records = self._indexed(self.idx_path, st.st_size) if self.idx_path else self._scanned(st.st_size)
        used: set[bytes] = set()
        for pos, parts in records:
            entry = self._record_entry(pos, parts, st.st_mtime_ns, used)
            if entry is not None:
                tree.add(entry)
        del self._reader  # its window is only for listing
        return tree.entries()

    def _scanned(self, size: int) -> Iterator[tuple[int, Parts]]:
        pos = 0
        while pos < size:
            try:
                parts, nxt = parse_parts(self._reader, pos, size)
            except DamagedRecord as d:
                pos = self._damage.report(d.offset, d.problem, lambda: find_record_start(self._fd, d.offset + 4, size))
                continue
            yield pos, parts
            pos = nxt

    def _indexed(self, idx_path: str, size: int) -> Iterator[tuple[int, Parts]]:
        try:
            with open(idx_path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise SourceError(f"cannot read index {idx_path!r}: {e.strerror}") from e
        for number, line in enumerate(lines, 1):
            fields = line.split("\t")
            if not line.strip():
                continue
            if len(fields) != 2 or not fields[1].strip().isdigit():
                raise SourceError(
                    f"{idx_path} line {number}: expected 'key<TAB>offset', got {line[:60]!r}; "
                    "fix or delete the .idx file (without it the records are found by scanning)"
                )
            pos = int(fields[1])
            try:
                parts, _ = parse_parts(self._reader, pos, size)
            except DamagedRecord as d:
                self._damage.report(d.offset, f"{d.problem} (key {fields[0]!r} in {os.path.basename(idx_path)})")
                continue
            yield pos, parts

    def _record_entry(self, pos: int, parts: Parts, mtime_ns: int, used: set[bytes]) -> RecordEntry | None:
        total = sum(length for _, length in parts) + 4 * (len(parts) - 1)
        head = self._payload(parts, 0, HEAD_BYTES)  # header, labels and image signature, usually
        if len(head) < IR_HEADER.size:
            self._damage.report(
                pos, f"a record of {total} bytes is too short for the {IR_HEADER.size}-byte image record header"
            )
            return None
        flag, label, rec_id, _id2 = IR_HEADER.unpack_from(head)
        skip = IR_HEADER.size + 4 * flag
        if skip > total:
            self._damage.report(
                pos, f"the record header announces {flag} labels, more than the record's {total} bytes hold"
            )
            return None
        if skip + SIGNATURE_BYTES > len(head) < total:  # many labels: read on
            head = self._payload(parts, 0, skip + SIGNATURE_BYTES)
        labels = np.frombuffer(head, "<f4", flag, IR_HEADER.size).tolist() if flag else [label]
        first = labels[0]
        ext = sniff_extension(head[skip : skip + SIGNATURE_BYTES])
        stem = f"{label_name(first)}/{rec_id}"
        path, n = os.fsencode(stem + ext), 0
        while path in used:
            n += 1
            path = os.fsencode(f"{stem}_{n}{ext}")
        used.add(path)
        label_int = index_label(first)
        if flag > 0 or label_int != first:
            self._full_labels[os.fsdecode(path)] = [float(str(np.float32(v))) for v in labels]
        return RecordEntry(path, KIND_FILE, FILE_MODE, mtime_ns, total - skip, label=label_int, parts=parts, skip=skip)

    def _payload(self, parts: Parts, start: int, n: int) -> bytes:
        if len(parts) == 1:
            off, length = parts[0]
            return self._reader.read(off + start, max(0, min(n, length - start)))
        buf = bytearray(n)
        got = read_payload(self._reader.fill, parts, memoryview(buf), start)
        return bytes(buf[:got])


def read_record_labels(ds: PackedDataset) -> dict[str, list[float]]:
    """Every file's full labels in a dataset packed from RecordIO: path -> float32 labels.

    Files not in ``labels.json`` had one integer label, the one in the index.
    """
    source = ds.metadata.get("source") or {}
    if source.get("kind") != "recordio":
        raise SourceError(f"{ds.root!r} was not packed from a RecordIO file")
    full: dict[str, list[float]] = {}
    if "labels_file" in source:
        name = source["labels_file"]
        path = os.path.join(ds.root, str(name))
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise FormatError(
                f"{ds.root}: {METADATA_NAME} names the labels file {name!r}, not a file of the "
                "dataset: restore the dataset from a good copy or pack it again"
            )
        dir_fd = os.open(ds.root, USER_DIR_FLAGS)
        try:  # a regular file of the dataset only: never a link out of it, a FIFO or a device
            raw = read_regular_at(dir_fd, name)
        finally:
            os.close(dir_fd)
        if raw is None:
            raise FormatError(
                f"{path}: missing, unreadable or not a regular file: restore the dataset from a good "
                "copy or pack it again"
            )
        if ds.has_digests and digest(raw).hex() != source.get("labels_blake3"):
            raise FormatError(
                f"{path}: not the labels {METADATA_NAME} names (its BLAKE3 digest differs): restore the dataset "
                "from a good copy or pack it again"
            )
        full = json.loads(raw)["labels"]
    out = {}
    for e in ds.file_ids:
        path = os.fsdecode(ds.path_of(int(e)))
        out[path] = full.get(path, [float(ds.labels[e])])
    return out
