"""Machine capabilities a test may need (``/dev/fuse``, PyTorch): :func:`require` skips where one is
missing, or fails under ``BLOCKFS_REQUIRE_ALL=1`` (CI), where nothing may skip (see conftest.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ALL = os.environ.get("BLOCKFS_REQUIRE_ALL") == "1"


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
