"""Where a packed dataset's bytes live: a local directory, or an object store behind a URL.

Below ``core``: the block store reads block files through :class:`~blockfs.storage.blockfiles.BlockFiles`
and never learns whether they are local files, ranged GETs, or copies kept on a local disk.
"""
