"""A FUSE session without libfuse: mount, read requests from ``/dev/fuse``, write replies and notifications.

Why not a binding: the kernel protocol carries the node id of every request, READ included, whether or
not the file was opened — libfuse's high-level API hides node ids and pyfuse3's ``read`` sees only the
file handle, so neither can serve reads with ``open`` skipped *and* push pages into the kernel's cache.
Speaking the protocol directly costs one ``readv`` and one ``writev`` per request, with no ctypes
callback and no thread-state switch in between (``tools/bench/helpers/null_fs.py`` measures it against the bindings).

* **Mounting.**  As root, ``mount(2)`` with the device's descriptor in the options, as libfuse does; as
  anyone else, ``fusermount3`` (setuid), which mounts and hands the descriptor back over a socket
  (``_FUSE_COMMFD``).  Unmounting: ``umount2(MNT_DETACH)`` or ``fusermount3 -u -z``; then the device's
  descriptor is let go but its number kept (:meth:`Session._retire_fd`): a late write from any thread
  fails, never lands in a file opened since under that number.
* **Threads.**  ``threads`` readers share the one descriptor; the kernel hands each request to one of
  them.  A handler either answers at once (its return value is the reply body) or returns
  :data:`DEFERRED` and answers later from any thread with :meth:`Session.reply`/:meth:`Session.fail` —
  so a request that waits on storage never holds a reader, and lookups, stats and listings never queue
  behind slow data.
* **Notifications** (:meth:`Session.store`) are plain writes to the same descriptor.  They must not come
  from a reader thread: the kernel takes the page lock of the pages it stores into, and a process
  reading those pages holds that lock while it waits for a READ only a reader thread would answer.

Handlers raise ``OSError`` with an errno to answer an error; anything else is logged and answered EIO.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from . import kernel_options, wire
from .kernel_options import MS_NODEV, MS_NOSUID, MS_RDONLY

log = logging.getLogger(__name__)

DEFERRED = object()  # a handler's answer: "I will reply later"
NO_REPLY = object()  # FORGET and BATCH_FORGET: the kernel expects nothing back
BUFFER_BYTES = 1 << 17  # > the largest request a read-only filesystem is sent (names, xattr names)

MNT_DETACH = 2

Handler = Callable[[int, memoryview, int], Any]  # (nodeid, request body, unique) -> reply body


class MountFailed(OSError):
    """The kernel or fusermount3 refused the mount; ``str()`` is one line saying why."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class Session:
    """One mount of a filesystem whose requests ``handlers`` (opcode -> :data:`Handler`) answer."""

    def __init__(
        self,
        handlers: dict[int, Handler],
        *,
        on_init: Callable[[int, int], int] | None = None,
        on_ioctl: Callable[[int, int], bool] | None = None,
    ) -> None:
        self._handlers = handlers
        self._on_init = on_init  # (kernel minor, kernel flags) -> the flags we want
        # (nodeid, unique) -> True when it takes the ioctl (and answers it later, ENOTTY): see _loop
        self._on_ioctl = on_ioctl
        self.fd = -1
        self._retired = False  # the descriptor let go of (_retire_fd), its number kept
        self.mountpoint = ""
        self.minor = 0
        self.flags = 0
        self.stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fusermount = False
        self.requests: collections.Counter[int] = collections.Counter()  # by opcode; unlocked: a rare lost count

    # --- mounting ---------------------------------------------------------------------------------
    def mount(
        self, mountpoint: str, fsname: str, subtype: str, options: Sequence[str] = (), *, fusermount: bool | None = None
    ) -> None:
        """Mount at ``mountpoint``; ``options`` are mount(8)-style (``allow_other``, ``max_read=N``...), as
        :mod:`blockfs.serve.fuse.kernel_options` takes them.  ``fusermount``: mount through fusermount3 (default:
        only when not root)."""
        try:
            given = kernel_options.parse(options)
        except kernel_options.OptionRefused as e:
            raise MountFailed(errno.EINVAL, str(e)) from None
        for item in given.ignored:
            log.warning("mount option %r is libfuse's and changes nothing on the kernel route: ignored", item)
        given.flags.add("default_permissions")
        fsname, subtype = given.names.get("fsname", fsname), given.names.get("subtype", subtype)
        self.mountpoint = mountpoint
        self._fusermount = os.geteuid() != 0 if fusermount is None else fusermount
        if self._fusermount:
            self.fd = self._mount_with_fusermount(mountpoint, fsname, subtype, given)
        else:
            self.fd = self._mount_directly(mountpoint, fsname, subtype, given)

    @staticmethod
    def _mount_directly(mountpoint: str, fsname: str, subtype: str, given: kernel_options.KernelMount) -> int:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = [
            f"fd={fd}",
            f"rootmode={stat.S_IFDIR:o}",
            f"user_id={os.getuid()}",
            f"group_id={os.getgid()}",
            *sorted(given.flags),
            *(f"{k}={v}" for k, v in sorted(given.values.items())),
        ]
        libc = _libc()
        rc = libc.mount(
            os.fsencode(fsname),
            os.fsencode(mountpoint),
            f"fuse.{subtype}".encode(),
            MS_RDONLY | MS_NOSUID | MS_NODEV | given.mount_flags,
            ",".join(opts).encode(),
        )
        if rc != 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise MountFailed(err, f"mount(2) of {mountpoint!r} failed: {os.strerror(err)}")
        return fd

    @staticmethod
    def _mount_with_fusermount(mountpoint: str, fsname: str, subtype: str, given: kernel_options.KernelMount) -> int:
        tool = shutil.which("fusermount3") or shutil.which("fusermount")
        if tool is None:
            raise MountFailed(errno.ENOENT, "fusermount3 is not installed: install the fuse3 package")
        opts = [
            "ro",
            "nosuid",
            "nodev",
            *given.flag_names(),
            f"fsname={fsname}",
            f"subtype={subtype}",
            *sorted(given.flags),
            *(f"{k}={v}" for k, v in sorted(given.values.items())),
        ]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            done = subprocess.run(
                [tool, "-o", ",".join(opts), "--", mountpoint],
                pass_fds=(theirs.fileno(),),
                env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                capture_output=True,
                text=True,
            )
            theirs.close()
            if done.returncode != 0:
                why = (done.stderr or done.stdout).strip().splitlines()
                raise MountFailed(errno.EPERM, f"{os.path.basename(tool)}: {why[-1] if why else 'failed'}")
            _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
            if not fds:
                raise MountFailed(errno.EIO, f"{os.path.basename(tool)} mounted but sent no descriptor")
            os.set_inheritable(fds[0], False)
            return fds[0]
        finally:
            theirs.close()
            ours.close()

    def unmount(self) -> None:
        """Detach the mount (the readers then see ENODEV and end); quiet when it is already gone."""
        if not self.mountpoint:
            return
        if os.geteuid() == 0 and not self._fusermount:
            if _libc().umount2(os.fsencode(self.mountpoint), MNT_DETACH) == 0:
                return
        tool = shutil.which("fusermount3") or shutil.which("fusermount")
        if tool is not None:
            subprocess.run([tool, "-u", "-z", "--", self.mountpoint], capture_output=True)

    # --- serving ----------------------------------------------------------------------------------
    def serve(self, threads: int, on_ready: Callable[[], None] | None = None) -> None:
        """Answer requests with ``threads`` readers until the mount goes away (or SIGINT/SIGTERM, when
        called from the main thread); blocks.  ``on_ready`` runs after the kernel's INIT is answered."""
        self._on_ready = on_ready
        restore = self._catch_signals()
        try:
            self._threads = [
                threading.Thread(target=self._loop, name=f"blockfs-fuse-{i}", daemon=True) for i in range(threads)
            ]
            for t in self._threads:
                t.start()
            while not self.stopped.wait(0.5):  # a wait with a timeout, so signals reach the main thread
                pass
        finally:
            restore()
            self.unmount()
            for t in self._threads:
                t.join(timeout=5)
            self._retire_fd()

    def _retire_fd(self) -> None:
        """Let go of the connection, never of its descriptor's number, while this session may be written to.

        A plain close would free the number for the next ``open`` of any thread, and a write that had read
        :attr:`fd` before (a page push, a data thread's late answer, a name forgotten, a reader that outlived
        its join on a lazily detached mount; the GIL is dropped between reading the number and the system
        call) would then land in that file: a FUSE message written into a log, a block copy, a socket.
        Instead, one ``dup2`` puts in its place a descriptor that refuses every read and write (``O_PATH``:
        EBADF, which every writer here takes as "gone"); that one is closed once the session is collected,
        when no thread holds it to write through, or by the process's end."""
        if self.fd < 0 or self._retired:
            return
        self._retired = True  # once: a second finalizer would close the number twice, the second time another file's
        try:
            inert = os.open(os.devnull, os.O_PATH | os.O_CLOEXEC)
        except OSError as e:  # out of descriptors at the end: the connection must still go; a plain close
            log.warning("closing /dev/fuse without keeping its number (%s)", e)
            os.close(self.fd)
            return
        try:
            os.dup2(inert, self.fd, inheritable=False)  # atomic: the number never refers to nothing
        finally:
            os.close(inert)
        weakref.finalize(self, os.close, self.fd).atexit = False  # at exit the process closes it

    def _catch_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def stop(signum: int, frame: Any) -> None:
            log.info("signal %d: unmounting %s", signum, self.mountpoint)
            self.unmount()
            self.stopped.set()

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for s, handler in old.items():
                signal.signal(s, handler)

        return restore

    def _loop(self) -> None:
        buf = bytearray(BUFFER_BYTES)
        view = memoryview(buf)
        fd, handlers, unpack, requests = self.fd, self._handlers, wire.IN_HEADER.unpack_from, self.requests
        ioctl, out_header, enotty = wire.IOCTL, wire.OUT_HEADER.pack, -errno.ENOTTY
        head, init, reply, into = wire.IN_HEADER.size, wire.INIT, self.reply, [buf]  # locals: looked up per request
        writev, out_size, parts, taken = os.writev, wire.OUT_HEADER.size, (list, tuple), self._on_ioctl
        while True:
            try:
                n = os.readv(fd, into)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EAGAIN):  # the request was interrupted before we read it
                    continue
                if e.errno not in (errno.ENODEV, errno.EBADF):  # unmounted; served and let go (_retire_fd)
                    log.error("reading /dev/fuse failed: %s", e)
                break
            _len, opcode, unique, nodeid, _uid, _gid, _pid, _ext, _pad = unpack(buf)
            requests[opcode] += 1
            if opcode == ioctl:  # isatty() of every Python < 3.14 open(): answered as cheaply as can be
                if taken is not None and taken(nodeid, unique):
                    continue  # answered later by whoever took it (never an error but ENOTTY)
                try:
                    os.write(fd, out_header(out_size, enotty, unique))
                except OSError:
                    pass  # interrupted or unmounted: nobody waits for this answer
                continue
            if opcode == init:
                self._init(unique, view[head:n])
                continue
            handler = handlers.get(opcode)
            if handler is None:
                if opcode not in (wire.FORGET, wire.BATCH_FORGET):
                    self.fail(unique, errno.ENOSYS)
                continue
            try:
                out = handler(nodeid, view[head:n], unique)
            except OSError as e:
                self.fail(unique, e.errno or errno.EIO)
                continue
            except Exception:
                log.exception("unexpected error in %s of node %d; answering EIO", wire.OPCODE_NAMES.get(opcode), nodeid)
                self.fail(unique, errno.EIO)
                continue
            if out is DEFERRED or out is NO_REPLY:
                continue
            if isinstance(out, parts):
                reply(unique, out)
                continue
            try:  # one part, the common answer (an entry, a file's bytes): :meth:`reply` without its calls
                writev(fd, [out_header(out_size + len(out), 0, unique), out])
            except OSError as e:
                self._write_failed(e)
        self.stopped.set()

    def _init(self, unique: int, body: memoryview) -> None:
        out = self.init_answer(body)
        if out is None:
            self.fail(unique, errno.EPROTO)
            return
        self.reply(unique, out)
        if self._on_ready is not None:
            threading.Thread(target=self._on_ready, name="blockfs-ready", daemon=True).start()

    def init_answer(self, body: memoryview) -> bytes | None:
        """The answer to the kernel's INIT (``body``: its ``fuse_init_in``): the protocol version both speak
        and the flags ``on_init`` wants that the kernel offers (kept as :attr:`minor` and :attr:`flags`);
        None, logged, when the kernel is too old."""
        major, minor, max_readahead, kernel_flags = wire.INIT_IN.unpack_from(body)
        if major != wire.KERNEL_MAJOR or minor < wire.MIN_MINOR:
            log.error(
                "the kernel speaks FUSE %d.%d; blockfs's kernel path needs 7.%d or later (Linux 5.1+): "
                "mount with --fuse mfusepy",
                major,
                minor,
                wire.MIN_MINOR,
            )
            return None
        self.minor = min(minor, wire.KERNEL_MINOR)
        wanted = self._on_init(self.minor, kernel_flags) if self._on_init else 0
        self.flags = wanted & kernel_flags
        max_pages = 256  # 1 MiB reads
        return wire.INIT_OUT.pack(
            wire.KERNEL_MAJOR, self.minor, max_readahead, self.flags & 0xFFFFFFFF, 64, 48, 1 << 16, 1, max_pages, 0, 0
        )

    # --- answering --------------------------------------------------------------------------------
    def reply(self, unique: int, body: Any) -> None:
        """Answer request ``unique`` with ``body`` (bytes-like, or a list/tuple of them)."""
        if isinstance(body, (list, tuple)):
            size = sum(len(p) for p in body)
            self._write([wire.OUT_HEADER.pack(wire.OUT_HEADER.size + size, 0, unique), *body])
        else:  # the common case, one part: no list built, no sum
            self._write([wire.OUT_HEADER.pack(wire.OUT_HEADER.size + len(body), 0, unique), body])

    def fail(self, unique: int, err: int) -> None:
        self._write([wire.OUT_HEADER.pack(wire.OUT_HEADER.size, -err, unique)])

    def _write(self, parts: list) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            self._write_failed(e)

    @staticmethod
    def _write_failed(e: OSError) -> None:
        # ENOENT: the request was interrupted and is gone; ENODEV/EBADF: unmounted meanwhile.
        if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
            log.warning("answering the kernel failed: %s", e)

    def store(self, nodeid: int, data: Any, offset: int = 0) -> bool:
        """Put ``data`` into ``nodeid``'s page cache at ``offset``, one message per
        :data:`~blockfs.serve.fuse.wire.STORE_PIECE` (a file of any size); False when the kernel does not hold
        that node (it was never looked up, or was forgotten).  Never call it from a reader thread."""
        try:
            for start in range(0, len(data), wire.STORE_PIECE):
                piece = data[start : start + wire.STORE_PIECE]  # a memoryview's slice: no copy
                os.writev(self.fd, [wire.notify_store_header(nodeid, offset + start, len(piece)), piece])
            return True
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                return False
            raise

    def forget_name(self, parent: int, name: bytes) -> None:
        """Drop the name ``name`` in directory ``parent`` from the kernel's caches (quiet if it holds none)."""
        self._notify(wire.notify_inval_entry(parent, name))

    def _notify(self, message: bytes) -> None:
        try:
            os.write(self.fd, message)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                raise
