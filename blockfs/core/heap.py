"""Giving freed heap memory back to the system, between the steps of a large build.

glibc keeps memory that Python and NumPy free on its heap for reuse; after a step that freed many
chunk-sized arrays (the chunks of a listing, joined into one array that lives in its own mapping), that
memory still counts as the process's until something reuses it.  ``malloc_trim`` returns the free pages
at once, so a pack's peak is what it holds, not what it once held.  Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
if sys.platform.startswith("linux"):
    try:
        _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        _trim = None


def give_back() -> None:
    """Return the heap's free pages to the system (glibc); a no-op where there is no ``malloc_trim``."""
    if _trim is not None:
        _trim(0)
