"""Exceptions raised by blockfs.

Every error is a :class:`BlockfsError` and also the builtin exception that fits it, so callers can catch
either (``except FileNotFoundError`` works on a missing path inside a packed dataset).  Each carries an
``errno`` the FUSE adapter hands to the kernel.
"""

from __future__ import annotations

import errno as _errno


class BlockfsError(Exception):
    """Base class of every error blockfs raises on purpose."""

    errno: int = _errno.EIO


class FormatError(BlockfsError, ValueError):
    """A block, index or metadata file is not what the format says it must be."""

    errno = _errno.EIO


class UnsupportedVersionError(FormatError):
    """The data was written by a newer (or unknown) format version."""


class CorruptBlockError(FormatError):
    """A block is damaged: its checksum, header or length is wrong, or it does not belong to the index.

    What it says about the block holds until the block file is replaced, so a mount remembers it.
    """

    def __init__(self, message: str, *, block: int | None = None) -> None:
        super().__init__(message)
        self.block = block


class BlockReadError(BlockfsError, OSError):
    """Reading a block file failed: it is missing, a read came back short, or the system refused (EMFILE,
    EIO from the device).

    Not a verdict on the block: only this read fails, and the next read of the block tries again.
    """

    errno = _errno.EIO

    def __init__(self, message: str, *, block: int | None = None) -> None:
        super().__init__(message)
        self.block = block


class IndexFormatError(FormatError):
    """The index is damaged or claims something impossible (``..``, a block out of range)."""


class NotADatasetError(BlockfsError, FileNotFoundError):
    """A path given as a packed dataset is not one (or is an unfinished pack)."""

    errno = _errno.ENOENT


class EntryNotFoundError(BlockfsError, FileNotFoundError):
    """No file, directory or link of that path in the packed dataset."""

    errno = _errno.ENOENT


class NotADirectoryEntryError(BlockfsError, NotADirectoryError):
    """A directory operation on something that is not a directory."""

    errno = _errno.ENOTDIR


class IsADirectoryEntryError(BlockfsError, IsADirectoryError):
    """A file operation on a directory."""

    errno = _errno.EISDIR


class NotASymlinkError(BlockfsError, OSError):
    """``readlink`` of something that is not a symbolic link."""

    errno = _errno.EINVAL


class DecodeError(BlockfsError, ValueError):
    """The loader's ``decode`` failed on a file: the message names its path and sample id, ``path`` and
    ``sample_id`` hold them, and the decode's own exception is the cause (``__cause__``).

    A ValueError: the file's bytes are not what ``decode`` reads (whatever decode itself raised, e.g. PIL's
    ``UnidentifiedImageError``, is kept as the cause).
    """

    errno = _errno.EIO

    def __init__(self, message: str, *, path: str | None = None, sample_id: int | None = None) -> None:
        super().__init__(message)
        self.path, self.sample_id = path, sample_id


class PackError(BlockfsError, RuntimeError):
    """Packing cannot go on: the message names the path and the fix."""

    errno = _errno.EINVAL


class SourceError(PackError):
    """The source given to ``pack`` cannot be read as a tree or container."""


class MountError(BlockfsError, RuntimeError):
    """A mount cannot be started or stopped: the message says why."""

    errno = _errno.EINVAL


class IdentityError(FormatError):
    """A dataset is not the one pinned (``--expect``), or a pin was asked of a dataset that has no digests."""
