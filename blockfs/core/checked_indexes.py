"""A record of the indexes that passed every check of this code, so a mount of the same index again skips them.

Opening an index checks its contents (:mod:`.index_checks`): at a million entries that is most of a
mount's time.  The checks are a function of the index's bytes and of the code that checks them, so once an
index whose BLAKE3 digest blockfs.json records has passed them, the same bytes pass again.  This record
keeps, per index digest, a file saying "passed, by this code"; :class:`~.index.PackedIndex` still reads
the whole index and checks its digest against blockfs.json at every open, and skips the contents' checks
only when that digest is recorded here for :func:`code_tag`.  Nothing weaker is believed: a different
index has a different digest and is checked; a record of another blockfs version, or of check code that
changed, or damaged, or that is not a regular file, is ignored (and rewritten once the checks pass).

The record lives in a directory of the user's own (:func:`default_directory`, checked by
:func:`blockfs.storage.owned.open_owned_dir`: not a link, this user's, writable by no one else, through
parents no one else can change); one that fails those checks is neither read nor written.
"""

from __future__ import annotations

import hashlib
import logging
import os

from .. import __version__
from ..storage.owned import (
    open_owned_dir,
    read_regular_at,
    regular_files_at,
    unlink_quietly_at,
    user_cache_directory,
    write_file_at,
)

log = logging.getLogger(__name__)

DIRECTORY_ENV = "BLOCKFS_CHECKED_DIR"  # where the record is kept, if not the default; "" keeps none
KEPT = 256  # records kept at most: the oldest go first
_HEAD = b"blockfs checked index\n"
# The modules whose code decides whether an index passes: a change to any of them makes every record stale.
_CHECK_MODULES = ("index_format", "index_checks", "treecheck", "index", "pathtable")
_tag: str | None = None


def code_tag() -> str:
    """The blockfs version and a digest of the check code's source: a record counts only for the same."""
    global _tag
    if _tag is None:
        h = hashlib.sha256(__version__.encode())
        here = os.path.dirname(os.path.abspath(__file__))
        for name in _CHECK_MODULES:
            with open(os.path.join(here, f"{name}.py"), "rb") as f:
                h.update(f.read())
        _tag = f"{__version__}-{h.hexdigest()[:32]}"
    return _tag


def default_directory() -> str | None:
    """``$BLOCKFS_CHECKED_DIR``, else ``~/.cache/blockfs/checked-indexes``: :func:`blockfs.storage.owned.user_cache_directory`."""
    return user_cache_directory(DIRECTORY_ENV, "checked-indexes")


class CheckedIndexes:
    """The record in ``directory``: :meth:`has` an index digest passed; :meth:`add` one that just did."""

    FIX = f"set {DIRECTORY_ENV} to a private directory (or to nothing, to keep no record)"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)

    @classmethod
    def default(cls) -> CheckedIndexes | None:
        directory = default_directory()
        return cls(directory) if directory else None

    def _open(self, create: bool) -> int | None:
        try:
            return open_owned_dir(self.directory, "checked-index record", self.FIX, create=create)
        except FileNotFoundError:
            return None
        except OSError as e:  # refused (a link, another user's, writable by others) or unreadable: no record
            (log.warning if create else log.debug)("not using the record of checked indexes: %s", e)
            return None

    @staticmethod
    def _content(index_digest: str) -> bytes:
        return _HEAD + f"{index_digest}\n{code_tag()}\n".encode()

    @staticmethod
    def _name(index_digest: str) -> str:
        if len(index_digest) != 64 or any(c not in "0123456789abcdef" for c in index_digest):
            raise ValueError(f"not a BLAKE3 digest in hex: {index_digest!r}")
        return index_digest

    def has(self, index_digest: str) -> bool:
        """Whether an index of this digest passed every check of this code (a record that says exactly so)."""
        name = self._name(index_digest)
        fd = self._open(create=False)
        if fd is None:
            return False
        try:
            return read_regular_at(fd, name) == self._content(index_digest)
        finally:
            os.close(fd)

    def add(self, index_digest: str) -> bool:
        """Record that an index of this digest passed every check; whether it was (a directory refused, or a
        write that failed, keeps nothing)."""
        name = self._name(index_digest)
        fd = self._open(create=True)
        if fd is None:
            return False
        try:
            # Not fsynced: a record cut short by a crash is not the exact content, so it is ignored.
            write_file_at(fd, name, (self._content(index_digest),), sync=False)
            _keep_newest(fd, KEPT)
            return True
        except OSError as e:
            log.warning("could not record the checked index %s in %s: %s", name, self.directory, e)
            return False
        finally:
            os.close(fd)


def _keep_newest(dir_fd: int, kept: int) -> None:
    """Remove all but the ``kept`` newest records (regular files named by a digest) in ``dir_fd``."""
    names = [n for n in os.listdir(dir_fd) if len(n) == 64]
    if len(names) <= kept:
        return
    aged = regular_files_at(dir_fd, names)
    unlink_quietly_at(dir_fd, [name for _, name in sorted(aged)[: max(0, len(aged) - kept)]])
