"""What a pack is asked to do (:class:`PackOptions`) and what it reports (:class:`PackResult`).

Apart from the packer's steps so that every step module (the plan, the destination's metadata) can take
the options without importing the pipeline that calls it, and so the CLI can read the choices from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..sizes import to_bytes

# Blocks of several files use 32-bit offsets (the seed layout); a larger file still gets a block of its own.
MAX_BLOCK_SIZE = 1 << 32  # core.format.NARROW_LIMIT, written out: the command line reads ORDERS without NumPy
ORDERS = ("shuffled", "directory")

# (files done, bytes done, files in all, bytes in all); called from the calling thread, first with zeros
ProgressCallback = Callable[[int, int, int, int], None]


@dataclass(frozen=True)
class PackOptions:
    """How to pack.  Every field has the CLI flag of the same name."""

    block_size: int | str = 64 << 20  # bytes, or a size as the CLI takes it ("64MiB"); stored as bytes
    files_per_block: int | None = None
    labels: str = "dirname"  # "dirname", "none", "source", or the path of a CSV of path,label
    order: str = "shuffled"  # or "directory"
    seed: int = 0
    workers: int | None = None  # None: one per core
    force: bool = False
    follow_symlinks: bool = False
    skip_unreadable: bool = False
    skip_damaged: bool = False  # containers: pack around damaged records/members, listing them
    fsync: bool = True
    staging: str | None = None  # a URL DEST: where blocks wait for their upload (default: the temp directory)

    def __post_init__(self) -> None:
        size = to_bytes(self.block_size, "block_size")
        object.__setattr__(self, "block_size", size)
        if not 1 <= size < MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be between 1 byte and 4 GiB, got {size}")
        if self.files_per_block is not None and self.files_per_block < 1:
            raise ValueError(f"files_per_block must be positive, got {self.files_per_block}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be 'shuffled' or 'directory', got {self.order!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be positive, got {self.workers}")

    @property
    def block_bytes(self) -> int:
        """``block_size`` as the int of bytes it is once constructed."""
        return to_bytes(self.block_size, "block_size")


@dataclass(frozen=True)
class PackResult:
    dest: str
    n_files: int
    n_dirs: int
    n_symlinks: int
    n_blocks: int
    file_bytes: int
    skipped_special: list[str]
    skipped_unreadable: list[str]
    seconds: float
    skipped_damaged: list[str] = dataclasses.field(default_factory=list)
    digest: str = ""  # the dataset's name, blake3:<hex> of its blockfs.json (what --expect pins)
