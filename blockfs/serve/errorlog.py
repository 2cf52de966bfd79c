"""What a mount says about the errors it answers: one log line per damaged block for its life, at most one a
minute per block for failed reads (which are retried, so a flapping disk must not flood the log), and the
counts ``blockfs stats`` shows.  Kept apart from the FUSE adapter so its rules are testable on their own."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..errors import BlockReadError, CorruptBlockError

log = logging.getLogger(__name__)

FAILED_READ_LOG_S = 60.0  # a block whose reads keep failing (not damaged: retried) is logged this often


class ErrorLog:
    """Counts and logs the block errors a mount answers with EIO."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._damaged_blocks: set[int | None] = set()
        self._damaged_reads = 0
        self._failed_reads = 0
        self._failed_logged: dict[int | None, float] = {}  # block -> when a failed read of it was last logged

    def report(self, e: CorruptBlockError | BlockReadError) -> None:
        """Count ``e``; log it when it is the first of its damaged block, or its block's first failed read
        in :data:`FAILED_READ_LOG_S` seconds."""
        damaged = isinstance(e, CorruptBlockError)
        now = time.monotonic()
        with self._lock:
            if damaged:
                self._damaged_reads += 1
                first = e.block not in self._damaged_blocks
                self._damaged_blocks.add(e.block)
            else:
                self._failed_reads += 1
                first = now - self._failed_logged.get(e.block, -FAILED_READ_LOG_S) >= FAILED_READ_LOG_S
                if first:
                    self._failed_logged[e.block] = now
        if first:
            log.error(
                "%s: answering EIO %s",
                e,
                "for the files it damages" if damaged else "for this read; the next read tries again",
            )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "damaged_files_read": self._damaged_reads,
                "damaged_blocks_reported": sorted(b for b in self._damaged_blocks if b is not None),
                "failed_reads": self._failed_reads,
            }
