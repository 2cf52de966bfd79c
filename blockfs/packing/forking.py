"""Worker processes forked from the caller, for work that Python threads would do one at a time.

Packing small files is mostly Python work per file (open, read, CRC, bookkeeping), and threads take turns
on the GIL for it; forked processes run it on every core.  Fork (not spawn) because the children inherit
the packing plan as it is in memory — nothing is pickled on the way in, and no interpreter starts.

A child ignores SIGINT (the parent handles Ctrl-C and stops the pool) and is killed when the parent
dies, so a killed pack leaves no orphan still writing into its destination.  Linux only; elsewhere
:func:`forked_pool` returns None and the caller uses threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # multiprocessing costs ~10 ms to import: only a pack that forks pays for it
    from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def forked_pool(
    workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...] = ()
) -> ProcessPoolExecutor | None:
    """A pool of ``workers`` forked processes that each run ``initializer(*initargs)`` first; None if
    this platform cannot fork.  The arguments reach the children through fork, unpickled."""
    if sys.platform != "linux":
        return None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_start_child,
        initargs=(os.getpid(), initializer, initargs),
    )


def _start_child(parent: int, initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    initializer(*initargs)


def fork_child(run: Callable[[], None]) -> int:
    """Run ``run()`` in a forked child that dies with the parent and ignores SIGINT; its pid.

    The child leaves with ``os._exit`` (status 1 if ``run`` raised), never returning into the caller's
    code.  For one long job beside the caller's own Python work, which a thread would share the GIL with.
    """
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == parent:  # else the parent died before the line above took effect
            run()
            status = 0
    finally:
        os._exit(status)
