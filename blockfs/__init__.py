"""blockfs: pack millions of small files into large blocks; mount them back as the original tree."""

from .dataset import EntryStat, PackedDataset, open_dataset
from .errors import BlockfsError
from .pack import PackOptions, PackResult, pack

__all__ = ["BlockfsError", "EntryStat", "PackOptions", "PackResult", "PackedDataset", "open_dataset", "pack"]
__version__ = "0.1.0"
