"""``SequentialReads``: notices when reads move through blocks in order, so the next blocks can be loaded ahead.

A step to the next block is often chance under a shuffled order; two steps forward in a row are not.
Only the block a read touches is looked at, so this costs a comparison per read and a lock only when the
block changes.
"""

from __future__ import annotations

import threading

SEQUENTIAL_STEPS = 2  # consecutive next-block steps that count as "in order"


class SequentialReads:
    """Feed it the block of every read; it says when to read ahead of that block."""

    def __init__(self, steps: int = SEQUENTIAL_STEPS) -> None:
        self._steps = steps
        self._last = -2
        self._run = 0
        self._lock = threading.Lock()

    def step(self, block: int) -> bool:
        """Note a read of ``block``; whether reads now move through blocks in order (read ahead of it)."""
        if block == self._last:  # most reads: the same block as the one before, no lock needed
            return False
        with self._lock:
            if block == self._last:
                return False
            self._run = self._run + 1 if block == self._last + 1 else 0
            self._last = block
            return self._run >= self._steps
