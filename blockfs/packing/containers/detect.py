"""Tell what a source file is from its first bytes, not its name."""

from __future__ import annotations

import struct
import tarfile

from ...errors import SourceError
from .recordio import RECORD_MAGIC
from .spool import DECOMPRESS_ERRORS, DECOMPRESSORS

COMPRESSION_MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
}
UNSUPPORTED_MAGIC = {
    b"\x28\xb5\x2f\xfd": "zstd (decompress it first: zstd -d)",
    b"\x04\x22\x4d\x18": "lz4 (decompress it first: lz4 -d)",
    b"PK\x03\x04": "zip",
}


def looks_like_tar(head: bytes) -> bool:
    """A tar header block: the ustar magic, or (old V7 archives) a valid header checksum."""
    if len(head) < tarfile.BLOCKSIZE:
        return False
    if head[257:262] == b"ustar":
        return True
    try:
        tarfile.TarInfo.frombuf(head[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def sniff(path: str) -> tuple[str, str | None]:
    """``("recordio", None)``, ``("tar", None)`` or ``("tar", "gzip"|"bzip2"|"xz")`` for the file at ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(tarfile.BLOCKSIZE)
    except OSError as e:
        raise SourceError(f"cannot read source {path!r}: {e.strerror}") from e
    if len(head) >= 8:
        magic, lrecord = struct.unpack_from("<II", head)
        if magic == RECORD_MAGIC and lrecord >> 29 in (0, 1):
            return "recordio", None
    for magic, compression in COMPRESSION_MAGIC.items():
        if head.startswith(magic):
            try:
                inner, cut_short = _stream_head(path, compression, tarfile.BLOCKSIZE)
            except DECOMPRESS_ERRORS as e:
                raise SourceError(f"source {path!r} is {compression}-compressed but does not decompress: {e}") from e
            if looks_like_tar(inner) or cut_short:  # a truncated stream is the tar reader's to report
                return "tar", compression
            raise SourceError(f"source {path!r} is {compression}-compressed but holds no tar archive")
    if looks_like_tar(head):
        return "tar", None
    for magic, what in UNSUPPORTED_MAGIC.items():
        if head.startswith(magic):
            raise SourceError(f"source {path!r} is {what}, which blockfs cannot pack")
    raise SourceError(
        f"source {path!r} is not a directory, a tar archive (plain, gzip, bzip2 or xz), an MXNet RecordIO "
        f"file or a WebDataset shard (it starts with bytes {head[:8].hex(' ')})"
    )


def _stream_head(path: str, compression: str, n: int) -> tuple[bytes, bool]:
    """The first ``n`` decompressed bytes (bzip2 needs up to a whole block of input for them), and
    whether the file ended, mid-stream, before giving that many."""
    d = DECOMPRESSORS[compression]()
    out = b""
    with open(path, "rb") as raw:
        while len(out) < n and not d.eof and (chunk := raw.read(1 << 16)):
            out += d.decompress(chunk, n - len(out))
    return out, len(out) < n and not d.eof
