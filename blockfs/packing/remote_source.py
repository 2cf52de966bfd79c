"""``RemotePrefixSource``: the objects under a URL prefix, packed as a tree (``blockfs pack s3://b/raw/ DEST``).

The prefix is listed once, a page at a time; keys are paths relative to the prefix, and directories are
what the ``/`` in them imply (a key ending in ``/``, a "folder" placeholder, is a directory too).  Each
object is read with ranged GETs by the writer threads, so the number of requests in flight is the number
of writers (:data:`WRITERS` unless ``--workers`` says otherwise) and memory is theirs: a block buffer each.
"""

from __future__ import annotations

import stat
from typing import Iterator

from ..core.index import KIND_DIR, KIND_FILE
from ..errors import SourceError
from ..storage.remote import RemoteError, RemoteStore
from .sources import Source, SourceEntry

WRITERS = 16  # writer threads for a remote source: GETs are latency, not CPU, so more than the cores
FILE_MODE = stat.S_IFREG | 0o644
DIR_MODE = stat.S_IFDIR | 0o755


class RemotePrefixSource(Source):
    forkable = False  # the client's runtime does not survive fork(); threads overlap GETs anyway

    def __init__(self, url: str, options: dict | None = None) -> None:
        self.remote = RemoteStore(url, options)
        self.description = self.remote.display
        self._keys: dict[bytes, str] = {}

    def entries(self) -> Iterator[SourceEntry]:
        files: dict[bytes, SourceEntry] = {}
        dirs: dict[bytes, int] = {b"": 0}
        try:
            for page in self.remote.list(""):
                for obj in page:
                    name = obj.name.strip("/")
                    if not name:
                        continue
                    path = name.encode("utf-8", "surrogateescape")
                    if obj.name.endswith("/"):  # a folder placeholder
                        dirs.setdefault(path, obj.mtime_ns)
                    else:
                        files[path] = SourceEntry(path, KIND_FILE, FILE_MODE, obj.mtime_ns, size=obj.size)
                        self._keys[path] = obj.name
                    parent = path.rpartition(b"/")[0]
                    while parent and parent not in dirs:
                        dirs[parent] = obj.mtime_ns
                        parent = parent.rpartition(b"/")[0]
        except RemoteError as e:
            raise SourceError(f"cannot list {self.description}: {e}") from None
        clash = sorted(set(files) & set(dirs))
        if clash:
            raise SourceError(
                f"{self.description}: {clash[0].decode(errors='replace')!r} is both an object and a folder "
                "(a key and a prefix of other keys): a tree cannot hold both; move one of them"
            )
        if not files:
            raise SourceError(f"{self.description} holds no objects: check the URL (a prefix ending in '/')")
        entries = [SourceEntry(p, KIND_DIR, DIR_MODE, mtime) for p, mtime in dirs.items()]
        entries += files.values()
        entries.sort(key=lambda e: e.path)  # a parent sorts before its children
        yield from entries

    def read_into(self, entry: SourceEntry, buf: memoryview, offset: int = 0) -> int:
        length = min(len(buf), entry.size - offset)
        if length <= 0:
            return 0
        self.remote.get_into(self._keys[entry.path], offset, buf[:length])
        return length
