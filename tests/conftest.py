"""Shared test fixtures and capability checks.

A test that needs a machine capability (``/dev/fuse``, PyTorch, root) is skipped where that capability is
missing, *unless* ``BLOCKFS_REQUIRE_ALL=1`` is set: then every skip, however it was asked for
(:func:`require`, a ``skipif`` mark, ``pytest.skip``), is reported as a failure, so CI (which has all of
them) can never go green by skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import settings

REQUIRE_ALL = os.environ.get("BLOCKFS_REQUIRE_ALL") == "1"

# No deadline anywhere: how long an example takes on a shared machine is a wall-clock assertion, and
# speed is measured in tools/bench/.  CI runs the property tests on a fixed set of examples, so its verdict is
# the code's and not the draw's; local runs keep exploring new examples (and remember failures in
# .hypothesis/).  Both profiles say derandomize outright: Hypothesis derandomizes by itself when it sees
# a CI variable (CI=true), and a profile that inherited that would make the two modes the same.
settings.register_profile("local", deadline=None, derandomize=False)
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if REQUIRE_ALL else "local")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under BLOCKFS_REQUIRE_ALL=1, a skipped test is a failed one (an expected failure stays one)."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}), and BLOCKFS_REQUIRE_ALL=1 says nothing may skip here"


def pytest_collectreport(report):
    """Under BLOCKFS_REQUIRE_ALL=1, a module skipped whole at collection fails too."""
    if REQUIRE_ALL and report.skipped:
        report.outcome = "failed"


def require(condition: bool, what: str) -> None:
    """Skip (or fail under BLOCKFS_REQUIRE_ALL=1) when a machine capability is missing."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{what} is missing, and BLOCKFS_REQUIRE_ALL=1 says this machine must have it")
    pytest.skip(f"{what} is missing on this machine")


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def has_fuse() -> bool:
    return os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)


@pytest.fixture
def torch_module():
    """The torch module, or a skip (a failure under BLOCKFS_REQUIRE_ALL=1) where it is not installed."""
    require(has_torch(), "PyTorch")
    import torch

    return torch


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto) on loopback for the whole session, always stopped at the end."""
    require(importlib.util.find_spec("moto") is not None and importlib.util.find_spec("obstore") is not None,
            "moto[server] and obstore (pip install -e '.[test]')")  # fmt: skip
    from s3server import S3Server

    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, reachable from this process and its children through the AWS variables."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    s3_server.start() if s3_server._server is None else None  # a test that stopped it and failed
    return s3_server


# --- trees to pack -----------------------------------------------------------------------------------
EDGE_MTIME_NS = 1_600_000_000_123_456_789


def make_edge_tree(root: str | os.PathLike, *, special: bool = False) -> bytes:
    """A tree with every kind of thing the packer must keep: returns its path as bytes.

    Empty files and directories, nested directories, relative/absolute/dangling symlinks, hard links,
    names that are not UTF-8 or hold spaces, newlines and leading dashes, odd modes, nanosecond mtimes.
    With ``special``, also a FIFO and a socket (which the packer skips).
    """
    import socket

    root = os.fsencode(root)
    os.makedirs(root, exist_ok=True)

    def put(rel: bytes, data: bytes, mode: int = 0o644) -> None:
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    put(b"class_a/one.txt", b"hello\n")
    put(b"class_a/empty.bin", b"")
    put(b"class_a/big.bin", bytes(range(256)) * 700)
    put(b"class_b/\xff\xfe not utf8.bin", b"bytes\x00\xff")
    put(b"class_b/with space.txt", b"space")
    put(b"class_b/new\nline.txt", b"newline")
    put(b"class_b/-leading-dash", b"dash", 0o600)
    put("class_b/日本語.txt".encode(), "unicode".encode())
    put(b"class_b/deep/er/est/file.dat", os.urandom(3000), 0o755)
    put(b"top_level_file", b"no class", 0o444)
    os.makedirs(os.path.join(root, b"empty_dir"))
    os.makedirs(os.path.join(root, b"class_c/empty_sub"))
    os.chmod(os.path.join(root, b"class_c/empty_sub"), 0o700)
    os.symlink(b"one.txt", os.path.join(root, b"class_a/link_rel"))
    os.symlink(b"/nonexistent/target", os.path.join(root, b"dangling_abs"))
    os.symlink(b"class_b/deep", os.path.join(root, b"link_to_dir"))
    os.link(os.path.join(root, b"class_a/one.txt"), os.path.join(root, b"class_c/hardlink_to_one"))
    if special:
        os.mkfifo(os.path.join(root, b"a_fifo"))
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(os.path.join(root, b"a_socket"))
        sock.close()
    # mtimes last (deepest first), so creating children does not move a directory's mtime.
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), ns=(EDGE_MTIME_NS, EDGE_MTIME_NS), follow_symlinks=False)
    os.utime(root, ns=(EDGE_MTIME_NS, EDGE_MTIME_NS))
    return root


def make_class_tree(src, files: int, seed: int, sizes: tuple[int, int]) -> None:
    """``files`` files of random bytes (sizes in the closed range ``sizes``) in three class directories."""
    import random
    from pathlib import Path

    rng = random.Random(seed)
    for i in range(files):
        path = Path(src) / f"c{i % 3}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(rng.randint(*sizes)))


@pytest.fixture
def edge_tree(tmp_path) -> bytes:
    return make_edge_tree(tmp_path / "src")
