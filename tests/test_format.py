"""The block format: round trips and every kind of damage detected."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfs.core import format as fmt
from blockfs.errors import CorruptBlockError, UnsupportedVersionError

files_strategy = st.lists(st.binary(max_size=300), max_size=20)


def _decode(block: bytes) -> tuple[fmt.BlockHeader, list[bytes]]:
    head = fmt.decode_header(block, "test block", file_size=len(block))
    data = block[head.data_start :]
    fmt.check_data(head, data, "test block")
    return head, [data[int(o) : int(o + s)] for o, s in zip(head.offsets, head.sizes, strict=True)]


@given(files=files_strategy, block_id=st.integers(0, 2**32 - 1), data=st.data())
def test_round_trip(files, block_id, data):
    labels = data.draw(st.lists(st.integers(-1, 2**31 - 1), min_size=len(files), max_size=len(files)))
    head, back = _decode(fmt.encode_block(block_id, files, labels))
    assert back == files
    assert head.block_id == block_id
    assert head.labels.tolist() == labels
    assert head.count == len(files)


def test_narrow_header_is_the_seed_layout_plus_a_fixed_preamble():
    files = [b"a" * 10, b"bb", b""]
    block = fmt.encode_block(0, files, [1, 2, 3])
    assert len(block) - sum(map(len, files)) == 12 * len(files) + 4 + fmt.PREAMBLE_SIZE
    n = int.from_bytes(block[32:36], "little")
    words = np.frombuffer(block, "<u4", count=2 * n, offset=36)
    assert n == 3 and words[:3].tolist() == [0, 10, 12] and words[3:].tolist() == [10, 2, 0]
    assert np.frombuffer(block, "<i4", count=3, offset=36 + 8 * n).tolist() == [1, 2, 3]


@settings(max_examples=60)
@given(files=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=6), data=st.data())
def test_any_flipped_byte_is_detected(files, data):
    block = bytearray(fmt.encode_block(7, files, list(range(len(files)))))
    pos = data.draw(st.integers(0, len(block) - 1))
    bit = data.draw(st.integers(0, 7))
    block[pos] ^= 1 << bit
    with pytest.raises((CorruptBlockError, UnsupportedVersionError)):
        _decode(bytes(block))


def test_wrong_magic_is_named():
    block = bytearray(fmt.encode_block(0, [b"x"], [0]))
    block[:8] = b"NOTBLOCK"
    with pytest.raises(CorruptBlockError, match="not a blockfs block.*NOTBLOCK"):
        _decode(bytes(block))


def test_newer_version_is_refused_with_upgrade_advice():
    block = bytearray(fmt.encode_block(0, [b"x"], [0]))
    block[8:10] = (fmt.FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(UnsupportedVersionError, match="upgrade blockfs"):
        _decode(bytes(block))


def test_truncation_is_detected():
    block = fmt.encode_block(0, [b"abc" * 100, b"def"], [0, 1])
    for cut in (0, 10, fmt.PREAMBLE_SIZE + 2, fmt.PREAMBLE_SIZE + 10, len(block) - 1):
        with pytest.raises(CorruptBlockError, match="truncated"):
            _decode(block[:cut])


def _with_fixed_crc(block: bytearray) -> bytes:
    """Re-seal the header checksum after tampering, as a buggy writer would have."""
    head_len = fmt.header_size(int.from_bytes(block[32:36], "little"), False)
    crc = zlib.crc32(bytes(block[16:head_len]), zlib.crc32(bytes(block[:12])))
    block[12:16] = crc.to_bytes(4, "little")
    return bytes(block)


def test_offsets_or_sizes_out_of_range_are_rejected_even_with_a_valid_checksum():
    block = bytearray(fmt.encode_block(0, [b"abc", b"def"], [0, 1]))
    block[36 + 8 + 4 : 36 + 8 + 8] = (1000).to_bytes(4, "little")  # size of file 1
    with pytest.raises(CorruptBlockError, match="outside the data section"):
        fmt.decode_header(_with_fixed_crc(block), "b")


def test_unknown_flags_are_rejected():
    block = bytearray(fmt.encode_block(0, [b"abc"], [0]))
    block[10:12] = (0x80).to_bytes(2, "little")
    with pytest.raises(CorruptBlockError, match="unknown flags"):
        fmt.decode_header(_with_fixed_crc(block), "b")


def test_wide_blocks_carry_chunk_checksums(monkeypatch):
    monkeypatch.setattr(fmt, "NARROW_LIMIT", 100)
    monkeypatch.setattr(fmt, "CHUNK_SIZE", 64)
    files = [bytes(range(256)), b"tail"]
    block = fmt.encode_block(3, files, [0, -1])
    head, back = _decode(block)
    assert head.flags & fmt.FLAG_WIDE and back == files
    assert len(head.chunk_crcs) == fmt.n_chunks(260)
    assert head.data_start == fmt.header_size(2, True, 260)


def _reads_of(block: bytes, log: list[tuple[int, int]]):
    def pread(size: int, offset: int) -> bytes:
        log.append((size, offset))
        return block[offset : offset + size]

    return pread


def test_read_header_reads_the_preamble_then_exactly_the_header():
    block = fmt.encode_block(7, [b"abc", b"defg"], [0, 1])
    log: list[tuple[int, int]] = []
    head, raw = fmt.read_header(_reads_of(block, log), "b", file_size=len(block))
    assert head.block_id == 7 and raw == block[: head.data_start]
    assert log == [(fmt.PREAMBLE_SIZE + 4, 0), (head.data_start, 0)]


def test_read_header_refuses_a_count_before_reading_the_header():
    block = fmt.encode_block(7, [b"abc", b"defg"], [0, 1])
    log: list[tuple[int, int]] = []

    def check_count(count: int) -> None:
        raise CorruptBlockError(f"{count} files, the index says 3")

    with pytest.raises(CorruptBlockError, match="2 files, the index says 3"):
        fmt.read_header(_reads_of(block, log), "b", file_size=len(block), check_count=check_count)
    assert log == [(fmt.PREAMBLE_SIZE + 4, 0)]


def test_read_header_refuses_a_header_longer_than_the_file_before_reading_it():
    block = bytearray(fmt.encode_block(7, [b"abc"], [0]))
    block[32:36] = (1 << 20).to_bytes(4, "little")  # a damaged count: a 12 MiB header
    log: list[tuple[int, int]] = []
    with pytest.raises(CorruptBlockError, match="truncated or damaged header"):
        fmt.read_header(_reads_of(bytes(block), log), "b", file_size=len(block))
    assert log == [(fmt.PREAMBLE_SIZE + 4, 0)]
    with pytest.raises(CorruptBlockError, match="truncated: 10 bytes"):
        fmt.read_header(_reads_of(bytes(block), log), "b", file_size=10)
