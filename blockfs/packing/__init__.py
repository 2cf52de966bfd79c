"""Packing: a tree of small files, or a container (RecordIO, tar, WebDataset shards), into blocks plus an
index.  Uses :mod:`blockfs.core` only; the public entry point is :func:`blockfs.pack`."""
