"""``KeptPieces``: a piece of each of the last few blocks read from far away, each fetched once.

A block-shuffled order sends many readers to one block at once: to its header (read in two steps, its
preamble then the whole header), then to its files.  What fetches a piece of a block over the network (the
object store's and the peer tier's block heads; a peer endpoint's data sections read for other nodes)
keeps it for the next reads and fetches it once however many threads ask (single flight).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future


class KeptPieces:
    """The pieces of the last ``kept`` blocks fetched (fewer where they pass ``max_bytes``, but always the
    last one), by block number."""

    def __init__(self, kept: int, max_bytes: int | None = None) -> None:
        self._kept = kept
        self._max_bytes = max_bytes
        self._bytes = 0
        self._pieces: OrderedDict[int, memoryview] = OrderedDict()
        self._loads: dict[int, Future] = {}  # pieces being fetched
        self._lock = threading.Lock()

    def get(self, block: int, fetch: Callable[[], memoryview]) -> memoryview:
        """``block``'s piece: kept, being fetched by another thread (waited for), or fetched here by
        ``fetch()``; a failed fetch raises to every thread that waited on it and keeps nothing."""
        with self._lock:
            kept = self._pieces.get(block)
            if kept is not None:
                self._pieces.move_to_end(block)
                return kept
            future = self._loads.get(block)
            mine = future is None
            if mine:
                future = self._loads[block] = Future()
        assert future is not None
        if not mine:
            return future.result()
        try:
            piece = fetch()
        except BaseException as e:
            with self._lock:
                self._loads.pop(block, None)
            future.set_exception(e)
            raise
        with self._lock:
            self._loads.pop(block, None)
            self._pieces[block] = piece  # no other thread fetched it meanwhile: single flight
            self._bytes += len(piece)
            while len(self._pieces) > 1 and (
                len(self._pieces) > self._kept or (self._max_bytes is not None and self._bytes > self._max_bytes)
            ):
                self._bytes -= len(self._pieces.popitem(last=False)[1])
        future.set_result(piece)
        return piece

    def peek(self, block: int) -> memoryview | None:
        """``block``'s piece if it is kept now (fetching nothing)."""
        with self._lock:
            return self._pieces.get(block)

    def drop(self, block: int) -> None:
        """Forget ``block``'s piece (a failed read or check: the next read fetches it afresh)."""
        with self._lock:
            dropped = self._pieces.pop(block, None)
            if dropped is not None:
                self._bytes -= len(dropped)

    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._bytes = 0
