"""``RemotePrefixSource``: the objects under a URL prefix, packed as the tree their keys describe
(``blockfs pack s3://bucket/raw/train/ DEST``).

**Listing.**  The prefix is listed once, a page at a time.  A key's path relative to the prefix is the
file's path; the directories are the ones the ``/`` in keys imply, and folder placeholders (keys ending
in ``/``, which consoles create for empty folders).  The client drops a key's trailing ``/`` when it
lists, so a placeholder ``a/`` comes back as ``a`` with no bytes: every zero-byte object, and every name
that other keys lie under, is asked for by name (HEAD), and only a real object answers.  A name that is
both an object and a folder is refused: a tree cannot hold both.  Files get mode 0644 and their object's
last-modified time; directories 0755 and the newest time of the objects under them.

**Reading.**  The packer reads the files of a block in order, a few blocks at once, so one GET at a
time per writer would leave each writer waiting out a round trip per object.  While the blocks are
written (:meth:`RemotePrefixSource.reading`), a read-ahead fetches the small objects in the order the
writers will want them: at most :data:`READ_AHEAD_REQUESTS` GETs in flight and
:data:`READ_AHEAD_BYTES` held, fetched or in flight.  A writer that asks for an object the read-ahead
has not reached fetches it itself and the read-ahead skips it, so no writer ever waits on the budget.
Objects larger than :data:`READ_AHEAD_LARGEST` are read when asked, in parallel ranged parts.
A small object is fetched whole, so one whose size changed since the listing is caught.
"""

from __future__ import annotations

import errno
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from ..core.index import KIND_DIR, KIND_FILE
from ..errors import SourceError
from ..storage.remote import ObjectInfo, RemoteError, RemoteStore
from .sources import Source, SourceChangedError, SourceEntry

READ_AHEAD_REQUESTS = 32  # GETs in flight ahead of the writers (small objects: latency, not bandwidth)
READ_AHEAD_BYTES = 256 << 20  # bytes fetched ahead and not yet taken by a writer, at most
READ_AHEAD_LARGEST = 8 << 20  # larger objects are read when asked, in ranged parts
HEADS = 32  # HEAD requests in flight while the listing is resolved
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


class RemotePrefixSource(Source):
    """The objects under ``url`` as a tree.  Read by writer threads: the client does not survive a fork."""

    def __init__(
        self,
        url: str,
        options: dict | None = None,
        *,
        read_ahead_bytes: int = READ_AHEAD_BYTES,
        read_ahead_requests: int = READ_AHEAD_REQUESTS,
    ) -> None:
        self.remote = RemoteStore(url, options)
        self.url = url
        self.description = self.remote.display + "/"
        self._read_ahead_bytes = read_ahead_bytes
        self._read_ahead_requests = read_ahead_requests
        self._entries: list[SourceEntry] | None = None
        self._ahead: _ReadAhead | None = None

    # --- listing -----------------------------------------------------------------------------------------
    def entries(self) -> Iterator[SourceEntry]:
        if self._entries is None:
            self._entries = self._load()
        return iter(self._entries)

    def _load(self) -> list[SourceEntry]:
        listed: dict[str, list[ObjectInfo]] = {}
        try:
            for page in self.remote.list(""):
                for info in page:
                    listed.setdefault(info.name, []).append(info)
        except RemoteError as e:
            raise SourceError(f"cannot list {self.description}: {e}") from None
        if not listed:
            raise SourceError(f"{self.description} holds no objects: check the URL, and that it names a prefix")
        dir_mtimes = _implied_dirs(listed)
        files: list[SourceEntry] = []
        for name, kind in self._resolve(listed, dir_mtimes):
            mtime = max(info.mtime_ns for info in listed[name])
            if kind == KIND_DIR:
                dir_mtimes[name] = max(dir_mtimes.get(name, 0), mtime)
            else:
                files.append(SourceEntry(name.encode(), KIND_FILE, FILE_MODE, mtime, listed[name][0].size))
        dirs = [SourceEntry(name.encode(), KIND_DIR, DIR_MODE, mtime) for name, mtime in dir_mtimes.items()]
        return sorted(dirs + files, key=lambda e: e.path.split(b"/") if e.path else [])  # the root first

    def _resolve(self, listed: dict[str, list[ObjectInfo]], dirs: dict[str, int]) -> Iterator[tuple[str, int]]:
        """Each listed name with what it is: a file or a folder (placeholder)."""
        unsure = [n for n, infos in listed.items() if n and (n in dirs or len(infos) > 1 or infos[0].size == 0)]
        with ThreadPoolExecutor(HEADS, thread_name_prefix="blockfs-head") as pool:
            try:
                real = dict(zip(unsure, pool.map(self.remote.exists, unsure), strict=True))
            except RemoteError as e:
                raise SourceError(f"cannot list {self.description}: {e}") from None
        for name, infos in listed.items():
            if not name:
                yield name, KIND_DIR  # a placeholder of the prefix itself: the root
            elif name not in real:
                yield name, KIND_FILE
            elif not real[name]:
                yield name, KIND_DIR  # a placeholder "name/": no object answers to "name"
            elif name in dirs or len(infos) > 1:
                raise SourceError(
                    f"{self.remote.where(name)} is both an object and a folder (other keys lie under "
                    f"{name + '/'!r}): a tree cannot hold both; rename or move one of them"
                )
            else:
                yield name, KIND_FILE  # an empty file

    # --- reading -----------------------------------------------------------------------------------------
    @contextmanager
    def reading(self, order: Sequence[SourceEntry]) -> Iterator[None]:
        ahead = _ReadAhead(self._fetch_whole, order, self._read_ahead_bytes, self._read_ahead_requests)
        self._ahead = ahead
        try:
            yield
        finally:
            self._ahead = None
            ahead.stop()

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        length = max(0, min(len(buf), entry.size - offset))
        if length == 0:
            return 0
        if entry.size > READ_AHEAD_LARGEST:
            try:
                self.remote.get_into(entry.path.decode(), offset, buf[:length])
            except RemoteError as e:
                raise self._unreadable(entry, e) from None
            return length
        ahead = self._ahead
        future = ahead.take(entry) if ahead is not None else None
        if ahead is None or future is None:
            data = self._fetch_whole(entry)
        else:
            try:
                data = future.result()
            finally:
                ahead.taken(entry)
        buf[:length] = data[offset : offset + length]
        return length

    def _fetch_whole(self, entry: SourceEntry) -> bytes:
        try:
            data = self.remote.get(entry.path.decode())
        except RemoteError as e:
            raise self._unreadable(entry, e) from None
        if len(data) != entry.size:
            raise SourceChangedError(
                f"{self.remote.where(entry.path.decode())} changed while packing ({len(data)} bytes, listed with "
                f"{entry.size}); pack a prefix that is not being written to (or pass --skip-unreadable)"
            )
        return data

    def _unreadable(self, entry: SourceEntry, e: RemoteError) -> OSError:
        """``e``, said plainly where a listed object with bytes has no object of its name: the client lists
        a key ``name/`` (a folder placeholder) as ``name``, and a placeholder that holds bytes is no file."""
        if e.errno != errno.ENOENT or entry.size == 0:
            return e
        name = entry.path.decode()
        return SourceChangedError(
            f"{self.remote.where(name)}/ is a key ending in '/' that holds {entry.size} bytes (or {name!r} was "
            "deleted since the listing): a folder placeholder cannot be a file; rename the key without its '/' "
            "or delete it, or pass --skip-unreadable to leave it out"
        )

    def close(self) -> None:
        self.remote.close()


def _implied_dirs(listed: dict[str, list[ObjectInfo]]) -> dict[str, int]:
    """Every directory the names imply (the root ``""`` included), with the newest mtime under it."""
    dirs: dict[str, int] = {"": 0}
    for name, infos in listed.items():
        mtime = max(info.mtime_ns for info in infos)
        parent = name
        while parent:
            parent = parent.rpartition("/")[0]
            if dirs.get(parent, -1) >= mtime:
                break  # this directory and every one above it know of a time as new already
            dirs[parent] = mtime
    return dirs


class _ReadAhead:
    """Small objects fetched in the order the writers will ask for them (see the module's notes)."""

    def __init__(
        self, fetch: Callable[[SourceEntry], bytes], order: Sequence[SourceEntry], budget: int, requests: int
    ) -> None:
        self._fetch = fetch
        self._budget = budget
        self._cond = threading.Condition()
        self._held = 0  # bytes fetched or in flight, not yet taken
        self._ready: dict[bytes, Future] = {}
        self._asked: set[bytes] = set()  # asked for before the read-ahead reached them: skipped
        self._stopped = False
        self._pool = ThreadPoolExecutor(requests, thread_name_prefix="blockfs-readahead")
        self._thread = threading.Thread(target=self._run, args=(order,), name="blockfs-readahead", daemon=True)
        self._thread.start()

    def _run(self, order: Sequence[SourceEntry]) -> None:
        for entry in order:
            if not 0 < entry.size <= READ_AHEAD_LARGEST:
                continue  # nothing to fetch, or read when asked
            with self._cond:
                while self._held and self._held + entry.size > self._budget and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                if entry.path in self._asked:
                    self._asked.discard(entry.path)
                    continue
                self._held += entry.size
                self._ready[entry.path] = self._pool.submit(self._fetch, entry)

    def take(self, entry: SourceEntry) -> Future | None:
        """The fetch of ``entry`` (call :meth:`taken` once its bytes are copied), or None: read it yourself."""
        with self._cond:
            future = self._ready.pop(entry.path, None)
            if future is None:
                self._asked.add(entry.path)
            return future

    def taken(self, entry: SourceEntry) -> None:
        with self._cond:
            self._held -= entry.size
            self._cond.notify_all()

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def stop(self) -> None:
        """Stop fetching and drop what was fetched and not taken (a failed pack stops before the end)."""
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._thread.join()
