"""A mount's peers: the options made into :class:`PeerOptions`, who owns which block, and what memory keeps.

* **Membership** from ``--peers`` (or ``$BLOCKFS_PEERS``): every node's endpoint, the same list in the same
  order on every node; this node's index from ``--peer-rank`` or torchrun's ``NODE_RANK``/``GROUP_RANK``.
* **The secret** from ``--peer-secret-file`` (a regular file of this user's that no one else may read,
  opened without following a link) or ``$BLOCKFS_PEER_SECRET``; never from a command line, and never
  written anywhere (:class:`PeerOptions` leaves it out of its repr).
* **Ownership** every node computes alike with no coordinator: rendezvous hashing over the peer list, or,
  with ``--nodes`` (``partition="node"``), the partition's split, so a node owns the part it caches.
* **Memory keeps the owned blocks first**: the cache's prefill and read-ahead load only owned blocks, and
  a block another node owns is admitted only into room the owned blocks not yet loaded will not need.  The
  room the owned blocks leave (up to :data:`WINDOW_BLOCKS` blocks) is the cache's window instead: the last
  few blocks of other nodes read whole, one request each, for the reads that follow (``serve/cache/block_window.py``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from ..core.dataset import PackedDataset
from ..errors import MountError
from ..storage.chain import TierChain
from ..storage.peer_tier import PeerOptions, PeerTier
from .cache.block_cache import BlockCache
from .cache.block_window import WINDOW_BLOCKS
from .cache.mount_plan import node_part
from .mount_options import MountOptions
from .peer_endpoint import PeerEndpoint

PEERS_ENV = "BLOCKFS_PEERS"
SECRET_ENV = "BLOCKFS_PEER_SECRET"
RANK_ENVS = ("NODE_RANK", "GROUP_RANK")  # torchrun's


def peer_options(options: MountOptions, environ: Mapping[str, str] = os.environ) -> PeerOptions | None:
    """The mount's peers, or None without ``--peers``/``$BLOCKFS_PEERS``; MountError in one line."""
    text = options.peers or environ.get(PEERS_ENV)
    if not text:
        return None
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    rank = options.peer_rank
    if rank < 0:
        found = next((environ[name] for name in RANK_ENVS if environ.get(name)), None)
        if found is None or not found.isdigit():
            raise MountError(
                "--peers needs this node's index in the list: give --peer-rank N (torchrun sets NODE_RANK)"
            )
        rank = int(found)
    try:
        return PeerOptions(
            addresses,
            rank,
            read_secret(options.peer_secret_file, environ),
            options.peer_listen,
            options.peer_timeout,
            options.peer_backoff,
        )
    except ValueError as e:
        raise MountError(str(e)) from None


def read_secret(path: str | None, environ: Mapping[str, str] = os.environ) -> bytes:
    """The job's shared secret: the file's contents (stripped) or ``$BLOCKFS_PEER_SECRET``."""
    if path is None:
        secret = environ.get(SECRET_ENV, "").strip().encode()
        if not secret:
            raise MountError(
                f"--peers needs the job's shared secret: --peer-secret-file PATH (a file only you can "
                f"read) or {SECRET_ENV}"
            )
        return secret
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise MountError(f"--peer-secret-file {path!r}: {e.strerror} (a link is not followed)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise MountError(
                f"--peer-secret-file {path!r} must be a regular file of yours that no one else may read "
                f"or write: chmod 600 {path}"
            )
        secret = os.read(fd, 1 << 16).strip()
    finally:
        os.close(fd)
    if not secret:
        raise MountError(f"--peer-secret-file {path!r} is empty: write the job's shared secret into it")
    return secret


class OwnedFirst:
    """The cache's admission hook with peers: a block this node owns is the policy's to admit; another
    node's only into room that the owned blocks not loaded yet will not need."""

    def __init__(self, owned: list[int], sizes: list[int]) -> None:
        self._owned = frozenset(owned)
        self._pending = {b: sizes[b] for b in owned}
        self._pending_bytes = sum(self._pending.values())

    def __call__(self, cache: BlockCache, block: int, size: int) -> bool:
        if block in self._owned:
            return True
        for b in [b for b in self._pending if cache.holds(b)]:
            self._pending_bytes -= self._pending.pop(b)
        return cache.budget_bytes - cache.used_bytes - self._pending_bytes >= size


def window_bytes(budget: int, owned: list[int], sizes: list[int], policy: str) -> int:
    """The room the cache's window of other nodes' blocks gets out of ``budget``: :data:`WINDOW_BLOCKS` of the
    largest block, at most what the owned blocks leave; 0 (no window) when that is not one block, or when the
    policy caches nothing."""
    largest = max(sizes, default=0)
    room = min(WINDOW_BLOCKS * largest, budget - sum(sizes[b] for b in owned))
    return room if policy != "none" and largest and room >= largest else 0


def owned_blocks(ds: PackedDataset, peers: PeerOptions, options: MountOptions) -> tuple[PeerTier, list[int]]:
    """The dataset's peer tier with every block's owner set, and the blocks this node owns."""
    chain = ds.store.files
    tier = chain.tier("peers") if isinstance(chain, TierChain) else None
    if not isinstance(tier, PeerTier):
        raise MountError("--peers: this dataset's blocks are not read through a peer tier")
    if not ds.has_digests:
        raise MountError(
            f"--peers needs a dataset with digests, so a peer's bytes are checked: run 'blockfs upgrade {ds.location}'"
        )
    if options.nodes > 1:
        if options.nodes != len(peers.addresses) or options.node_rank != peers.rank:
            raise MountError(
                f"--nodes {options.nodes} --node-rank {options.node_rank} and --peers ({len(peers.addresses)} "
                f"nodes, this one {peers.rank}) must name the same nodes in the same order"
            )
        owner = [0] * ds.n_blocks
        for node in range(options.nodes):
            for b in node_part(ds, options.nodes, node, options.partition_seed):
                owner[b] = node
        tier.set_owners(owner)
    return tier, [b for b in range(ds.n_blocks) if tier.owner(b) == peers.rank]


def start_endpoint(ds: PackedDataset, cache: BlockCache, tier: PeerTier, peers: PeerOptions) -> PeerEndpoint:
    """This node's endpoint listening (the caller closes it)."""
    address = peers.listen or peers.addresses[peers.rank]
    try:
        return PeerEndpoint(
            address, ds.digest, peers.secret, ds.store, cache, lambda b: tier.owner(b) == peers.rank, tier.served
        )  # counted where the tier's stats (stats.json's storage.peers) show it
    except OSError as e:
        raise MountError(f"--peer-listen {address}: cannot listen there: {e.strerror or e}") from None
