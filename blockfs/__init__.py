"""blockfs: pack millions of small files into large blocks; mount them back as the original tree."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.dataset import EntryStat, PackedDataset, open_dataset
    from .errors import BlockfsError
    from .packing.packer import PackOptions, PackResult, pack

__all__ = ["BlockfsError", "EntryStat", "PackOptions", "PackResult", "PackedDataset", "open_dataset", "pack"]
__version__ = "0.1.0"

# Imported on first use (PEP 562), so that importing any part of blockfs (the command line, which starts a
# mount's server) does not import NumPy and the packer: `blockfs mount` returns sooner.
_HOMES = {
    "EntryStat": ".core.dataset",
    "PackedDataset": ".core.dataset",
    "open_dataset": ".core.dataset",
    "BlockfsError": ".errors",
    "PackOptions": ".packing.packer",
    "PackResult": ".packing.packer",
    "pack": ".packing.packer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'blockfs' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # once
    return value
