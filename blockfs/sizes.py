"""Sizes typed by people and shown to them: :func:`parse_size` reads ``"64MiB"``, :func:`format_size`
writes ``"9.50 GiB"`` (and reads back).  One module for every part (packing, the mount's plan, the CLI),
so a size means the same everywhere."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["format_size", "parse_size", "to_bytes"]

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_UNITS = {"": 1, "b": 1} | {
    unit: base**power
    for power, letter in enumerate("kmgtp", start=1)
    for unit, base in ((letter, 1024), (letter + "ib", 1024), (letter + "b", 1000))
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in a size typed by a person: ``"123"``, ``"64MiB"``, ``"1.5G"``, ``"10 GB"`` (rounded down).

    K/M/G/T/P and KiB/.../PiB are powers of 1024; KB/MB/GB/TB/PB are powers of 1000; case is ignored.
    """
    match = _SIZE_RE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number of bytes ('123') or a number with a unit, "
            "K/M/G/T/P or KiB/MiB/GiB/TiB/PiB (powers of 1024) or KB/MB/GB/TB/PB (powers of 1000), "
            "e.g. '64MiB', '1.5G'"
        )
    return int(Decimal(match.group(1)) * unit)


def to_bytes(size: int | str, name: str = "size") -> int:
    """``size`` as bytes: an int as it is, a string through :func:`parse_size` (what the CLI accepts)."""
    if isinstance(size, str):
        return parse_size(size)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"{name} must be a number of bytes or a size such as '64MiB', not {size!r}")
    return size


def format_size(nbytes: float, decimals: int = 2) -> str:
    """A size for people, in powers of 1024: ``"9.50 GiB"`` (``decimals=1``: ``"9.5 GiB"``, for a line
    of the command's output); :func:`parse_size` reads it back."""
    value, power = float(nbytes), 0
    while abs(value) >= 1024 and power < len(_BINARY_UNITS) - 1:
        value, power = value / 1024, power + 1
    return f"{nbytes:.0f} B" if power == 0 else f"{value:.{decimals}f} {_BINARY_UNITS[power]}"
