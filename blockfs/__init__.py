"""blockfs: pack millions of small files into large blocks; mount them back as the original tree."""

from .core.dataset import EntryStat, PackedDataset, open_dataset
from .errors import BlockfsError
from .packing.packer import PackOptions, PackResult, pack

__all__ = ["BlockfsError", "EntryStat", "PackOptions", "PackResult", "PackedDataset", "open_dataset", "pack"]
__version__ = "0.1.0"
