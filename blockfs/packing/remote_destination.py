"""``RemoteDestination``: a pack into an object store (``blockfs pack SRC s3://bucket/prefix``).

The packer writes into a local staging directory exactly as into a local DEST; each block is uploaded
as soon as its writer has finished it and its staging copy deleted, so the local disk holds only the
blocks being written and the few waiting for an upload slot, whatever the dataset's size.

The objects have the names of a local dataset's files under the URL's prefix (``blocks/00000000.blk``,
``index.bfi``, ``blockfs.json``), and a pack keeps the rule of a local one: ``blockfs.json`` is the
commit.  In order:

1. **Claim.**  Refuse a prefix that holds other objects but no dataset, and (without ``--force``) one
   that holds a complete dataset.  Then put the marker ``.blockfs-packing``, and only then delete the
   old ``blockfs.json`` (and ``index.bfi``).  Marker first: killed between the two steps, the prefix
   still holds the old dataset whole, and the marker lets a rerun through without ``--force``; the
   other order would leave blocks and no metadata, which a rerun refuses as "not a dataset".
2. **Blocks**, uploaded as they are written; a block object is replaced whole by its PUT (no store
   shows half an object).  No ``blockfs.json`` exists from step 1 on, so nothing opens the prefix as a
   dataset while old and new blocks are mixed.
3. **Side files** a source wrote (RecordIO's ``labels.json``), then the **index**, then
   **``blockfs.json``**: the commit, uploaded only once everything it names is in place.
4. **Tidy**: delete the marker, then the block objects an older, larger pack left beyond the new last
   block.  The index names only the new blocks, so a crash before this step leaves unused objects, not
   a wrong dataset; the next pack to the prefix deletes them.

A pack lists the prefix (to refuse a non-empty one, and in step 4); opening a dataset never does.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ..core.format import (
    BLOCKS_DIR,
    INDEX_NAME,
    METADATA_NAME,
    PACKING_MARKER,
    block_path,
)
from ..errors import PackError
from ..storage.owned import DIR_FLAGS
from ..storage.remote import (
    BucketNotFoundError,
    CredentialsRefusedError,
    EndpointUnreachableError,
    RemoteError,
    RemoteStore,
)
from ..storage.urls import is_remote, redact, store_kind
from .destination import Destination, open_blocks_dir, write_metadata_file

log = logging.getLogger(__name__)

UPLOADS = 4  # blocks uploaded at once (each in parts of part_size: at most min(block, 16 parts) in memory)
WAITING = 4  # finished blocks that may wait on the staging disk for an upload slot
_BLOCK_OBJECT = re.compile(r"^" + re.escape(BLOCKS_DIR) + r"/(\d{8})\.blk$")


class RemoteDestination(Destination):
    """The URL a pack goes to; ``directory`` is the local staging directory the writers write into."""

    fsync = False  # the staging copies are thrown away: a finished upload is what lasts

    def __init__(self, url: str, options: dict | None = None, staging: str | None = None) -> None:
        if store_kind(url) == "http":
            raise PackError(
                f"cannot pack to {redact(url)}: an HTTP(S) URL is read-only; pack to s3://, gs:// or az://, "
                "or to a local directory"
            )
        self.remote = RemoteStore(url, options)
        self.display = self.remote.display
        if staging is not None:
            os.makedirs(staging, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="blockfs-pack-", dir=staging)
        self._uploads = ThreadPoolExecutor(UPLOADS, thread_name_prefix="blockfs-upload")
        self._slots = threading.BoundedSemaphore(UPLOADS + WAITING)
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._failure: BaseException | None = None
        self._sizes: dict[int, int] = {}

    def claim(self, source_location: str | None, force: bool) -> None:
        if source_location is not None and is_remote(source_location) and _inside(self.remote.url, source_location):
            raise PackError(
                f"destination {self.display} is inside the source {redact(source_location)}: choose a prefix outside it"
            )
        try:
            pages = self.remote.list("")
            try:
                anything = bool(next(pages, []))
            finally:
                pages.close()
            dataset = self.remote.exists(METADATA_NAME)
            ours = self.remote.exists(PACKING_MARKER)
        except (CredentialsRefusedError, BucketNotFoundError, EndpointUnreachableError) as e:
            raise PackError(f"cannot pack to {self.display}: {e}") from None  # the message names the fix
        except RemoteError as e:
            raise PackError(
                f"cannot pack to {self.display}: {e} (does the bucket exist, and may these credentials list it?)"
            ) from None
        if anything and not dataset and not ours:
            raise PackError(
                f"destination {self.display} is not empty and holds no blockfs dataset: choose an empty or new "
                "prefix (--force only replaces an existing blockfs dataset)"
            )
        if dataset and not ours and not force:
            raise PackError(f"destination {self.display} already holds a packed dataset: pass --force to replace it")
        try:
            self.remote.put_bytes(PACKING_MARKER, b"")  # first: see step 1 in the module's notes
            self.remote.delete(METADATA_NAME)
            self.remote.delete(INDEX_NAME)
        except RemoteError as e:
            raise PackError(f"cannot pack to {self.display}: {e}") from None
        self.dir_fd = os.open(self.directory, DIR_FLAGS)
        os.mkdir(BLOCKS_DIR, 0o700, dir_fd=self.dir_fd)
        self.blocks_fd = open_blocks_dir(self.dir_fd)

    def block_written(self, block: int) -> None:
        """Queue the block's upload; wait while every slot is taken (the staging disk stays small), and
        stop the pack at once if an upload has failed."""
        self._raise_failure()
        path = block_path(self.directory, block)
        self._sizes[block] = os.path.getsize(path)
        self._slots.acquire()
        future = self._uploads.submit(self._upload, block_path("", block), path)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._uploaded)

    def _upload(self, name: str, path: str) -> None:
        self.remote.put_file(name, path)
        os.unlink(path)

    def _uploaded(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
            if not future.cancelled() and future.exception() is not None and self._failure is None:
                self._failure = future.exception()
        self._slots.release()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise PackError(f"cannot pack to {self.display}: {self._failure}") from None

    def blocks_done(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)
        self._raise_failure()

    def block_sizes(self, n_blocks: int) -> np.ndarray:
        return np.array([self._sizes[b] for b in range(n_blocks)], dtype=np.uint64)

    def commit(self, metadata: dict) -> None:
        write_metadata_file(self.dir_fd, metadata, fsync=False)
        side_files = [
            name
            for name in sorted(os.listdir(self.directory))
            if name not in (INDEX_NAME, METADATA_NAME) and os.path.isfile(os.path.join(self.directory, name))
        ]
        try:
            for name in [*side_files, INDEX_NAME, METADATA_NAME]:  # blockfs.json last: the commit
                self.remote.put_file(name, os.path.join(self.directory, name))
        except RemoteError as e:
            raise PackError(f"cannot pack to {self.display}: {e}") from None
        try:
            self.remote.delete(PACKING_MARKER)
            self._delete_blocks_from(metadata["n_blocks"])
        except RemoteError as e:  # the dataset is complete: what is left over is unused, not wrong
            log.warning(
                "packed %s, but could not tidy up after the pack (%s); the next pack there will", self.display, e
            )

    def _delete_blocks_from(self, n_blocks: int) -> None:
        """Delete the block objects numbered ``n_blocks`` and up (left by an older, larger pack)."""
        stale = [
            info.name
            for page in self.remote.list(BLOCKS_DIR + "/")
            for info in page
            if (m := _BLOCK_OBJECT.match(info.name)) and int(m.group(1)) >= n_blocks
        ]
        list(self._uploads.map(self.remote.delete, stale))

    def close(self) -> None:
        self._uploads.shutdown(wait=True, cancel_futures=True)
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.remote.close()


def _inside(dest_url: str, src_url: str) -> bool:
    """Whether the prefix ``dest_url`` is ``src_url`` or lies under it (same store and bucket)."""

    def parts(url: str) -> tuple[str, str]:
        return store_kind(url), redact(url).partition("://")[2].strip("/")

    (dest_kind, dest), (src_kind, src) = parts(dest_url), parts(src_url)
    return dest_kind == src_kind and (dest == src or dest.startswith(src + "/"))
