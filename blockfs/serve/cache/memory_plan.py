"""The memory plan: how a byte budget is split between retained files and the cache-once block cache.

:func:`make_memory_plan` is a pure function of the file sizes and the budget, vectorised and linear (a
count and a byte sum per size class, then a sort of the one class the budget ends in), so it plans ten
million files in a fraction of a second and the CLI (``blockfs plan``), the mount and the tests all get
the same answer.  Reading the budget from the machine
(:func:`read_mem_available`) lives here too; sizes are read and written by :mod:`blockfs.sizes`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Literal

from ...sizes import format_size, parse_size
from .budget import STRATEGIES, budget_from_memory_fraction, read_mem_available

if TYPE_CHECKING:  # imported where a plan is made: 'blockfs mount' only describes its server's plan, and
    import numpy as np  # numpy's import would delay its return by ~0.1 s after the server serves

__all__ = [
    "DEFAULT_RETAIN_SHARE",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "MemoryPlan",
    "budget_from_memory_fraction",
    "format_size",
    "make_memory_plan",
    "parse_size",
    "read_mem_available",
]

DEFAULT_STRATEGY = "most-files"

# Retention takes the whole budget first; whatever it cannot use is the cache-once block cache.
# Why not split it, say half and half?  Under a random file order, from the second epoch on:
# * a retained file always hits, with no waste: it costs exactly its own bytes;
# * a non-retained file hits only when its block was cached, and a cached block also holds retained files,
#   whose bytes then sit in memory twice.  A file whose block is not cached is read alone from storage.
# With budget B, dataset D and R retained bytes, the block cache holds a random (B - R) / D of the blocks,
# so the byte hit rate is (R + (B - R)(D - R) / D) / D = (B/D)(1 - r(B/D)(1 - r)) with r = R / B: it
# equals B/D at r = 0 and r = 1 and is lower anywhere between (at D = 2B and r = 1/2, 44 % instead of
# 50 %, which would read 56 % of the dataset from storage each epoch).  The file hit rate is what retaining
# the smallest files raises most: for lognormal sizes (sigma 1) at D = 2B it is 84 % at r = 1, 72 % at
# r = 1/2 and 50 % at r = 0 (tests/test_memory_plan.py simulates this).  So r = 1 is best on both counts; the
# leftover that no further file fits in (smaller than the next file) goes to blocks and is not wasted.
DEFAULT_RETAIN_SHARE = 1.0

# What the kernel holds for each entry a listing returns (READDIRPLUS links an inode and a dentry per
# entry): a ``fuse_inode`` (896 bytes in /proc/slabinfo on Linux 6.x), a ``dentry`` (192; a name longer
# than 40 bytes adds its own allocation) and the inode's forget link.  Measured as the growth of Slab
# in /proc/meminfo across a listing: 1.18 GB for 1,000,000 entries (issue 30), docs/benchmarks.md.
KERNEL_BYTES_PER_ENTRY = 1_180


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What :func:`make_memory_plan` chose.  Hit rates are expected per epoch from the second on.

        ``retained`` is a read-only boolean mask over the files (True: keep the file after its first read), None
    in a plan read back from its report (:meth:`from_dict`);
        ``threshold`` is the size threshold applied by the ``threshold`` strategy (None otherwise), which is
        lower than ``requested_threshold`` when the files under the requested one did not fit.
    """

    budget_bytes: int
    dataset_bytes: int
    n_files: int
    fits: bool
    strategy: str
    retain_share: float
    threshold: int | None
    requested_threshold: int | None
    retained_files: int
    retained_bytes: int
    block_cache_bytes: int
    expected_file_hit_rate: float
    expected_byte_hit_rate: float
    retained: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)
    block_bytes: int = 0  # one block's size (the dataset's median): a smaller block cache holds none
    n_entries: int = 0  # entries a full listing returns (files, directories and links; not the root)

    @property
    def per_file_requests(self) -> bool:
        """Whether the block cache is smaller than one block: it holds none, so every file that is not
        retained is read from storage alone, one request each, every epoch."""
        return not self.fits and self.block_cache_bytes < self.block_bytes

    @property
    def retained_ids(self) -> np.ndarray:
        """Ids (positions in the sizes given) of the retained files, ascending."""
        import numpy as np

        if self.retained is None:
            raise ValueError("a plan read back from its report (from_dict) has no per-file mask")
        return np.flatnonzero(self.retained)

    @property
    def expected_storage_bytes_per_epoch(self) -> int:
        """Bytes read from storage per epoch once caches are warm: the bytes that miss (read file by file)."""
        return round(self.dataset_bytes * (1.0 - self.expected_byte_hit_rate))

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready values (without the per-file mask)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "retained"}
        return fields | {
            "expected_storage_bytes_per_epoch": self.expected_storage_bytes_per_epoch,
            "page_cache_bytes": self.page_cache_bytes,
            "kernel_listing_bytes": self.kernel_listing_bytes,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MemoryPlan:
        """The plan :meth:`to_dict` gave (a server's report), without the per-file mask: enough to describe it."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "retained" and f.name in values]
        return cls(**{name: values[name] for name in names})

    @property
    def page_cache_bytes(self) -> int:
        """What the kernel route adds in the kernel's page cache, at most: a copy of every file of every
        cached block (pushed as the block loads) and of every retained file (kept after its first read).
        Evictable page cache, charged to the mount's readers' cgroup like any page cache, not to the budget."""
        if self.fits:
            return self.dataset_bytes
        return min(self.dataset_bytes, self.block_cache_bytes + self.retained_bytes)

    @property
    def kernel_listing_bytes(self) -> int:
        """What the kernel holds once every entry has been listed (``os.walk``, an ImageFolder's constructor):
        an inode and a dentry per entry, in its slab.  Reclaimable: under memory pressure the kernel drops
        them and tells the server (FORGET), charged to the listing process's cgroup, not to the budget."""
        return self.n_entries * KERNEL_BYTES_PER_ENTRY

    def describe(self) -> str:
        """The plan in a few lines of text for people."""
        size = format_size
        lines = [f"memory budget:    {size(self.budget_bytes)}"]
        dataset = f"dataset:          {size(self.dataset_bytes)} in {self.n_files:,} files"
        if self.fits:
            lines.append(f"{dataset}; fits: every block stays in memory after its first read")
        else:
            budget_share = _pct(self.budget_bytes, self.dataset_bytes)
            lines.append(f"{dataset}; does not fit (the budget is {budget_share} of it)")
            how = "smallest files first" if self.threshold is None else f"files up to {size(self.threshold)}"
            if self.threshold is not None and self.requested_threshold not in (None, self.threshold):
                how += f", lowered from {size(self.requested_threshold)} to fit"
            if self.retain_share < 1:
                how += f", within {self.retain_share:.0%} of the budget"
            blocks = (
                f"less than one block ({size(self.block_bytes)}): holds none, so every file not retained "
                "is read alone, one request per file"
                if self.per_file_requests
                else f"cache-once (about {_pct(self.block_cache_bytes, self.dataset_bytes)} of the blocks)"
            )
            lines += [
                f"retained files:   {self.retained_files:,} files ({_pct(self.retained_files, self.n_files)} "
                f"of them), {size(self.retained_bytes)} ({_pct(self.retained_bytes, self.dataset_bytes)} "
                f"of the bytes); {self.strategy}: {how}",
                f"block cache:      {size(self.block_cache_bytes)}, {blocks}",
            ]
        lines += [
            f"page cache:       up to {size(self.page_cache_bytes)} more, kernel route: files pushed as their blocks "
            "load, kept by the kernel while memory allows (evictable; not part of the budget)",
            f"kernel:           about {size(self.kernel_listing_bytes)} more once listed: an inode and a dentry for "
            f"each of {self.n_entries:,} entries (slab, reclaimable; not part of the budget)",
            f"expected hits per epoch (from the 2nd): {self.expected_file_hit_rate:.1%} of files, "
            f"{self.expected_byte_hit_rate:.1%} of bytes",
            f"storage read per epoch (from the 2nd): about {size(self.expected_storage_bytes_per_epoch)}",
        ]
        return "\n".join(lines)


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "100.0%"


def make_memory_plan(
    sizes: np.ndarray,
    budget_bytes: int,
    *,
    strategy: str = DEFAULT_STRATEGY,
    threshold: int | Literal["auto"] | None = None,
    retain_share: float = DEFAULT_RETAIN_SHARE,
    block_bytes: int = 0,
) -> MemoryPlan:
    """Plan memory for files of ``sizes`` bytes (file id = position) under ``budget_bytes``.

    If the dataset fits, every block is cached and nothing is retained.  Otherwise the files to retain are
    chosen within ``retain_share`` of the budget, ties in size broken by id:

    ``most-files``
        the k smallest files, k as large as fits: no other choice keeps more files, and no further file
        fits in the leftover.  (Spending the leftover better at the same count is a subset-sum problem;
        the leftover is not lost, it goes to the block cache.)
    ``threshold``
        every file of at most ``threshold`` bytes.  With ``"auto"`` or None, the largest threshold whose
        files fit; a given threshold whose files do not fit is lowered to that one.

    The rest of the budget is the cache-once block cache; one smaller than ``block_bytes`` (one block's
    size, 0 if unknown) holds no block, and the files not retained then never hit.  The expected hit rates assume a random file
    order every epoch and files assigned to blocks at random: a retained file always hits; any other file
    hits when its block is cached, with probability ``block_cache_bytes / dataset_bytes``, and never if it
    is larger than the block cache (its block cannot fit).  See :data:`DEFAULT_RETAIN_SHARE` for why
    retention takes the whole budget by default.
    """
    import numpy as np

    sizes = _checked_sizes(sizes)
    budget_bytes = operator.index(budget_bytes)
    requested = _checked_options(budget_bytes, strategy, threshold, retain_share)
    dataset_bytes = int(sizes.sum())
    fits = dataset_bytes <= budget_bytes
    if fits:
        retained, applied, retained_bytes = np.zeros(sizes.size, dtype=bool), None, 0
    else:
        share = int(budget_bytes * retain_share)
        retained, applied, retained_bytes = _select(sizes, share, strategy, requested)
    retained.flags.writeable = False
    retained_files = int(np.count_nonzero(retained))
    block_cache_bytes = budget_bytes - retained_bytes
    file_hit_rate, byte_hit_rate = 1.0, 1.0
    if not fits:
        cacheable = block_cache_bytes if block_cache_bytes >= block_bytes else 0
        file_hit_rate, byte_hit_rate = _expected_hit_rates(sizes, retained, retained_bytes, cacheable)
    return MemoryPlan(
        budget_bytes=budget_bytes,
        dataset_bytes=dataset_bytes,
        n_files=int(sizes.size),
        fits=fits,
        strategy=strategy,
        retain_share=float(retain_share),
        threshold=applied,
        requested_threshold=requested,
        retained_files=retained_files,
        retained_bytes=retained_bytes,
        block_cache_bytes=block_cache_bytes,
        expected_file_hit_rate=file_hit_rate,
        expected_byte_hit_rate=byte_hit_rate,
        retained=retained,
        block_bytes=int(block_bytes),
    )


def _checked_sizes(sizes: np.ndarray) -> np.ndarray:
    import numpy as np

    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or (sizes.size and sizes.dtype.kind not in "iu"):
        raise ValueError(f"sizes must be a 1-D array of integers, not {sizes.dtype} of shape {sizes.shape}")
    sizes = sizes.astype(np.int64, copy=False)
    if sizes.size and sizes.min() < 0:
        raise ValueError(f"file {int(np.argmin(sizes))} has a negative size, {int(sizes.min())}")
    return sizes


def _checked_options(
    budget_bytes: int, strategy: str, threshold: int | Literal["auto"] | None, retain_share: float
) -> int | None:
    """Check the plan's options; returns the threshold the user asked for (None for none or ``auto``)."""
    if budget_bytes < 0:
        raise ValueError(f"memory budget must be >= 0 bytes, not {budget_bytes}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown retain strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    if not 0 <= retain_share <= 1:
        raise ValueError(f"retain share must be in [0, 1], not {retain_share!r}")
    requested = None if threshold is None or threshold == "auto" else operator.index(threshold)
    if requested is not None and (strategy != "threshold" or requested < 0):
        raise ValueError(
            f"a retain threshold ({requested}) needs strategy 'threshold' (not {strategy!r}) and must be >= 0"
        )
    return requested


def _expected_hit_rates(
    sizes: np.ndarray, retained: np.ndarray, retained_bytes: int, block_cache_bytes: int
) -> tuple[float, float]:
    """(file, byte) hit rates per epoch for a dataset that does not fit: a retained file always hits; any
    other file hits when its block is cached, never when it is larger than the block cache."""
    import numpy as np

    dataset_bytes = int(sizes.sum())
    cached_fraction = block_cache_bytes / dataset_bytes
    cacheable = ~retained & (sizes <= block_cache_bytes)
    file_hits = int(np.count_nonzero(retained)) + cached_fraction * int(np.count_nonzero(cacheable))
    byte_hits = retained_bytes + cached_fraction * int(sizes[cacheable].sum())
    return file_hits / sizes.size, byte_hits / dataset_bytes


# Sizes below 2**_EXACT_BITS bytes have a size class each; larger ones share a class with the sizes within
# 1/2**(_EXACT_BITS - 1) of theirs (2**15 classes an octave).  Selecting the k smallest files then needs
# a count and a sum per class (two bincounts) and a sort of the one class the budget ends in, not a sort of
# every file: at ten million files the argsort alone was 2.2 s of a mount.
_EXACT_BITS = 16
# Per-class byte sums are float64 (bincount's weights): exact while every sum is below 2**53 bytes.
_EXACT_SUMS = 2**53


def _size_classes(sizes: np.ndarray) -> np.ndarray:
    """A class for each size, never decreasing as the size grows (see :data:`_EXACT_BITS`)."""
    import numpy as np

    if not sizes.size or int(sizes.max()) < 2**_EXACT_BITS:
        return sizes  # every size its own class
    _, bits = np.frexp(sizes)  # the bit length: exact, sizes are below 2**53
    shift = np.maximum(bits.astype(np.int64) - _EXACT_BITS, 0)
    return (shift << (_EXACT_BITS - 1)) + (sizes >> shift)


def _select(sizes: np.ndarray, share: int, strategy: str, requested: int | None) -> tuple[np.ndarray, int | None, int]:
    """(retained mask, threshold applied, retained bytes) for a dataset larger than ``share``: the same
    choice as :func:`_select_sorted` in linear time (a count and a byte sum per size class, then the
    one class the budget ends in, sorted alone)."""
    import numpy as np

    total = int(sizes.sum())
    if total >= _EXACT_SUMS:
        return _select_sorted(sizes, share, strategy, requested)
    classes = _size_classes(sizes)
    class_bytes = np.cumsum(np.bincount(classes, weights=sizes)).astype(np.int64)
    cut = int(np.searchsorted(class_bytes, share, side="right"))  # the first class that does not fit whole
    below = int(class_bytes[cut - 1]) if cut else 0
    # The cut class's files by size, ties by id (flatnonzero is in id order; a stable sort keeps it).
    ids = np.flatnonzero(classes == cut)
    group = sizes[ids]
    if group.size and group.min() != group.max():
        order = np.argsort(group, kind="stable")
        ids, group = ids[order], group[order]
    cumulative = below + np.cumsum(group)
    taken = int(np.searchsorted(cumulative, share, side="right"))  # < group.size: the class overflows
    if strategy == "threshold":
        # A requested threshold whose files fit is applied; otherwise files of one size go in together or not
        # at all: stop before the size of the first file that does not fit.
        count = int(np.count_nonzero(classes < cut)) + taken
        if requested is not None and int(np.count_nonzero(sizes <= requested)) <= count:
            retained, applied = sizes <= requested, requested
        else:
            retained = sizes < group[taken]
            applied = int(sizes[retained].max()) if retained.any() else 0
        return retained, applied, int(sizes[retained].sum())
    retained = classes < cut
    retained[ids[:taken]] = True
    return retained, None, int(cumulative[taken - 1]) if taken else below


def _select_sorted(
    sizes: np.ndarray, share: int, strategy: str, requested: int | None
) -> tuple[np.ndarray, int | None, int]:
    """:func:`_select` by one sort of every file: for byte sums too large for its classes' float sums."""
    import numpy as np

    order = np.argsort(sizes, kind="stable")  # by size, then by id
    ordered = sizes[order]
    cumulative = np.cumsum(ordered)
    # The k smallest files fit exactly when their sum does; k < n since the dataset exceeds the share.
    count = int(np.searchsorted(cumulative, share, side="right"))
    applied = None
    if strategy == "threshold":
        under = int(np.searchsorted(ordered, requested, side="right")) if requested is not None else None
        if under is not None and under <= count:
            count, applied = under, requested
        else:
            # Files of one size go in together or not at all: stop before the size that does not fit.
            count = int(np.searchsorted(ordered, ordered[count], side="left"))
            applied = int(ordered[count - 1]) if count else 0
    retained = np.zeros(sizes.size, dtype=bool)
    retained[order[:count]] = True
    return retained, applied, int(cumulative[count - 1]) if count else 0


def disk_tier_plan(
    plan: MemoryPlan, block_bytes: int, budget: int, held: int, directory: str, one_block: int = 0
) -> dict[str, Any]:
    """What a remote dataset's disk tier adds below the memory plan: the share of the blocks it will hold
    (cache-once, from the first epoch on) and the remote bytes to expect per epoch from the second.
    ``block_bytes``: all the blocks' bytes; ``one_block``: one block's (a smaller tier holds none)."""
    share = min(1.0, budget / block_bytes) if block_bytes else 1.0
    if budget < one_block:
        share = 0.0
    return {
        "directory": directory,
        "budget_bytes": budget,
        "held_bytes": held,
        "block_bytes": block_bytes,
        "share_of_blocks": share,
        "one_block_bytes": one_block,
        "expected_remote_bytes_per_epoch": int(plan.expected_storage_bytes_per_epoch * (1 - share)),
    }


def describe_disk_tier(tier: dict[str, Any] | None) -> str:
    """The disk tier in the plan's words, or the line saying a remote dataset has none."""
    if tier is None:
        return "disk tier:        none (--disk-cache DIR keeps fetched blocks on a local disk, across mounts)"
    size = format_size
    share = tier["share_of_blocks"]
    holds = "all of the blocks" if share >= 1 else f"about {share:.0%} of the blocks"
    if tier["budget_bytes"] < tier.get("one_block_bytes", 0):
        holds = f"none of the blocks: smaller than one block ({size(tier['one_block_bytes'])})"
    return (
        f"disk tier:        {tier['directory']}: {size(tier['budget_bytes'])}, cache-once, {holds} "
        f"(holds {size(tier['held_bytes'])} now)\n"
        f"remote read per epoch (from the 2nd): about {size(tier['expected_remote_bytes_per_epoch'])}"
    )
