"""The FUSE side of a mount: the kernel protocol (session, wire), the two adapters that translate its
requests into :class:`~blockfs.serve.view.MountView` calls (kernel_adapter, the default; libfuse_adapter
through mfusepy/fusepy) and what each route needs (kernel_options, libfuse_threads, libfuse_messages)."""
