"""``blockfs.json``, a packed dataset's metadata: read it and check it against one schema, in one place.

Everything blockfs later reads from the metadata (counts, the index's CRC, classes, the pack parameters)
is checked here once, so a damaged or hand-edited file is one clear :class:`FormatError` naming the
field, never a ``KeyError`` or ``TypeError`` wherever the field happens to be used first.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable

from ..errors import FormatError, NotADatasetError, UnsupportedVersionError
from . import digest as dg
from .format import INDEX_NAME, METADATA_NAME, PACKING_MARKER
from .index_format import REPACK as FIX
from .index_format import short_repr

METADATA_LIMIT = 64 << 20  # far above any blockfs.json (a million class names): a bound on what is read


# blockfs.json's "format_version": 2 records the index's digest (the chain that names the dataset); 1 does
# not and is still read, checked against accidents (CRC-32) only.  Blocks have their own version (format.py).
METADATA_VERSION = 2
OLDEST_METADATA_VERSION = 1


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


def _is_crc(v: object) -> bool:
    return type(v) is int and 0 <= v < 1 << 32


def _class_names(v: object) -> bool:
    return v is None or (isinstance(v, list) and all(isinstance(c, str) for c in v))


# field -> (test, what the field must be)
TOP_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "n_entries": (_count, "an integer >= 0"),
    "n_files": (_count, "an integer >= 0"),
    "n_dirs": (_count, "an integer >= 0"),
    "n_symlinks": (_count, "an integer >= 0"),
    "n_blocks": (_count, "an integer >= 0"),
    "file_bytes": (_count, "an integer >= 0"),
    "block_bytes": (_count, "an integer >= 0"),
    "classes": (_class_names, "null or a list of class names"),
    "index": (lambda v: isinstance(v, dict), "an object"),
    "pack": (lambda v: isinstance(v, dict), "an object"),
    "source": (lambda v: isinstance(v, dict), "an object (only container packs have it)"),
}
OPTIONAL = {"source"}
INDEX_FIELDS = {
    "file": (lambda v: v == INDEX_NAME, f"{INDEX_NAME!r}"),
    "crc32": (_is_crc, "a 32-bit CRC (an integer)"),
    "blake3": (dg.is_hex_digest, "the index's BLAKE3 digest (64 lowercase hex digits)"),
}
OPTIONAL_BEFORE_DIGESTS = {"blake3"}  # format_version 1 has no digests
PACK_FIELDS = {
    "block_size": (lambda v: type(v) is int and v > 0, "an integer > 0"),
    "files_per_block": (lambda v: v is None or (type(v) is int and v > 0), "null or an integer > 0"),
    "labels": (lambda v: isinstance(v, str), "a string"),
    "order": (lambda v: isinstance(v, str), "a string"),
    "seed": (lambda v: type(v) is int, "an integer"),
    "follow_symlinks": (lambda v: type(v) is bool, "true or false"),
}


def read_metadata(root: str) -> dict:
    """The dataset's metadata, checked; or a NotADatasetError / FormatError that says what is wrong and
    what to do."""
    return read_metadata_bytes(root)[0]


def read_metadata_bytes(root: str, expect: str | None = None, display: str | None = None) -> tuple[dict, bytes]:
    """(the dataset's metadata, checked; ``blockfs.json``'s bytes as read, which name the dataset).

    ``expect``: the pinned name; a dataset with another is refused before anything of it is parsed."""
    meta_path = os.path.join(root, METADATA_NAME)
    if not os.path.lexists(root):
        raise NotADatasetError(f"{root!r} does not exist: check the path, or run 'blockfs pack' to make it")
    if not os.path.isdir(root):
        raise NotADatasetError(f"{root!r} is not a directory, so not a packed dataset")
    if not os.path.exists(meta_path):
        if os.path.exists(os.path.join(root, PACKING_MARKER)):
            why = _failure(os.path.join(root, PACKING_MARKER))
            raise NotADatasetError(
                f"{root!r} is an unfinished pack ("
                + (f"it failed: {why}" if why else "it was interrupted")
                + "): run 'blockfs pack' again"
            )
        raise NotADatasetError(f"{root!r} is not a packed dataset (no {METADATA_NAME}): run 'blockfs pack' first")
    try:  # O_NONBLOCK: a FIFO planted there must not block the open
        with open(os.open(meta_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
            raw = f.read(METADATA_LIMIT + 1) if regular else b""
    except OSError as e:
        raise FormatError(f"{meta_path}: unreadable metadata: {e}; {FIX}") from e
    if not regular:  # a FIFO would never end, /dev/zero would fill memory
        raise FormatError(f"{meta_path}: not a regular file (a FIFO, a device or a directory); {FIX}")
    if len(raw) > METADATA_LIMIT:
        raise FormatError(f"{meta_path}: over {METADATA_LIMIT >> 20} MiB, not blockfs metadata; {FIX}")
    dg.check_name(f"dataset {display or root!r}", dg.name_of(raw), expect)
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{meta_path}: unreadable metadata: {e}; {FIX}") from e
    if not isinstance(meta, dict) or meta.get("format") != "blockfs":
        raise FormatError(f'{meta_path}: not blockfs metadata (no "format": "blockfs"); {FIX}')
    check_version(meta.get("format_version"), root)
    check_metadata(meta, meta_path)
    return meta, raw


def _failure(marker: str) -> str:
    """Why the pack that left ``marker`` failed, as it wrote there (one line); empty if it was killed first."""
    try:  # never through a link, never waiting on a FIFO: only a regular file written by a pack is read
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        text = os.read(fd, 1000).decode("utf-8", "replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    except OSError:
        return ""
    finally:
        os.close(fd)
    return text.splitlines()[0] if text else ""


def metadata_bytes(meta: dict) -> bytes:
    """``blockfs.json``'s bytes for ``meta``: sorted keys, no time or host, so one dataset has one name."""
    return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8")


def has_digests(meta: dict) -> bool:
    """Whether the metadata starts the chain of digests (format 2), or is checked by CRC only (format 1)."""
    return "blake3" in meta["index"]


def check_version(version: object, root: str) -> None:
    """Refuse packs written by a newer blockfs (upgrade) or an older format (pack again)."""
    if type(version) is not int:
        raise FormatError(
            f"{os.path.join(root, METADATA_NAME)}: field 'format_version' must be an integer, got "
            f"{short_repr(version)}; {FIX}"
        )
    if version > METADATA_VERSION:
        raise UnsupportedVersionError(
            f"{root!r} was written by blockfs format version {version}; this blockfs reads up to version "
            f"{METADATA_VERSION}: upgrade blockfs"
        )
    if version < OLDEST_METADATA_VERSION:
        raise UnsupportedVersionError(
            f"{root!r} was written by blockfs format version {version}, older than this blockfs reads "
            f"({OLDEST_METADATA_VERSION}): pack the source again with 'blockfs pack SRC {root}'"
        )


def check_metadata(meta: dict, where: str) -> None:
    """Every field blockfs reads has the type it must (the schema above)."""
    _check_fields(meta, TOP_FIELDS, where, "")
    optional = OPTIONAL_BEFORE_DIGESTS if meta["format_version"] < 2 else set()
    _check_fields(meta["index"], INDEX_FIELDS, where, "index.", optional)
    _check_fields(meta["pack"], PACK_FIELDS, where, "pack.")


def _check_fields(obj: dict, fields: dict, where: str, prefix: str, optional: set[str] = OPTIONAL) -> None:
    for name, (test, what) in fields.items():
        if name not in obj:
            if name in optional:
                continue
            raise FormatError(f"{where}: field {prefix + name!r} is missing; {FIX}")
        if not test(obj[name]):
            raise FormatError(f"{where}: field {prefix + name!r} must be {what}, got {short_repr(obj[name])}; {FIX}")
