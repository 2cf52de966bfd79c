"""The mount↔loader contract: every name and message format both sides of a blockfs mount must agree on.

The mount (:mod:`blockfs.serve`) publishes these and the loader (:mod:`blockfs.loader`) and the command line
read them; neither side imports the other, so this module is the one place each name is spelled.  It
imports only the standard library.

**The control directory.**  The mount root carries the extended attribute :data:`CONTROL_XATTR`, the name
of a directory at the root (:data:`DEFAULT_CONTROL`, or it with a ``-N`` suffix if the dataset has an
entry of that name) that ``readdir`` of the root does not list.  In it:

* :data:`STATS_FILE` — the mount's live statistics as JSON.  Each open sees one snapshot: the name is a
  symbolic link to ``stats/G.json``, a file whose bytes never change (a fresh G per path resolution);
* :data:`METADATA_FILE` — the dataset's ``blockfs.json``; :data:`INDEX_FILE` — its index;
* :data:`BLOCKS_DIR`/``NNNNNNNN`` (:func:`block_file_name`) — each block file as stored, served through
  the mount's cache and checks.

Extended attributes of the control directory: :data:`STATS_XATTR` (live statistics, never cached by the
kernel), :data:`PREFETCH_XATTR` and :data:`SHARE_XATTR` (the addresses of the two sockets below, present
only when the mount takes them).  Of every regular file: :data:`LABEL_XATTR`, :data:`CLASS_XATTR`,
:data:`BLOCK_XATTR`.

**Prefetch announcements** (``SOCK_STREAM``): the loader connects, sends block ids as ASCII decimal numbers
one per line, first needed first (:func:`encode_announcement`), and closes; the end of the stream ends
the announcement.  Nothing is answered; it is a hint the mount may cut short or drop.

**Block sharing** (``SOCK_SEQPACKET``): one packet per request, a block id in ASCII decimal
(:func:`encode_share_request`); one packet per answer: :data:`SHARE_OK` with the block's sealed memfd
attached (``SCM_RIGHTS``), or :data:`SHARE_REFUSED` followed by the reason.

Both sockets live in Linux's abstract namespace (the address starts with a NUL byte: nothing is left in the
filesystem when a mount is killed) and answer only processes of the mount's own user, or root.
"""

from __future__ import annotations

from collections.abc import Iterable

CONTROL_XATTR = "user.blockfs.control"  # on the mount root: the control directory's name
STATS_XATTR = "user.blockfs.stats"  # on the control directory: live statistics (JSON)
PREFETCH_XATTR = "user.blockfs.prefetch"  # on the control directory: the announcement socket's address
SHARE_XATTR = "user.blockfs.share"  # on the control directory: the block-share socket's address
LABEL_XATTR = "user.blockfs.label"  # on each file: its label (decimal), absent for unlabelled files
CLASS_XATTR = "user.blockfs.class"  # on each file: its class name, when the dataset names classes
BLOCK_XATTR = "user.blockfs.block"  # on each file: the block that holds it (decimal)
FILE_XATTRS = (LABEL_XATTR, CLASS_XATTR, BLOCK_XATTR)

DEFAULT_CONTROL = ".blockfs"
STATS_FILE = "stats.json"
STATS_SNAPSHOTS_DIR = "stats"  # stats.json -> stats/G.json, one immutable snapshot each
METADATA_FILE = "metadata.json"
INDEX_FILE = "index.bfi"
BLOCKS_DIR = "blocks"
BLOCK_NAME_DIGITS = 8

PREFETCH_SOCKET_PREFIX = b"\0blockfs-prefetch-"
SHARE_SOCKET_PREFIX = b"\0blockfs-share-"
BYTES_PER_ID = 12  # ten digits, a newline and slack: an announcement longer than every block twice is cut
SHARE_REQUEST_BYTES = 32
SHARE_ANSWER_BYTES = 4096
SHARE_OK = b"ok"
SHARE_REFUSED = b"no "


def block_file_name(block: int) -> str:
    """The name of block ``block``'s file in :data:`BLOCKS_DIR`."""
    return f"{block:0{BLOCK_NAME_DIGITS}d}"


def parse_block_file_name(name: bytes) -> int | None:
    """The block a :data:`BLOCKS_DIR` entry name gives (exactly :func:`block_file_name`'s spelling), else None."""
    if len(name) != BLOCK_NAME_DIGITS or not name.isdigit():
        return None
    return int(name)


def encode_announcement(blocks: Iterable[int]) -> bytes:
    """A prefetch announcement: the block ids, first needed first."""
    return "".join(f"{int(b)}\n" for b in blocks).encode()


def parse_announcement(data: bytes, n_blocks: int) -> list[int]:
    """The block ids of an announcement, those out of range left out; ValueError if it is not one per line."""
    try:
        blocks = [int(line) for line in data.split()]
    except ValueError:
        raise ValueError(f"not one decimal block id per line ({data[:40]!r}...)") from None
    return [b for b in blocks if 0 <= b < n_blocks]


def announcement_limit(n_blocks: int) -> int:
    """The most bytes of one announcement the mount reads (every block twice)."""
    return max(1, 2 * n_blocks) * BYTES_PER_ID


def encode_share_request(block: int) -> bytes:
    return b"%d" % block


def parse_share_request(data: bytes, n_blocks: int) -> int:
    """The block a share request names; ValueError saying why for anything else."""
    try:
        block = int(data)
    except ValueError:
        raise ValueError(f"not a decimal block id: {data[:SHARE_REQUEST_BYTES]!r}") from None
    if not 0 <= block < n_blocks:
        raise ValueError(f"block {block} out of range (0..{n_blocks - 1})")
    return block


def share_refusal(reason: str) -> bytes:
    return (SHARE_REFUSED + reason.encode(errors="replace"))[:SHARE_ANSWER_BYTES]


def parse_share_refusal(answer: bytes) -> str:
    return answer.removeprefix(SHARE_REFUSED).decode(errors="replace")
