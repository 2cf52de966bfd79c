"""The FUSE side of a mount: the kernel protocol (session, wire), the two adapters that translate its
requests into :class:`~blockfs.serve.view.MountView` calls (kernel_adapter, the default, with its
page_pusher; libfuse_adapter through mfusepy/fusepy) and what each route needs (kernel_options,
libfuse_threads, libfuse_messages).

Both adapters are one interface (:class:`Adapter`), made by :func:`make_adapter`: the server never
branches on the route.  Importing this package imports nothing (no binding, no NumPy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import threading

    from ..mount_options import MountOptions
    from ..view import MountView, Route


class Adapter(Protocol):
    """A FUSE adapter of one mount: made with the mount's options and the builder of its view (given what
    the route brings), then :meth:`run` until unmounted."""

    view: MountView
    served: bool  # the kernel's INIT answered: the mount serves
    stopped: threading.Event  # set once serving has ended (or the kernel said DESTROY)

    def run(self, mountpoint: str, fsname: str) -> None:
        """Mount at ``mountpoint`` (``fsname``: the source the mount table shows) and serve until unmounted
        (or SIGINT/SIGTERM); blocks.  MountError, in one line, when it cannot mount."""
        ...


def make_adapter(route: str, options: MountOptions, build: Callable[[Route], MountView]) -> Adapter:
    """The adapter of ``route``: ``kernel`` (the kernel protocol), ``mfusepy`` or ``fusepy`` (a libfuse binding,
    loaded now)."""
    if route == "kernel":
        from .kernel_adapter import KernelFS

        return KernelFS(options, build)
    from .libfuse_adapter import make_adapter as libfuse_adapter

    return libfuse_adapter(route, options, build)
