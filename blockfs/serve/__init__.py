"""Serving a packed dataset as a mount: caching policies, the block cache and retained files, the memory
plan, the control directory, the prefetch and shared-block sockets, and the thin FUSE adapter.  Uses
:mod:`blockfs.core` and :mod:`blockfs.protocol`; only :mod:`blockfs.serve.fuse.libfuse_adapter` imports a FUSE binding."""
