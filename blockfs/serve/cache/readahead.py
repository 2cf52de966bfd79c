"""``SequentialReads``: notices when reads move through blocks in order, so the next blocks can be loaded ahead.

A step to the next block is often chance under a shuffled order; two steps forward in a row are not.
It runs on every read, so it takes no lock: concurrent readers may race on its two fields, which at worst
starts or skips one read-ahead (a guess either way), never a wrong read.
"""

from __future__ import annotations

SEQUENTIAL_STEPS = 2  # consecutive next-block steps that count as "in order"


class SequentialReads:
    """Feed it the block of every read; it says when to read ahead of that block."""

    def __init__(self, steps: int = SEQUENTIAL_STEPS) -> None:
        self._steps = steps
        self._last = -2
        self._run = 0

    def step(self, block: int) -> bool:
        """Note a read of ``block``; whether reads now move through blocks in order (read ahead of it)."""
        last = self._last
        if block == last:
            return False
        self._run = self._run + 1 if block == last + 1 else 0
        self._last = block
        return self._run >= self._steps
