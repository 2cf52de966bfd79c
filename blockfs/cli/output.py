"""How the command line shows sizes and progress to people."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, NoReturn

from ..sizes import format_size

if TYPE_CHECKING:
    from tqdm import tqdm


def progress_bar(total: int | None, unit: str, desc: str) -> tqdm[NoReturn] | None:
    """A tqdm bar on a terminal (a counter when ``total`` is None); None (quiet) when stderr is not one."""
    return terminal_bar(total, unit, desc) if sys.stderr.isatty() else None


def terminal_bar(total: int | None, unit: str, desc: str) -> tqdm[NoReturn]:
    """:func:`progress_bar`'s bar, for a caller that checked stderr is a terminal."""
    from tqdm import tqdm

    divisor = 1024 if unit == "B" else 1000
    return tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=divisor, desc=desc, dynamic_ncols=True)


def human(n: float) -> str:
    """A size in powers of 1024, short: ``"9.5 GiB"`` (:func:`blockfs.sizes.format_size`, one decimal)."""
    return format_size(n, decimals=1)


def plural(n: int, noun: str) -> str:
    """``"1 block"``, ``"1,800 blocks"``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def log_level(args: argparse.Namespace) -> int:
    """The logging level the options ask for: --log-level, else -v (debug) or -q (warning), else info."""
    if args.log_level:
        return getattr(logging, args.log_level.upper())
    return logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
