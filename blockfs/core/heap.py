"""Giving freed heap memory back to the system, between the steps of a large build.

glibc keeps memory that Python and NumPy free on its heap for reuse; after a step that freed many
chunk-sized arrays (the chunks of a listing, joined into one array that lives in its own mapping), that
memory still counts as the process's until something reuses it.  ``malloc_trim`` returns the free pages
at once, so a pack's peak is what it holds, not what it once held.  Elsewhere (not glibc) it does nothing.

Threads get arenas of their own, and ``malloc_trim`` cannot shrink those: what the index checks' threads
freed (~16 MB at a million entries) stayed the mount's for good.  A long-lived process that wants its
memory back calls :func:`one_arena` first: every thread then allocates from the main arena, which
``malloc_trim`` does return.  Python allocates under the GIL, so the one arena's lock costs it nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
_mallopt: Callable[[int, int], int] | None = None
M_ARENA_MAX = -8  # glibc's mallopt parameter
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None)  # the process's own symbols, libc's among them
        _trim, _mallopt = _libc.malloc_trim, _libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        _trim = _mallopt = None


def give_back() -> None:
    """Return the heap's free pages to the system (glibc); a no-op where there is no ``malloc_trim``."""
    if _trim is not None:
        _trim(0)


def one_arena() -> None:
    """From now on every thread allocates from the main arena (glibc), so :func:`give_back` returns what
    threads freed too; a no-op elsewhere.  Call it before the threads start."""
    if _mallopt is not None:
        _mallopt(M_ARENA_MAX, 1)
