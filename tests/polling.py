"""Wait for something to happen in another thread or process: poll with a timeout, never a fixed sleep.

A fixed sleep is either too short on a loaded machine (a flaky failure) or too long everywhere (a slow
suite); polling returns as soon as the condition holds and fails with a message naming it when it never
does.  The timeout is generous because it only matters when the test is failing anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.01) -> T:
    """Call ``condition`` until it returns something true and return that; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
