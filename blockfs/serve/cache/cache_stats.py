"""``CacheCounters``: what the block cache did, counted for ``stats.json`` — and nothing else.

Counters only count: deciding anything from them (read-ahead, admission) lives with the code that decides.
Reads are cut into epochs by the dataset's file count, so each epoch's file hit rate can be shown (the
cache-once promise is that it equals budget / dataset from the second epoch on).
"""

from __future__ import annotations

import threading
import time
from typing import Any

EPOCHS_KEPT = 64  # per-epoch hit rates kept in the statistics

COUNTERS = (
    "reads",
    "bytes_served",
    "files_served",
    "file_hits",
    "file_misses",
    "block_hits",
    "block_misses",
    "block_loads",
    "readahead_loads",
    "prefill_loads",
    "load_waits",
    "block_bytes_read",
    "file_reads",
    "file_bytes_read",
    "buffer_hits",
    "damaged_blocks",  # blocks found damaged or not this dataset's (each counted once)
    "load_errors",  # block loads that failed, for any reason
    "read_errors",  # reads answered with a failed read of a block file (EIO; the next read tries again)
    "announcements",
    "prefetch_loads",
    "blocks_shared",
    "replaced_loads",  # damaged blocks loaded in the background once found replaced (a new stored version)
    "disk_copies_ahead",  # announced blocks memory would not hold, fetched into a remote dataset's disk tier
    "window_loads",  # blocks another node owns read whole into the window (their bytes in block_bytes_read)
    "window_ahead_loads",  # of those, announced blocks fetched before a read asked for them
)


class CacheCounters:
    """Thread-safe counters and per-epoch hit rates.  ``n_files`` (0: unknown) cuts reads into epochs."""

    def __init__(self, n_files: int = 0) -> None:
        self._c = dict.fromkeys(COUNTERS, 0)
        self._epochs: list[list[int]] = [[0, 0]]  # [files served, file hits] per epoch
        self._n_files = n_files
        self._lock = threading.Lock()
        self.started = time.time()

    @property
    def uptime_s(self) -> float:
        return time.time() - self.started

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def add_many(self, **counts: int) -> None:
        """Several counters at once, under one lock (for the per-read paths)."""
        with self._lock:
            for name, n in counts.items():
                self._c[name] += n

    def read(self, offset: int, nbytes: int, hit: bool) -> None:
        """One read request served (``hit``: from memory); ``offset == 0`` counts a file served.  Called for
        every read a mount answers: one lock, no call inside it."""
        with self._lock:
            c = self._c
            c["reads"] += 1
            c["bytes_served"] += nbytes
            c["block_hits" if hit else "block_misses"] += 1
            if offset == 0:  # a file's first read: count it once as a file served, in its epoch
                c["files_served"] += 1
                c["file_hits" if hit else "file_misses"] += 1
                epoch = self._epochs[-1]
                if self._n_files and epoch[0] >= self._n_files:
                    epoch = [0, 0]
                    self._epochs.append(epoch)
                    del self._epochs[:-EPOCHS_KEPT]
                epoch[0] += 1
                epoch[1] += hit

    def snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(counters with the derived rates, per-epoch figures), as plain JSON-ready values."""
        with self._lock:
            c: dict[str, Any] = dict(self._c)
            epochs = [
                {"files": files, "hits": hits, "hit_rate": hits / files if files else 0.0}
                for files, hits in self._epochs
            ]
        c["bytes_from_storage"] = c["block_bytes_read"] + c["file_bytes_read"]
        c["file_hit_rate"] = c["file_hits"] / c["files_served"] if c["files_served"] else 0.0
        c["block_hit_rate"] = c["block_hits"] / c["reads"] if c["reads"] else 0.0
        return c, epochs
