"""Freed heap memory handed back to the system (blockfs/core/heap.py), threads' included."""

from __future__ import annotations

import subprocess
import sys

import pytest

FREED_BY_THREADS = r"""
import sys, threading
import numpy as np
from blockfs.core.heap import give_back, one_arena

if sys.argv[1] == "one":
    one_arena()

def rss_anon_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

big = np.ones(8 << 20, np.uint8)
del big  # glibc raises its mmap threshold: the 1 MiB pieces below then come from an arena, as the checks' do
base = rss_anon_kb()

def work():
    pieces = [np.ones(1 << 20, np.uint8) for _ in range(16)]
    del pieces

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
give_back()
print(rss_anon_kb() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_what_threads_freed_goes_back_to_the_system_with_one_arena():
    """The index checks run on threads; their arenas kept ~16 MB of the mount's memory for good at a million
    entries, since malloc_trim cannot shrink a thread's arena.  With one arena it returns to the system."""

    def kept_kb(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FREED_BY_THREADS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert kept_kb("one") < 4096  # "many" (no one_arena, as before): 48 MB kept here
