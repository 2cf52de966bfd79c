"""``MountOptions``: how to serve a packed dataset (the command line's parser still declares each flag).

Binding-free, so the command line, the assembly (:mod:`blockfs.serve.server`) and both FUSE adapters import
it without importing a FUSE binding (or each other).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .. import protocol
from ..core.location import StorageOptions
from .background import READAHEAD_BLOCKS
from .policies import DEFAULT_POLICY

OPEN_MODES = ("auto", "enosys", "keep_cache", "targets", "none")
# "auto": the kernel protocol where this machine allows it (Linux, /dev/fuse, FUSE 7.31+), else mfusepy
FUSE_ROUTES = ("auto", "kernel", "mfusepy", "fusepy")


@dataclasses.dataclass(frozen=True)
class MountOptions:
    """How to serve a packed dataset.  ``fuse_options`` are extra ``-o`` options, ``"name"`` or ``"name=value"``."""

    cache_bytes: int
    policy: str = DEFAULT_POLICY
    allow_other: bool = False
    fuse_options: tuple[str, ...] = ()
    fuse: str = "auto"  # the FUSE route (FUSE_ROUTES): blockfs.serve.kernelfs, or blockfs.serve.fs's binding
    threads: bool = True  # libfuse's thread pool: a cached file never waits behind another file's disk read
    # enosys with libfuse 3, keep_cache with libfuse 2; "targets": keep pages of the plan's retained files
    # only (measured by tools/bench_memory.py --kernel); "none": no page-cache reuse.
    open_mode: str = "auto"
    timeout_s: float = 86400.0  # entry / attribute / negative lookup timeouts: the data never changes
    readahead: int = READAHEAD_BLOCKS
    prefill: bool = True  # load the blocks the budget will hold in the background, from mount on
    lock_memory: bool = True
    share: bool = True  # hand cached blocks to loaders on this machine as sealed memory (share.py)
    control_name: str = protocol.DEFAULT_CONTROL
    # The memory plan: ``cache_bytes`` is the whole budget, split between retained files and blocks.
    retain: bool = True
    retain_strategy: str | None = None  # plan.DEFAULT_STRATEGY
    retain_threshold: int | Literal["auto"] | None = None  # bytes, "auto" or None (threshold strategy only)
    preload: bool = False  # read what the plan keeps before serving
    storage: StorageOptions | None = None  # a remote dataset's options and its disk tier
    # partition="node": this mount serves node ``node_rank`` of ``nodes``, whose loaders read only the part
    # core.partition gives it for ``partition_seed`` (the loaders' seed): prefill and read-ahead keep to it.
    nodes: int = 1
    node_rank: int = 0
    partition_seed: int = 0
    expect: str | None = None  # the pinned dataset name ("blake3:..."): another dataset is refused

    def __post_init__(self) -> None:
        if self.fuse not in FUSE_ROUTES:
            raise ValueError(f"FUSE route {self.fuse!r} is not one of {', '.join(FUSE_ROUTES)}")
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
