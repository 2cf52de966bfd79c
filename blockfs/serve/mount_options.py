"""``MountOptions``: how to serve a packed dataset, and the one place to add a mount option.

Each field declares how it is given on the command line (:class:`Flag`: ``blockfs mount --flag``, and
``mount.fuse.blockfs -o flag=value`` with the flag's dashes as underscores; or :class:`FromFlags` /
:class:`NoFlag`).  :mod:`blockfs.cli.mount_flags` builds the parser's arguments and ``MountOptions`` from
these declarations, so a new option is one field here plus the code that uses it.

Binding-free, so the command line, the assembly (:mod:`blockfs.serve.server`) and both FUSE adapters import
it without importing a FUSE binding (or each other); it never imports the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .. import protocol
from ..sizes import parse_size
from .cache.background_loads import READAHEAD_BLOCKS
from .cache.budget import STRATEGIES
from .cache.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:  # not imported to run: the command line reads these declarations without NumPy
    from ..core.location import StorageOptions

OPEN_MODES = ("auto", "enosys", "keep_cache", "targets", "none")
# How the kernel route answers listings (blockfs.serve.fuse.kernel_adapter.LISTING_FLAGS): names only (plain:
# READDIR), with attributes (plus: READDIRPLUS, the listed files pushed), or as the kernel decides (auto).
LISTING_MODES = ("plain", "plus", "auto")
# "auto": the kernel protocol where this machine allows it (Linux, /dev/fuse, FUSE 7.31+), else mfusepy
FUSE_ROUTES = ("auto", "kernel", "mfusepy", "fusepy")

# Where ``--help`` lists a flag; blockfs.cli lays the sections out ("memory" and "nodes" are ``blockfs plan``'s
# too, "dataset" every command's that opens a dataset).
SECTIONS = ("memory", "nodes", "cache", "fuse", "tuning", "dataset")
CLI = "blockfs.cli"  # the key of a field's declaration in its metadata


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field given by one flag.  A boolean field's flag sets the opposite of its default (``--no-prefill``
    makes ``prefill`` False); any other flag takes a value."""

    flag: str  # "--policy"; mount.fuse.blockfs's key is "policy"
    help: str
    section: str  # one of SECTIONS
    type: Callable[[str], Any] | None = None  # argparse's: a bad value is refused as the line is parsed
    # Applied to the text as MountOptions is built (a size): a bad one is the command's one-line error.
    convert: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None  # default: the flag's name in capitals
    repeat: bool = False  # given any number of times; the field is the tuple of the values
    fstab: bool = True  # whether mount.fuse.blockfs takes it as ``-o key[=value]``

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"flag {self.flag}: section {self.section!r} is not one of {', '.join(SECTIONS)}")


@dataclasses.dataclass(frozen=True)
class FromFlags:
    """A field the command line works out from options of its own (``flags``), not one flag's value."""

    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class NoFlag:
    """A field no command line sets: the default serves every mount; code (tests, tools) may set it."""

    why: str


def size_or_auto(text: str) -> int | Literal["auto"]:
    """``--retain-threshold``'s value: bytes, or ``"auto"``."""
    return "auto" if text == "auto" else parse_size(text)


def _declared(cli: Flag | FromFlags | NoFlag, default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={CLI: cli})


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """How to serve a packed dataset.  ``fuse_options`` are extra ``-o`` options, ``"name"`` or ``"name=value"``.

    Fields are listed in the order ``blockfs mount --help`` shows them within each section."""

    # The memory plan: ``cache_bytes`` is the whole budget, split between retained files and blocks.
    cache_bytes: int = _declared(FromFlags(("--cache-size", "--memory-fraction")))
    retain_strategy: str | None = _declared(
        Flag(  # None: plan.DEFAULT_STRATEGY
            "--retain-strategy",
            section="memory",
            choices=STRATEGIES,
            help="which files stay in memory after their first read when the dataset does not fit: "
            "most-files (the default: as many as fit, smallest first) or threshold",
        ),
        None,
    )
    retain_threshold: int | Literal["auto"] | None = _declared(
        Flag(  # bytes, "auto" or None (threshold strategy only)
            "--retain-threshold",
            section="memory",
            metavar="SIZE|auto",
            convert=size_or_auto,
            help="with --retain-strategy threshold: files up to SIZE (auto: the largest that fits)",
        ),
        None,
    )
    retain: bool = _declared(
        Flag(
            "--no-retain",
            section="memory",
            help="no retained files: the whole budget caches blocks",
        ),
        True,
    )
    # partition="node": this mount serves node ``node_rank`` of ``nodes``, whose loaders read only the part
    # core.partition gives it for ``partition_seed`` (the loaders' seed): prefill and read-ahead keep to it.
    nodes: int = _declared(
        Flag(
            "--nodes",
            section="nodes",
            type=int,
            help="the nodes the dataset is split among (default 1)",
        ),
        1,
    )
    node_rank: int = _declared(
        Flag(
            "--node-rank",
            section="nodes",
            type=int,
            help="this node's number, 0 to NODES-1 (torchrun's GROUP_RANK); the mount loads ahead only this node's part",
        ),
        0,
    )
    partition_seed: int = _declared(
        Flag(
            "--partition-seed",
            section="nodes",
            type=int,
            help="the loaders' seed (the split depends on it)",
        ),
        0,
    )
    # Peers (serve/peers.py): every node's endpoint, and which one is this node's; the secret only from a file
    # or the environment (never a command line).
    peers: str | None = _declared(
        Flag(
            "--peers",
            section="nodes",
            metavar="HOST:PORT,...",
            help="every node's peer endpoint, the same list in the same order on every node (default: "
            "$BLOCKFS_PEERS): a block this node lacks comes from the node that owns it before the store",
        ),
        None,
    )
    peer_rank: int = _declared(
        Flag(
            "--peer-rank",
            section="nodes",
            type=int,
            metavar="N",
            help="this node's index in --peers (default: $NODE_RANK or $GROUP_RANK, as torchrun sets them)",
        ),
        -1,
    )
    peer_listen: str | None = _declared(
        Flag(
            "--peer-listen",
            section="nodes",
            metavar="HOST:PORT",
            help="where this node serves its blocks to the others (default: its own entry in --peers)",
        ),
        None,
    )
    peer_secret_file: str | None = _declared(
        Flag(
            "--peer-secret-file",
            section="nodes",
            metavar="PATH",
            help="the job's shared secret: a file of yours no one else may read (default: $BLOCKFS_PEER_SECRET)",
        ),
        None,
    )
    peer_timeout: float = _declared(
        Flag(
            "--peer-timeout",
            section="tuning",
            type=float,
            metavar="SECONDS",
            help="a peer silent this long is given up on (the store is read) and avoided for a while",
        ),
        2.0,
    )
    peer_backoff: float = _declared(
        Flag(
            "--peer-backoff",
            section="tuning",
            type=float,
            metavar="SECONDS",
            help="how long a failed peer is avoided (doubled on each failure in a row, up to 60 s)",
        ),
        5.0,
    )
    preload: bool = _declared(
        Flag(
            "--preload",
            section="cache",
            help="read what the plan keeps before serving",
        ),
        False,
    )
    policy: str = _declared(
        Flag(
            "--policy",
            section="cache",
            choices=tuple(POLICIES),
            help="cache-once (default: fill once, never replace), lru, fifo (for comparison) or none",
        ),
        DEFAULT_POLICY,
    )
    allow_other: bool = _declared(
        Flag(
            "--allow-other",
            section="fuse",
            help="let other users see the mount (FUSE allow_other)",
        ),
        False,
    )
    fuse_options: tuple[str, ...] = _declared(
        Flag(  # mount.fuse.blockfs passes the -o items it does not know
            "-o",
            section="fuse",
            metavar="FUSE_OPTIONS",
            repeat=True,
            fstab=False,
            help="extra FUSE mount options, comma-separated. The kernel route takes allow_other, default_permissions, "
            "max_read=N, blksize=N, fsname=NAME, subtype=NAME, noexec, noatime; it ignores libfuse's "
            "own settings (kernel_cache, use_ino, max_threads...) with a log line and refuses the rest. "
            "--fuse mfusepy/fusepy take libfuse's options",
        ),
        (),
    )
    storage: StorageOptions | None = _declared(  # a remote dataset's options and its disk tier
        FromFlags(("--storage-option", "--disk-cache", "--disk-cache-size")), None
    )
    # The FUSE route (FUSE_ROUTES): blockfs.serve.fuse.kernel_adapter, or blockfs.serve.fuse.libfuse_adapter's binding.
    fuse: str = _declared(
        Flag(
            "--fuse",
            section="tuning",
            choices=FUSE_ROUTES,
            help="how requests are served: kernel (the FUSE protocol spoken directly: node ids, "
            "loaded files pushed into the page cache), mfusepy or fusepy (libfuse through "
            "a binding); auto: kernel where it can run, else mfusepy",
        ),
        "auto",
    )
    # enosys with libfuse 3, keep_cache with libfuse 2; "targets": keep pages of the plan's retained files
    # only (measured by tools/bench/bench_memory.py --kernel); "none": no page-cache reuse.
    open_mode: str = _declared(
        Flag(
            "--open-mode",
            section="tuning",
            choices=OPEN_MODES,
            help="how the kernel page cache is kept across opens (auto: enosys with libfuse 3; targets: only the "
            "files the memory plan retains)",
        ),
        "auto",
    )
    # Chosen by the whole pass (listing, reads of a sample, the kernel-served pass): docs/benchmarks.md.
    listing: str = _declared(
        Flag(
            "--listing",
            section="tuning",
            choices=LISTING_MODES,
            help="kernel route: how directories are listed. plain (the default): names only, the fastest listing, "
            "each file looked up when first opened; plus: with attributes, every listed file pushed into the "
            "page cache when its block is in memory (pays when most listed files are read, or stat'ed: "
            "ls -l, du); auto: the kernel's choice (attributes for a directory's first request)",
        ),
        "plain",
    )
    threads: bool = _declared(
        Flag(  # libfuse's thread pool: a cached file never waits behind another's disk read
            "--single-threaded",
            section="tuning",
            help="libfuse routes: one FUSE request at a time (the kernel route always reads its requests with one "
            "thread, and waits on storage on others)",
        ),
        True,
    )
    readahead: int = _declared(
        Flag(
            "--readahead",
            section="tuning",
            type=int,
            help="blocks loaded ahead of reads in block order",
        ),
        READAHEAD_BLOCKS,
    )
    prefill: bool = _declared(
        Flag(  # load the blocks the budget will hold in the background, from mount on
            "--no-prefill",
            section="tuning",
            help="load blocks only when read (default: fill the budget in the background from mount on)",
        ),
        True,
    )
    lock_memory: bool = _declared(
        Flag(
            "--no-mlock",
            section="tuning",
            help="do not try to lock cached blocks in memory",
        ),
        True,
    )
    share: bool = _declared(
        Flag(  # hand cached blocks to loaders on this machine as sealed memory (share.py)
            "--no-share",
            section="tuning",
            help="do not hand cached blocks to loaders on this machine as shared memory (they then read every file "
            "through FUSE)",
        ),
        True,
    )
    expect: str | None = _declared(
        Flag(  # the pinned dataset name ("blake3:..."): another dataset is refused
            "--expect",
            section="dataset",
            metavar="DIGEST",
            help="refuse any dataset but this one: its name, blake3:<hex>, as 'blockfs pack' and 'blockfs info' "
            "print it; every byte read is then checked against the digests it names",
        ),
        None,
    )
    timeout_s: float = _declared(  # entry / attribute / negative lookup timeouts
        NoFlag("the data never changes, so the kernel may keep what it looked up for a day"), 86400.0
    )
    control_name: str = _declared(
        NoFlag("the control directory's name is the loaders' contract (protocol.py)"), protocol.DEFAULT_CONTROL
    )

    def __post_init__(self) -> None:
        if self.fuse not in FUSE_ROUTES:
            raise ValueError(f"FUSE route {self.fuse!r} is not one of {', '.join(FUSE_ROUTES)}")
        if self.listing not in LISTING_MODES:
            raise ValueError(f"listing {self.listing!r} is not one of {', '.join(LISTING_MODES)}")
        if self.open_mode not in OPEN_MODES:
            raise ValueError(f"open_mode {self.open_mode!r} is not one of {', '.join(OPEN_MODES)}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, not {self.cache_bytes}")
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node rank {self.node_rank} is not one of {self.nodes} nodes (0 to {self.nodes - 1})")

    def open_mode_for(self, libfuse_major: int) -> str:
        """The open mode to use with this libfuse: ``auto`` is enosys with libfuse 3, keep_cache with 2
        (libfuse 2 cannot drop pages from the kernel's cache, which enosys relies on for old snapshots)."""
        if self.open_mode != "auto":
            return self.open_mode
        return "enosys" if libfuse_major >= 3 else "keep_cache"


def declarations() -> list[tuple[dataclasses.Field, Flag | FromFlags | NoFlag]]:
    """Every field of :class:`MountOptions` with its declaration, in order; a field without one is an error."""
    out = []
    for field in dataclasses.fields(MountOptions):
        cli = field.metadata.get(CLI)
        if not isinstance(cli, (Flag, FromFlags, NoFlag)):
            raise TypeError(
                f"MountOptions.{field.name} declares no command line: give it a Flag, FromFlags or "
                "NoFlag in blockfs/serve/mount_options.py"
            )
        out.append((field, cli))
    return out
