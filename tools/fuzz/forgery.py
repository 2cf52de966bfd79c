"""Forge bytes that keep a CRC-32: what anyone who can write a block, a disk-tier copy or an object can do.

CRC-32 is affine over GF(2): ``crc(a ^ b) == crc(a) ^ crc(b) ^ crc(zeros)`` for equal lengths.  So after
any change, 4 bytes elsewhere in the same buffer can be solved for (32 equations, 32 unknown bits) that
bring the CRC back: :func:`forge` does that, and tests show the digest, not the CRC, refuses the result.
"""

from __future__ import annotations

import zlib


def _delta(length: int, pos: int, change: bytes) -> int:
    """The CRC difference that XOR-ing ``change`` at ``pos`` into ``length`` zero bytes makes."""
    buf = bytearray(length)
    buf[pos : pos + len(change)] = change
    return zlib.crc32(bytes(buf)) ^ zlib.crc32(bytes(length))


def forge(data: bytes, changed_at: int = 0, fix_at: int | None = None) -> bytes:
    """``data`` with byte ``changed_at`` flipped and 4 bytes at ``fix_at`` (the last four by default) set so
    that the whole has the same CRC-32 as ``data``.  Needs ``len(data) >= 5`` and the two places apart."""
    n = len(data)
    fix_at = n - 4 if fix_at is None else fix_at
    assert n >= 5 and not fix_at <= changed_at < fix_at + 4
    out = bytearray(data)
    out[changed_at] ^= 0xFF
    target = _delta(n, changed_at, b"\xff")  # what the 4 fix bytes must cancel
    # Columns: the CRC difference of each of the 32 bits at fix_at; solve sum(x_i * col_i) == target.
    cols = [_delta(n, fix_at, (1 << i).to_bytes(4, "little")) for i in range(32)]
    # Build the augmented system: for each output bit r, sum_i x_i * bit_r(col_i) == bit_r(target).
    eqs = [(sum(((cols[i] >> r) & 1) << i for i in range(32)), (target >> r) & 1) for r in range(32)]
    solution = 0
    pivots: list[tuple[int, int, int]] = []
    for mask, val in eqs:
        for bit, pmask, pval in pivots:
            if mask >> bit & 1:
                mask, val = mask ^ pmask, val ^ pval
        if mask:
            bit = mask.bit_length() - 1
            pivots.append((bit, mask, val))
        else:
            assert val == 0, "no solution"
    for bit, mask, val in sorted(pivots):  # back-substitute, lowest pivot first
        rest = mask & ~(1 << bit)
        solution |= (val ^ (bin(rest & solution).count("1") & 1)) << bit
    fix = int.from_bytes(out[fix_at : fix_at + 4], "little") ^ solution
    out[fix_at : fix_at + 4] = fix.to_bytes(4, "little")
    forged = bytes(out)
    assert forged != data and zlib.crc32(forged) == zlib.crc32(data)
    return forged
