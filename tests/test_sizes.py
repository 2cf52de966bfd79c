"""blockfs.sizes: one parser and one formatter of sizes for every part (packing, the plan, the CLI)."""

from __future__ import annotations

import pytest

from blockfs.sizes import format_size, parse_size, to_bytes


def test_to_bytes_takes_an_int_or_what_the_cli_takes():
    assert to_bytes(4096) == 4096 and to_bytes("1MiB") == 1 << 20 and to_bytes("1.5 GB") == 1_500_000_000
    for bad in (1.5, True, None):
        with pytest.raises(TypeError, match="block_size must be a number of bytes or a size such as '64MiB'"):
            to_bytes(bad, "block_size")


def test_one_formatter_two_precisions_both_read_back():
    assert format_size(3) == "3 B" and format_size(9.5 * 2**30) == "9.50 GiB"
    assert format_size(9.5 * 2**30, decimals=1) == "9.5 GiB"
    assert parse_size(format_size(123_456_789)) == pytest.approx(123_456_789, rel=0.005)
