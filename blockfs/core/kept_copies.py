"""Index copies kept for the next mount: a copy already made, hashed and found to be the index
``blockfs.json`` names is given a name, so a re-mount of the same index maps it instead of copying and
hashing 1.5 GB again (ten million files).

A copy is kept (:func:`keep`) once its BLAKE3 digest is the one ``blockfs.json`` records, in the copy
directory of :mod:`.index_copy` (this user's alone: :func:`blockfs.storage.owned.open_owned_dir`): on a
thread of its own, so the mount does not wait (it serves from its map of the copy meanwhile), the unnamed
file is synced (``fdatasync``), then linked under its digest in :data:`SUBDIR`, blockfs's own directory
there (``linkat`` of ``/proc/self/fd/N``), mode 0400, its modification time set to the epoch, and beside it
a record of the file's identity taken once it is complete and named::

    <digest>      the copy: the index's bytes, whose BLAKE3 digest is <digest>
    <digest>.id   "blockfs kept index copy", <digest>, the boot it was made in, and the copy's
                  st_dev st_ino st_size st_mtime_ns st_ctime_ns

Named only once synced: a write-back that failed (EIO, a full thin-provisioned disk) leaves pages that read
back as other bytes once the kernel drops them, and a crash could leave a name over pages that never
reached the disk; a copy whose sync fails is not kept.  Naming and recording (and a finder's check and
removal) hold the directory's lock (``flock``), so two mounts keeping the same index at once leave the
first one's copy, valid, and a finder never takes a copy named but not yet recorded for a stale one.

A later mount of the same digest (:func:`find`) opens ``<digest>`` relative to the directory's descriptor
(``O_NOFOLLOW``: never a link) and uses it only if it is a regular file of this user, mode 0400, one link,
and its identity now is the record's exactly, in the same boot.  A write or a truncation sets the file's
modification time to now, which is not the epoch however coarse the clock; a chmod changes its mode or its
ctime (which no user can set back); a replacement its inode; a hard link its link count; a reboot the
boot: then the copy is removed, and the index copied and hashed again.  The boot stays part of the
identity: a copy is believed only in the boot that made it (the record itself is not synced).

What the name newly exposes (the threat model, in :mod:`.index_copy`): the copy can now be opened by path
while it is kept, by whoever may open files in this user's directory: this user and root.  Mode 0400
refuses a writer but root, or this user after a chmod; such a write reaches the map of every live mount of
that copy (page cache is shared: served unchecked, or SIGBUS after a truncation), and is detected by the
next mount, which copies again.  This user and root can equally change blockfs's own code or trace the
server; the record defends against accidents and other users, not against them.

Kept at most :data:`KEPT` copies and :data:`KEPT_BYTES` bytes together, the least recently used removed
first (a use touches the record, never the copy: that would change its ctime); a live mount whose copy is
removed keeps its map of the unlinked file.  ``BLOCKFS_KEPT_INDEX_COPIES=0`` keeps none.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator

from ..storage.owned import read_regular_at, unlink_quietly_at, write_file_at

log = logging.getLogger(__name__)

KEPT_ENV = "BLOCKFS_KEPT_INDEX_COPIES"  # how many copies are kept for re-mounts; "0" keeps none
KEPT = 4  # copies kept at most: the least recently used go first
KEPT_BYTES = 8 << 30  # and at most this many bytes of them together (a 10 M-file index is ~1.5 GB)
RECORD = ".id"  # the record of a copy's identity: its name and this
# Where the copies are kept: a directory blockfs makes in the copy directory, so that what it removes there
# (copies without a record, the least recently used) can only be its own, whatever else the directory the
# user chose holds (``$BLOCKFS_INDEX_COPY_DIR``: a file named by a SHA-256 is 64 hex digits too).
SUBDIR = "kept"
_HEAD = b"blockfs kept index copy\n"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def kept_count() -> int:
    """``$BLOCKFS_KEPT_INDEX_COPIES`` (a count, 0 for none), else :data:`KEPT`; a value that is no count is
    named in a warning and the default kept."""
    text = os.environ.get(KEPT_ENV)
    if text is None or text.strip() == "":
        return KEPT
    try:
        count = int(text)
        if count < 0:
            raise ValueError(text)
    except ValueError:
        log.warning("%s=%r is not a count of copies: keeping %d (set it to 0 to keep none)", KEPT_ENV, text, KEPT)
        return KEPT
    return count


def is_digest(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def boot_id() -> bytes | None:
    """This boot's id (the kernel's), or None where it cannot be read (then nothing is kept)."""
    try:
        with open(_BOOT_ID, "rb") as f:
            return f.read(64).strip() or None
    except OSError:
        return None


def _record(digest: str, boot: bytes, st: os.stat_result) -> bytes:
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return _HEAD + f"{digest}\n".encode() + b"boot " + boot + b"\n" + " ".join(map(str, identity)).encode() + b"\n"


def _as_kept(st: os.stat_result) -> bool:
    """A regular file of this user's, mode 0400, with one name: what :func:`keep` leaves."""
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and stat.S_IMODE(st.st_mode) == 0o400
        and st.st_nlink == 1
        and st.st_size > 0
    )


def find(dir_fd: int, digest: str) -> int | None:
    """A read-only descriptor of the kept copy of the index whose digest is ``digest`` (hex) in ``dir_fd``,
    if there is one and it is as its record says; None otherwise (a copy that is not is removed)."""
    if not is_digest(digest):
        return None
    with _locked(dir_fd):  # not while a keeper has named a copy and not yet recorded it
        fd = _checked(dir_fd, digest)
    if fd is not None:
        _used(dir_fd, digest)
    return fd


def _checked(dir_fd: int, digest: str) -> int | None:
    """:func:`find` under the directory's lock: a descriptor of the copy if it is as its record says, else
    None (and a copy that is not is removed)."""
    try:
        fd = os.open(digest, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link (O_NOFOLLOW: ELOOP), or not ours to read
        _remove(dir_fd, digest, e.strerror or str(e))
        return None
    try:
        st = os.fstat(fd)
        boot = boot_id()
        record = read_regular_at(dir_fd, digest + RECORD)
        if not _as_kept(st) or boot is None or record != _record(digest, boot, st):
            _remove(dir_fd, digest, "changed since it was kept" if record else "no record of it")
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _used(dir_fd: int, digest: str) -> None:
    """The copy of ``digest`` was used now: its record's modification time, set from the fine clock (the
    file times' coarse clock ties uses in one tick), orders the copies for removal.  Never the copy's own
    times: its ctime would move."""
    now = time.time_ns()
    try:
        os.utime(digest + RECORD, ns=(now, now), dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        pass


def _remove(dir_fd: int, digest: str, why: str) -> None:
    log.info("removing the kept index copy %s: %s (the index is copied again)", digest, why)
    unlink_quietly_at(dir_fd, [digest, digest + RECORD])


def keep(
    dir_fd: int, copy: int, digest: str, kept: int = KEPT, kept_bytes: int = KEPT_BYTES
) -> threading.Thread | None:
    """Keep the complete copy ``copy`` (an unnamed file of ``dir_fd``, made without ``O_EXCL``, mode 0400,
    whose digest is ``digest``) for the next mount, on a thread of its own so the caller does not wait for
    its write-back: there the copy is synced (``fdatasync``), then, under the directory's lock, named
    ``digest`` in ``dir_fd`` with its identity recorded, and at most ``kept`` copies and ``kept_bytes`` bytes
    kept.  A valid copy of ``digest`` already there (another mount's) stays, and this one goes unnamed.  The
    caller may close both descriptors at once (the thread holds its own) and uses its map of the copy
    meanwhile.  The thread, or None where nothing is to be kept; :func:`wait_kept` waits for every one."""
    size = os.fstat(copy).st_size
    boot = boot_id()
    if not is_digest(digest) or kept <= 0 or size > kept_bytes or boot is None:
        return None
    fds = [os.dup(dir_fd)]
    try:
        fds.append(os.dup(copy))
    except BaseException:
        os.close(fds[0])
        raise
    thread = threading.Thread(
        target=_sync_and_name, args=(*fds, digest, boot, kept, kept_bytes), name=f"blockfs-keep-{digest[:8]}"
    )  # not a daemon: a process that ends at once (a pack's seed, a failed mount) still keeps its copy
    with _keeping_lock:
        _keeping.add(thread)
    try:
        thread.start()
    except BaseException:
        with _keeping_lock:
            _keeping.discard(thread)
        for fd in fds:
            os.close(fd)
        raise
    return thread


_keeping: set[threading.Thread] = set()  # keeps under way (:func:`wait_kept`)
# A mount's keeps start their write-back once it serves (:func:`defer_syncs`): writing back a 10 M-file index
# costs ~0.7 s of CPU, which lengthened the mount's start-up by ~0.45 s on two cores.  At most SYNC_WAIT_S.
_may_sync = threading.Event()
_may_sync.set()
SYNC_WAIT_S = 30.0
_keeping_lock = threading.Lock()
_sync = os.fdatasync  # the copy's write-back, before it is named (a test holds it)


def defer_syncs() -> None:
    """Keeps started from now wait for :func:`allow_syncs` (a mount's, until it serves) before their
    write-back, :data:`SYNC_WAIT_S` at most."""
    _may_sync.clear()


def allow_syncs() -> None:
    _may_sync.set()


def wait_kept() -> None:
    """Return once every copy :func:`keep` was given in this process is kept, or found not to be (its
    write-back let start: the caller waits for it)."""
    allow_syncs()
    with _keeping_lock:
        threads = list(_keeping)
    for thread in threads:
        thread.join()


def _sync_and_name(dir_fd: int, copy: int, digest: str, boot: bytes, kept: int, kept_bytes: int) -> None:
    """:func:`keep`'s thread: the copy synced, then named and recorded; both descriptors closed at the end."""
    try:
        _may_sync.wait(SYNC_WAIT_S)
        # Named only once its bytes are on the disk: a write-back that failed (EIO, a full thin-provisioned
        # disk) leaves pages that read back as other bytes once reclaimed, and a crash a name over them.
        _sync(copy)
        with _locked(dir_fd):
            _name(dir_fd, copy, digest, boot, kept, kept_bytes)
    except OSError as e:
        log.warning("the index copy is not kept for the next mount: %s", e.strerror or e)
    finally:
        os.close(copy)
        os.close(dir_fd)
        with _keeping_lock:
            _keeping.discard(threading.current_thread())


def _name(dir_fd: int, copy: int, digest: str, boot: bytes, kept: int, kept_bytes: int) -> None:
    """Under :func:`_locked`: name the synced ``copy`` ``digest`` and record it, unless a valid copy of that
    digest is there already."""
    there = _checked(dir_fd, digest)  # a stale one is removed
    if there is not None:  # kept by another mount of the index just now: that one stays
        os.close(there)
        return
    unlink_quietly_at(dir_fd, [digest + RECORD])  # a record without its copy
    try:
        # The modification time set to the epoch: a later write or truncation moves it to now, however coarse
        # the clock (a write in the same tick as the link could leave the ctime as recorded).
        os.utime(copy, ns=(0, 0))
        os.link(f"/proc/self/fd/{copy}", digest, dst_dir_fd=dir_fd, follow_symlinks=True)
    except OSError as e:  # no /proc, or a filesystem without hard links
        log.info("the index copy is not kept for the next mount: %s", e.strerror or e)
        return
    try:
        # Taken after the name was made (linking changes the ctime): what a later mount must find.
        write_file_at(dir_fd, digest + RECORD, (_record(digest, boot, os.fstat(copy)),), sync=False)
        _used(dir_fd, digest)
        _keep_newest(dir_fd, kept, kept_bytes)
    except OSError:  # a full disk: no record, so the copy is never used; removed
        unlink_quietly_at(dir_fd, [digest, digest + RECORD])
        raise


@contextlib.contextmanager
def _locked(dir_fd: int) -> Iterator[None]:
    """The directory ``dir_fd`` locked (``flock``) against every other finder and keeper, in this process
    too: each takes the lock through its own open of the directory (one shared open would share the lock).
    Held while a copy is named and recorded, or checked and removed: never across a sync or a copy."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # the lock goes with the last descriptor of this open


def _keep_newest(dir_fd: int, kept: int, kept_bytes: int) -> None:
    """Remove all but the ``kept`` most recently used copies that fit in ``kept_bytes`` together, and every
    copy without a record or record without a copy."""
    names = set(os.listdir(dir_fd))
    aged = []
    for name in names:
        if is_digest(name) and name + RECORD not in names:
            unlink_quietly_at(dir_fd, [name])
        elif name.endswith(RECORD) and is_digest(digest := name[: -len(RECORD)]):
            try:
                used = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
                size = os.stat(digest, dir_fd=dir_fd, follow_symlinks=False).st_size
            except OSError:  # a record without its copy
                unlink_quietly_at(dir_fd, [name])
                continue
            aged.append((used, digest, size))
    total = count = 0
    for _when, digest, size in sorted(aged, reverse=True):
        if count < kept and total + size <= kept_bytes:
            count, total = count + 1, total + size
        else:
            unlink_quietly_at(dir_fd, [digest, digest + RECORD])
