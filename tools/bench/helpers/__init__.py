"""What the benchmarks in tools/bench/ import or start as child processes, and the one place that knows the layout.

A benchmark runs as ``python tools/bench/bench_NAME.py``, so Python puts tools/bench/ first on ``sys.path``
and this package imports as ``helpers`` (``from helpers.benchutil import drop_caches``).  Importing it also
puts the checkout's root (``blockfs``, even for an interpreter without the project installed) and tools/
(``make_dataset``, the sample generator users run too) on ``sys.path``, so a benchmark imports from
``helpers`` before ``blockfs`` or ``make_dataset``.  Child processes are started by path:
``[sys.executable, str(HELPERS / "null_fs.py"), ...]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent  # tools/bench/helpers
BENCH = HELPERS.parent  # tools/bench: the benchmarks
TOOLS = BENCH.parent  # tools: what a user or CI runs (make_dataset.py, setup.sh, ...)
ROOT = TOOLS.parent  # the checkout

for _path in (str(TOOLS), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
