"""Machine capabilities a test may need (``/dev/fuse``, PyTorch): :func:`require` skips where one is
missing, or fails under ``BLOCKFS_REQUIRE_ALL=1`` (CI), where nothing may skip (see conftest.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ALL = os.environ.get("BLOCKFS_REQUIRE_ALL") == "1"
# CI has no GPU: the tests marked ``gpu`` skip there even under BLOCKFS_REQUIRE_ALL=1, and fail instead of
# skipping only where BLOCKFS_REQUIRE_GPU=1 says the machine has one (tools/gpu_check.sh sets it).
REQUIRE_GPU = os.environ.get("BLOCKFS_REQUIRE_GPU") == "1"


def require(condition: bool, what: str) -> None:
    """Skip (or fail under BLOCKFS_REQUIRE_ALL=1) when a machine capability is missing."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{what} is missing, and BLOCKFS_REQUIRE_ALL=1 says this machine must have it")
    pytest.skip(f"{what} is missing on this machine")


def require_gpu() -> None:
    """Skip where no CUDA GPU is usable (even under BLOCKFS_REQUIRE_ALL=1); fail under BLOCKFS_REQUIRE_GPU=1."""
    if has_torch():
        import torch

        if torch.cuda.is_available():
            return
    if REQUIRE_GPU:
        pytest.fail("no CUDA GPU is usable here, and BLOCKFS_REQUIRE_GPU=1 says this machine has one")
    pytest.skip("no CUDA GPU on this machine (CI has none; tools/gpu_check.sh runs these where there is one)")


def has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def has_fuse() -> bool:
    return os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK)
