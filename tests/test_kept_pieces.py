"""KeptPieces: a block's head fetched once however many threads ask, a failure kept by no one, few kept."""

from __future__ import annotations

import threading

import pytest

from blockfs.storage.kept_pieces import KeptPieces


def test_threads_asking_at_once_share_one_fetch():
    heads = KeptPieces(4)
    started, release = threading.Event(), threading.Event()
    fetches = []

    def fetch() -> memoryview:
        fetches.append(1)
        started.set()
        assert release.wait(30)
        return memoryview(b"head")

    got: list[bytes] = []
    first = threading.Thread(target=lambda: got.append(bytes(heads.get(7, fetch))))
    first.start()
    assert started.wait(30)  # the first fetch is under way: the others must wait on it, not fetch again
    others = [threading.Thread(target=lambda: got.append(bytes(heads.get(7, fetch)))) for _ in range(5)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(30)
    assert got == [b"head"] * 6 and len(fetches) == 1
    assert bytes(heads.peek(7)) == b"head" and heads.nbytes() == 4


def test_a_failed_fetch_raises_to_its_waiters_and_keeps_nothing():
    heads = KeptPieces(4)

    def broken() -> memoryview:
        raise OSError("gone")

    with pytest.raises(OSError, match="gone"):
        heads.get(1, broken)
    assert heads.peek(1) is None
    assert bytes(heads.get(1, lambda: memoryview(b"ok"))) == b"ok"  # the next read fetches afresh


def test_only_the_last_few_are_kept_and_a_dropped_one_is_fetched_again():
    heads = KeptPieces(2)
    for block in range(3):
        heads.get(block, lambda b=block: memoryview(bytes([b])))
    assert heads.peek(0) is None and heads.peek(1) is not None and heads.peek(2) is not None
    heads.drop(2)
    assert heads.peek(2) is None
    heads.clear()
    assert heads.nbytes() == 0


def test_pieces_past_the_byte_bound_go_oldest_first_but_the_last_one_stays():
    pieces = KeptPieces(8, max_bytes=10)
    for block in range(3):
        pieces.get(block, lambda: memoryview(bytes(4)))
    assert pieces.peek(0) is None and pieces.nbytes() == 8  # 12 bytes passed 10: the oldest went
    pieces.get(9, lambda: memoryview(bytes(50)))  # larger than the bound alone: kept, the only one
    assert pieces.peek(9) is not None and pieces.nbytes() == 50 and pieces.peek(2) is None
