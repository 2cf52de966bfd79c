"""The companion PyTorch loader: block-shuffled orders, epoch plans, reuse and importance options, the view
of a mount it reads through, batches and the device copy.

This package imports without torch: the orders and the mount's view are pure NumPy and standard library.
``BlockLoader`` and the names beside it load torch on first use (``from blockfs.loader import BlockLoader``).
"""

from typing import Any

from .importance import ImportanceConfig

_TORCH_NAMES = ("BlockLoader", "BlockShuffleDataset")
INSTALL_TORCH = (
    "pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU build; for CUDA, "
    "the command pytorch.org gives for your CUDA version)"
)


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        try:
            from . import block_loader
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ModuleNotFoundError(f"blockfs.loader.{name} needs PyTorch: {INSTALL_TORCH}", name="torch") from None

        return getattr(block_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_TORCH_NAMES, "ImportanceConfig"]
