"""``KeptHeads``: the first bytes of the last few blocks read from far away, each fetched once.

A header is read in two steps (its preamble, then the whole header), and a block-shuffled order sends many
readers to one block's header at once: a tier that fetches over the network (the object store, a peer)
keeps each block's head for the next reads and fetches it once however many threads ask (single flight).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future


class KeptHeads:
    """The heads of the last ``kept`` blocks fetched, by block number."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._heads: OrderedDict[int, memoryview] = OrderedDict()
        self._loads: dict[int, Future] = {}  # heads being fetched
        self._lock = threading.Lock()

    def get(self, block: int, fetch: Callable[[], memoryview]) -> memoryview:
        """``block``'s head: kept, being fetched by another thread (waited for), or fetched here by
        ``fetch()``; a failed fetch raises to every thread that waited on it and keeps nothing."""
        with self._lock:
            head = self._heads.get(block)
            if head is not None:
                self._heads.move_to_end(block)
                return head
            future = self._loads.get(block)
            mine = future is None
            if mine:
                future = self._loads[block] = Future()
        assert future is not None
        if not mine:
            return future.result()
        try:
            head = fetch()
        except BaseException as e:
            with self._lock:
                self._loads.pop(block, None)
            future.set_exception(e)
            raise
        with self._lock:
            self._loads.pop(block, None)
            self._heads[block] = head
            while len(self._heads) > self._kept:
                self._heads.popitem(last=False)
        future.set_result(head)
        return head

    def peek(self, block: int) -> memoryview | None:
        """``block``'s head if it is kept now (fetching nothing)."""
        with self._lock:
            return self._heads.get(block)

    def drop(self, block: int) -> None:
        """Forget ``block``'s head (a failed read or check: the next read fetches it afresh)."""
        with self._lock:
            self._heads.pop(block, None)

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(h) for h in self._heads.values())

    def clear(self) -> None:
        with self._lock:
            self._heads.clear()
