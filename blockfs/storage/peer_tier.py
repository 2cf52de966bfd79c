"""``PeerTier``: the blocks other nodes of the job hold, fetched from the node that owns each one.

Every node computes the same owner for every block (``owner_of``, made by the mount: rendezvous hashing
over the peer list, or the ``partition="node"`` split), so the owner is the node that caches it and a node
that lacks a block asks exactly one peer.  What a peer sends is trusted for nothing: the chain hands it to
the verifier like any tier's bytes, and a failed check drops it (:meth:`PeerTier.drop`), avoids that peer
for a while and reads the block from further down (the store).

The protocol (the server is :mod:`blockfs.serve.peer_endpoint`): ``GET /blockfs/v1/<dataset>/<block>``,
where ``<dataset>`` is the hex of the dataset's name (``blake3:<hex>``) and ``<block>`` a decimal block
number, with the header ``X-Blockfs-Auth: <HMAC-SHA256 of "GET <path>" under the job's secret>`` (the
secret itself never crosses the network).  The answer is the whole block file, or ``Range: bytes=a-b`` of
it.  An owner that must fetch the block first answers its headers at once with ``X-Blockfs-Fetching: 1``
and the body when the block is verified; the asker then waits :data:`OWNER_FETCH_S` for it, not its own
store (one fetch per block for the whole cluster).

A peer that does not answer within ``timeout`` seconds (connect, headers, or any wait between bytes),
answers anything but the whole block, or sends bytes that fail the check is avoided for ``backoff`` seconds
(doubled on each failure in a row, up to :data:`BACKOFF_MAX_S`); a success clears it.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import http.client
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from .chain import Tier

log = logging.getLogger(__name__)

PATH_PREFIX = "/blockfs/v1/"
AUTH_HEADER = "X-Blockfs-Auth"
FETCHING_HEADER = "X-Blockfs-Fetching"  # the owner is fetching the block: wait for it, not the store
PEER_TIMEOUT_S = 2.0  # a peer silent this long (connect, headers, between bytes) is given up on
PEER_BACKOFF_S = 5.0  # then avoided this long, doubled on each failure in a row
BACKOFF_MAX_S = 60.0
OWNER_FETCH_S = 30.0  # how long an owner may take to fetch a block it said it is fetching
# Blocks fetched from peers, kept for the reads that follow (a header, then its files, which a block-shuffled
# order sends together): a window outside the memory plan, so a small one, like the read-ahead's.
KEPT_BLOCKS = 4
KEPT_BYTES = 64 << 20


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


def block_path(dataset: str, block: int) -> str:
    """The request path of ``block`` of the dataset named ``dataset`` (``blake3:<hex>`` or the hex)."""
    return f"{PATH_PREFIX}{dataset.removeprefix('blake3:')}/{block}"


def sign(secret: bytes, path: str) -> str:
    """The value of :data:`AUTH_HEADER` for a GET of ``path``."""
    return hmac.new(secret, b"GET " + path.encode(), hashlib.sha256).hexdigest()


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); ValueError naming it otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class _Peer:
    __slots__ = ("address", "host", "port", "avoid_until", "failures", "bytes", "fetches", "errors", "rejected")

    def __init__(self, address: str) -> None:
        self.address = address
        self.host, self.port = split_address(address)
        self.avoid_until = 0.0
        self.failures = 0  # in a row
        self.bytes = self.fetches = 0  # received (whether or not the check then passed)
        self.errors = self.rejected = 0  # fetches that failed; blocks that failed the check


class PeerTier(Tier):
    """Blocks owned by other nodes of ``options`` (of the dataset named ``dataset``, blocks ``sizes`` long)."""

    name = "peers"

    def __init__(self, options: PeerOptions, dataset: str, sizes: Sequence[int]) -> None:
        if not options.secret:
            raise ValueError("a peer tier needs the job's shared secret")
        self._peers = [_Peer(a) for a in options.addresses]
        self._me = options.rank
        self._owner: list[int] = rendezvous_owners(len(sizes), options.addresses).tolist()
        self._dataset = dataset
        self._secret = options.secret
        self._sizes = list(sizes)
        self.timeout = options.timeout
        self.backoff = options.backoff
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, memoryview] = OrderedDict()
        self._kept_bytes = 0
        self._fetching: dict[int, Future] = {}
        self.served: Callable[[], dict] | None = None  # this node's endpoint's counters, for stats

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
            return block in self._kept or self._peers[owner].avoid_until <= time.monotonic()

    # --- bytes out: the whole block fetched once, kept for the reads that follow -----------------------
    def pread(self, block: int, size: int, offset: int) -> bytes:
        return bytes(self._block(block)[offset : offset + size])

    def read_into(self, block: int, view: memoryview, offset: int) -> None:
        view[:] = self._block(block)[offset : offset + len(view)]
        if offset + len(view) == self._sizes[block]:  # a whole data section, for memory: no need to keep it here
            with self._lock:
                kept = self._kept.pop(block, None)
                if kept is not None:
                    self._kept_bytes -= len(kept)

    def _block(self, block: int) -> memoryview:
        with self._lock:
            data = self._kept.get(block)
            if data is not None:
                self._kept.move_to_end(block)
                return data
            future = self._fetching.get(block)
            mine = future is None
            if mine:
                future = self._fetching[block] = Future()
        assert future is not None
        if not mine:
            return future.result()
        try:
            data = self._fetch(block)
        except BaseException as e:
            with self._lock:
                self._fetching.pop(block, None)
            future.set_exception(e)
            raise
        with self._lock:
            self._fetching.pop(block, None)
            self._kept[block] = data
            self._kept_bytes += len(data)
            while (self._kept_bytes > KEPT_BYTES or len(self._kept) > KEPT_BLOCKS) and len(self._kept) > 1:
                self._kept_bytes -= len(self._kept.popitem(last=False)[1])
        future.set_result(data)
        return data

    def _fetch(self, block: int) -> memoryview:
        peer = self._peers[self._owner[block]]
        size = self._sizes[block]
        path = block_path(self._dataset, block)
        conn = http.client.HTTPConnection(peer.host, peer.port, timeout=self.timeout)
        try:
            conn.request("GET", path, headers={AUTH_HEADER: sign(self._secret, path)})
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(errno.EIO, f"peer {peer.address} answered {resp.status} {resp.reason}")
            if resp.getheader("Content-Length") != str(size):
                raise OSError(
                    errno.EIO,
                    f"peer {peer.address} offered {resp.getheader('Content-Length')} bytes, not the block's {size}",
                )
            if resp.getheader(FETCHING_HEADER) and conn.sock is not None:
                conn.sock.settimeout(max(self.timeout, OWNER_FETCH_S))  # the owner fetches it once for all
            buf = bytearray(size)
            view, done = memoryview(buf), 0
            while done < size:
                n = resp.readinto(view[done:])
                if not n:
                    raise OSError(errno.EIO, f"peer {peer.address} sent {done} of the block's {size} bytes")
                done += n
        except (OSError, http.client.HTTPException) as e:
            with self._lock:
                peer.errors += 1
            raise e if isinstance(e, OSError) else OSError(errno.EIO, f"peer {peer.address}: {e!r}") from e
        finally:
            conn.close()
        with self._lock:
            peer.bytes += size
            peer.fetches += 1
            peer.failures = 0
        return view

    # --- failures ------------------------------------------------------------------------------------
    def failed(self, block: int, error: OSError) -> None:
        self._avoid(self._owner[block], str(error))

    def drop(self, block: int) -> bool:
        """What the owner sent of ``block`` failed its check (the chain asks only the tier that served it):
        forget it and avoid that peer, so the block is read from the store."""
        with self._lock:
            kept = self._kept.pop(block, None)
            if kept is not None:
                self._kept_bytes -= len(kept)
            self._peers[self._owner[block]].rejected += 1
        self._avoid(self._owner[block], f"block {block} failed its check")
        return True

    def discard(self, block: int) -> None:
        pass  # what was fetched is dropped only after a failed check (drop): a failed read elsewhere is not its fault

    def _avoid(self, owner: int, why: str) -> None:
        with self._lock:
            peer = self._peers[owner]
            peer.failures += 1
            wait = min(BACKOFF_MAX_S, self.backoff * 2 ** (peer.failures - 1))
            peer.avoid_until = time.monotonic() + wait
        log.warning("peer %s: %s: reading from the store, and avoiding it for %.0f s", peer.address, why, wait)

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            per_peer: dict[str, dict] = {
                p.address: {
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
                "kept_bytes": self._kept_bytes,
                "bytes": sum(p.bytes for p in self._peers),
                "by_peer": per_peer,
            }
        return {"peers": {**out, "served": self.served() if self.served is not None else None}}

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
            self._kept_bytes = 0
