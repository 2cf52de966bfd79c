"""Shared test fixtures and capability checks.

A test that needs a machine capability (``/dev/fuse``, PyTorch) is skipped where that capability is
missing, *unless* ``BLOCKFS_REQUIRE_ALL=1`` is set: then it fails, so CI (which has both) can never go
green by skipping.
"""

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


@pytest.fixture
def torch_module():
    """The torch module, or a skip (a failure under BLOCKFS_REQUIRE_ALL=1) where it is not installed."""
    require(has_torch(), "PyTorch")
    import torch

    return torch
