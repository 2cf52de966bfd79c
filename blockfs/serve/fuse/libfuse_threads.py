"""Enough libfuse worker threads that metadata never waits behind reads waiting on storage.

The high-level libfuse API answers each request on one of its worker threads, and a read waits for its bytes
on that thread.  libfuse 3.12+ caps the pool at ``max_threads`` (10 by default); with 10 reads waiting on
a slow store, a ``stat`` or an ``ls`` — which never need the store — queue behind them (issue 21, F9:
11–41 s with 40 waiting reads).  The kernel sends a mount at most ``max_background`` (12 by default)
read-ahead requests at once, so a pool well above that keeps threads free for lookups, attributes,
listings and the control files.

``-o max_threads=N`` says so, but libfuse 3.12.0–3.14.0's ``fuse_main_real`` parses the option and never
applies it (fixed in 3.14.1, libfuse commit ab5ca07a "Fix max_threads command line parameter
propagation").  :func:`main_with_max_threads` is that function as libfuse writes it, with the fix, for
:mod:`mfusepy` (which calls ``fuse_main_real``) to use instead; where the library lacks the 3.12 symbols it
uses, the binding's own is kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

MAX_THREADS = 64  # libfuse worker threads: well above the kernel's 12 read-aheads in flight


class _FuseArgs(ctypes.Structure):
    _fields_ = [("argc", ctypes.c_int), ("argv", ctypes.POINTER(ctypes.c_char_p)), ("allocated", ctypes.c_int)]


class _CmdlineOpts(ctypes.Structure):  # struct fuse_cmdline_opts, libfuse >= 3.12
    _fields_ = [
        ("singlethread", ctypes.c_int),
        ("foreground", ctypes.c_int),
        ("debug", ctypes.c_int),
        ("nodefault_subtype", ctypes.c_int),
        ("mountpoint", ctypes.c_void_p),
        ("show_version", ctypes.c_int),
        ("show_help", ctypes.c_int),
        ("clone_fd", ctypes.c_int),
        ("max_idle_threads", ctypes.c_uint),
        ("max_threads", ctypes.c_uint),
    ]


_SYMBOLS = {  # name -> (restype, argtypes); the versioned names of libfuse >= 3.12
    "fuse_parse_cmdline_312": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "fuse_new_31": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "fuse_mount": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "fuse_daemonize": (ctypes.c_int, [ctypes.c_int]),
    "fuse_get_session": (ctypes.c_void_p, [ctypes.c_void_p]),
    "fuse_set_signal_handlers": (ctypes.c_int, [ctypes.c_void_p]),
    "fuse_remove_signal_handlers": (None, [ctypes.c_void_p]),
    "fuse_loop": (ctypes.c_int, [ctypes.c_void_p]),
    "fuse_loop_cfg_create": (ctypes.c_void_p, []),
    "fuse_loop_cfg_destroy": (None, [ctypes.c_void_p]),
    "fuse_loop_cfg_set_clone_fd": (None, [ctypes.c_void_p, ctypes.c_uint]),
    "fuse_loop_cfg_set_idle_threads": (None, [ctypes.c_void_p, ctypes.c_uint]),
    "fuse_loop_cfg_set_max_threads": (None, [ctypes.c_void_p, ctypes.c_uint]),
    "fuse_loop_mt_312": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "fuse_unmount": (None, [ctypes.c_void_p]),
    "fuse_destroy": (None, [ctypes.c_void_p]),
    "fuse_opt_free_args": (None, [ctypes.c_void_p]),
}


def _bind(lib: ctypes.CDLL) -> dict | None:
    """libfuse's functions this module calls, typed; None when the library lacks one (libfuse < 3.12)."""
    found = {}
    for name, (restype, argtypes) in _SYMBOLS.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            return None
        function.restype, function.argtypes = restype, argtypes
        found[name] = function
    return found


def main_with_max_threads(f: dict, argc: int, argv: Any, operations: Any, operations_size: int, user_data: Any) -> int:
    """libfuse 3.14's ``fuse_main_real`` (lib/helper.c), with ``max_threads`` applied to the loop; the
    arguments are the ctypes values the binding passes to ``fuse_main_real``."""
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    args = _FuseArgs(argc, ctypes.cast(argv, ctypes.POINTER(ctypes.c_char_p)), 0)
    opts = _CmdlineOpts()
    if f["fuse_parse_cmdline_312"](ctypes.byref(args), ctypes.byref(opts)) != 0:
        return 1
    try:
        if not opts.mountpoint:
            return 2
        fuse = f["fuse_new_31"](
            ctypes.byref(args), ctypes.cast(operations, ctypes.c_void_p), operations_size, user_data
        )
        if not fuse:
            return 3
        try:
            if f["fuse_mount"](fuse, opts.mountpoint) != 0:
                return 4
            try:
                if f["fuse_daemonize"](opts.foreground) != 0:
                    return 5
                session = f["fuse_get_session"](fuse)
                if f["fuse_set_signal_handlers"](session) != 0:
                    return 6
                try:
                    if opts.singlethread:
                        res = f["fuse_loop"](fuse)
                    else:
                        config = f["fuse_loop_cfg_create"]()
                        if not config:
                            return 7
                        try:
                            f["fuse_loop_cfg_set_clone_fd"](config, opts.clone_fd)
                            f["fuse_loop_cfg_set_idle_threads"](config, opts.max_idle_threads)
                            f["fuse_loop_cfg_set_max_threads"](config, opts.max_threads)
                            res = f["fuse_loop_mt_312"](fuse, config)
                        finally:
                            f["fuse_loop_cfg_destroy"](config)
                    return 8 if res else 0
                finally:
                    f["fuse_remove_signal_handlers"](session)
            finally:
                f["fuse_unmount"](fuse)
        finally:
            f["fuse_destroy"](fuse)
    finally:
        libc.free(opts.mountpoint)
        f["fuse_opt_free_args"](ctypes.byref(args))


@contextlib.contextmanager
def max_threads_applied(binding: ModuleType) -> Iterator[bool]:
    """While mounting with ``binding``: its ``fuse_main_real`` replaced by :func:`main_with_max_threads`
    where that is mfusepy on libfuse >= 3.12; yields whether it was."""
    lib = getattr(binding, "_libfuse", None)
    functions = _bind(lib) if binding.__name__ == "mfusepy" and lib is not None else None
    if functions is None or not hasattr(binding, "fuse_main_real"):
        yield False
        return
    # getattr/setattr: the binding is a module chosen at run time, whose attributes mypy cannot know
    original = getattr(binding, "fuse_main_real")  # noqa: B009

    def main(argc, argv, operations, operations_size, user_data):
        return main_with_max_threads(functions, argc, argv, operations, operations_size, user_data)

    setattr(binding, "fuse_main_real", main)  # noqa: B010
    try:
        yield True
    finally:
        setattr(binding, "fuse_main_real", original)  # noqa: B010
