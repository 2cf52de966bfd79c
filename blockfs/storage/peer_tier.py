"""``PeerTier``: the blocks other nodes of the job hold, read from the node that owns each one.

Every node computes the same owner for every block (``owner_of``, made by the mount: rendezvous hashing
over the peer list, or the ``partition="node"`` split), so the owner is the node that caches it and a node
that lacks a block asks exactly one peer.  It asks for what the read needs, never more: one file's bytes
(a read of a file of a block this node does not hold), a header (its first :data:`HEAD_BYTES`, kept for
the few reads that follow, as the remote store keeps a head), or a whole data section (a block memory or
the disk tier will hold).  The protocol and its client are :mod:`blockfs.storage.peer_protocol`.

What a peer sends is trusted for nothing: the chain hands it to the verifier like any tier's bytes (a file
by its own digest, a header by its digest, a data section by its chunks'), and a failed check drops what
was kept of the block (:meth:`PeerTier.drop`), avoids that peer for a while and reads the block from
further down (the store).  A peer that does not answer within ``timeout`` seconds (connect, headers, or any
wait between bytes) or answers anything but the range asked for is avoided alike: for ``backoff`` seconds,
doubled on each failure in a row, up to :data:`BACKOFF_MAX_S`; a success clears it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .chain import Tier
from .kept_pieces import KeptPieces
from .peer_protocol import PeerClient, block_path, split_address

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 2.0  # a peer silent this long (connect, headers, between bytes) is given up on
PEER_BACKOFF_S = 5.0  # then avoided this long, doubled on each failure in a row
BACKOFF_MAX_S = 60.0
# A block's first bytes, fetched once for its header (read in two steps: preamble, then the header) and
# kept for the last HEADS_KEPT blocks: 12 bytes a file, so 4 KiB holds the header of a block of ~330 files
# (a longer one costs one more request, once per block).
HEAD_BYTES = 4 << 10
HEADS_KEPT = 64


@dataclass(frozen=True)
class PeerOptions:
    """The job's peers: every node's ``HOST:PORT`` (same list, same order on every node), this node's index
    in it, the shared secret (never in a repr, so never in a log line), and how long a peer may be slow."""

    addresses: tuple[str, ...]
    rank: int
    secret: bytes = field(repr=False)
    listen: str | None = None  # where this node's endpoint listens (default: its own entry)
    timeout: float = PEER_TIMEOUT_S
    backoff: float = PEER_BACKOFF_S

    def __post_init__(self) -> None:
        for address in self.addresses:
            split_address(address)
        if not 0 <= self.rank < len(self.addresses):
            raise ValueError(
                f"peer rank {self.rank} is not one of the {len(self.addresses)} peers (0 to "
                f"{len(self.addresses) - 1}): give --peer-rank, or set NODE_RANK"
            )
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"--peers names a node twice: {','.join(self.addresses)}")
        if self.timeout <= 0 or self.backoff < 0:
            raise ValueError(f"peer timeout {self.timeout} and backoff {self.backoff}: the timeout must be > 0")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each element (uint64, wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rendezvous_owners(n_blocks: int, addresses: Sequence[str]) -> np.ndarray:
    """The owner of each block (an index into ``addresses``): highest random weight over the nodes, keyed by
    each node's address, so every node computes the same owners and a node leaving moves only its blocks."""
    blocks = np.arange(n_blocks, dtype=np.uint64)
    best = np.zeros(n_blocks, dtype=np.int64)
    top = np.zeros(n_blocks, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i, address in enumerate(addresses):
            key = np.uint64(int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(), "little"))
            score = _mix(blocks * np.uint64(0x9E3779B97F4A7C15) ^ key)
            better = score > top if i else np.ones(n_blocks, dtype=bool)
            best[better], top[better] = i, score[better]
    return best


class ServedCounts:
    """What this node's endpoint served (:mod:`blockfs.serve.peer_endpoint` counts into it): made with the
    tier, so ``blockfs stats`` shows both sides of this node's peering in one section."""

    NAMES = ("requests", "ranges_served", "bytes_served", "refused", "fetched_for_peers")

    def __init__(self, listen: str) -> None:
        self.listen = listen
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_all(self, **counts: int) -> None:
        """Several counts under one lock (a request's)."""
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def snapshot(self) -> dict:
        with self._lock:
            return {"listen": self.listen, **self._counts}


class _Peer:
    __slots__ = ("client", "avoid_until", "failures", "bytes", "fetches", "errors", "rejected")

    def __init__(self, client: PeerClient) -> None:
        self.client = client
        self.avoid_until = 0.0
        self.failures = 0  # in a row
        self.bytes = self.fetches = 0  # received (whether or not the check then passed); requests answered
        self.errors = self.rejected = 0  # requests that failed; bytes that failed the check


class PeerTier(Tier):
    """Blocks owned by other nodes of ``options`` (of the dataset named ``dataset``, blocks ``sizes`` long)."""

    name = "peers"

    def __init__(self, options: PeerOptions, dataset: str, sizes: Sequence[int]) -> None:
        if not options.secret:
            raise ValueError("a peer tier needs the job's shared secret")
        self._peers = [_Peer(PeerClient(a, options.secret, options.timeout)) for a in options.addresses]
        self._me = options.rank
        self._owner: list[int] = rendezvous_owners(len(sizes), options.addresses).tolist()
        self._dataset = dataset
        self._sizes = list(sizes)
        self.backoff = options.backoff
        self._lock = threading.Lock()
        self._heads = KeptPieces(HEADS_KEPT)
        self._failed_checks: set[int] = set()  # blocks whose peer bytes failed a check: the store's from now on
        self.served = ServedCounts(options.listen or options.addresses[options.rank])  # the endpoint counts here

    def owner(self, block: int) -> int:
        return self._owner[block]

    @property
    def rank(self) -> int:
        return self._me

    def set_owners(self, owner_of: Sequence[int]) -> None:
        """Owners other than rendezvous hashing's (the ``partition="node"`` split, when that is on)."""
        if len(owner_of) != len(self._sizes) or not all(0 <= o < len(self._peers) for o in owner_of):
            raise ValueError(f"an owner for each of {len(self._sizes)} blocks, among {len(self._peers)} peers")
        self._owner = list(owner_of)

    def holds(self, block: int) -> bool:
        owner = self._owner[block]
        if owner == self._me:
            return False
        with self._lock:
            return block not in self._failed_checks and self._peers[owner].avoid_until <= time.monotonic()

    # --- bytes out: the range a read asks for --------------------------------------------------------
    def pread(self, block: int, size: int, offset: int) -> bytes:
        if size == 0:
            return b""
        if offset + size <= min(HEAD_BYTES, self._sizes[block]):  # a header's read: the kept head
            return bytes(self._head(block)[offset : offset + size])
        buf = bytearray(size)
        self._get(block, memoryview(buf), offset)
        return bytes(buf)

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        head = self._heads.peek(block)
        done = 0
        if head is not None and offset < len(head):  # a data section starts inside the head: not asked twice
            done = min(len(view), len(head) - offset)
            view[:done] = head[offset : offset + done]
        if done < len(view):
            self._get(block, view[done:], offset + done)

    def _head(self, block: int) -> memoryview:
        """The block's first bytes, fetched once however many readers ask at once."""

        def fetch() -> memoryview:
            buf = bytearray(min(HEAD_BYTES, self._sizes[block]))
            self._get(block, memoryview(buf), 0)
            return memoryview(bytes(buf))

        return self._heads.get(block, fetch)

    def _get(self, block: int, view: memoryview, offset: int) -> None:
        """One ranged GET of ``block`` from its owner into ``view``, counted."""
        peer = self._peers[self._owner[block]]
        try:
            peer.client.get_into(block_path(self._dataset, block), view, offset, self._sizes[block])
        except OSError:
            with self._lock:
                peer.errors += 1
            raise
        with self._lock:
            peer.bytes += len(view)
            peer.fetches += 1
            peer.failures = 0

    # --- failures ------------------------------------------------------------------------------------
    def failed(self, block: int, error: OSError) -> None:
        self._avoid(self._owner[block], str(error))

    def drop(self, block: int) -> bool:
        """What the owner sent of ``block`` failed its check (the chain asks only the tier that served it):
        forget it and avoid that peer, so the block is read from the store (this block for good, whatever the
        backoff: a check that fails again and again must not loop)."""
        self._heads.drop(block)
        with self._lock:
            self._failed_checks.add(block)
            self._peers[self._owner[block]].rejected += 1
        self._avoid(self._owner[block], f"block {block} failed its check")
        return True

    def discard(self, block: int) -> None:
        self._heads.drop(block)  # a failed read or check starts afresh, as the remote store's head does

    def _avoid(self, owner: int, why: str) -> None:
        with self._lock:
            peer = self._peers[owner]
            peer.failures += 1
            wait = min(BACKOFF_MAX_S, self.backoff * 2 ** (peer.failures - 1))
            peer.avoid_until = time.monotonic() + wait
        log.warning("peer %s: %s: reading from the store, and avoiding it for %.0f s", peer.client.address, why, wait)

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            per_peer: dict[str, dict] = {
                p.client.address: {
                    "bytes": p.bytes,
                    "fetches": p.fetches,
                    "errors": p.errors,
                    "rejected": p.rejected,
                    "avoided": p.avoid_until > now,
                }
                for i, p in enumerate(self._peers)
                if i != self._me
            }
            out = {
                "rank": self._me,
                "kept_bytes": self._heads.nbytes(),
                "bytes": sum(p.bytes for p in self._peers),
                "by_peer": per_peer,
            }
        return {"peers": {**out, "served": self.served.snapshot()}}

    def close(self) -> None:
        self._heads.clear()
        for peer in self._peers:
            peer.client.close()
