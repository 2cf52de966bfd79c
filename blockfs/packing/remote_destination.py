"""A pack whose DEST is a URL: blocks are written to a local staging directory and uploaded as each one is
finished, then the index and side files, then ``blockfs.json`` — the commit — last.

Crash safety, as for a local DEST (see :mod:`.destination`), with objects instead of renames:

* Before anything is uploaded, a ``.blockfs-packing`` marker object is put and an existing
  ``blockfs.json`` deleted, in that order: from then on the prefix does not open as a dataset (opening
  says "an unfinished pack"), so old metadata never points at half-replaced blocks.
* ``blockfs.json`` is put only after every block, the index and the side files are uploaded (a PUT is
  atomic: an object is either the whole upload or absent), then the marker is deleted.  A killed pack
  therefore leaves nothing that opens as complete, and a rerun replaces it without ``--force``.
* After the commit, block objects an older, larger pack left beyond ``n_blocks`` are deleted (a pack may
  list the prefix; a mount never does).

Bounded: at most :data:`UPLOADS` uploads run at once (each a multipart upload of ``part_size`` parts) and
at most twice that many finished blocks wait in staging, so local disk holds a few blocks whatever the
dataset's size; a block's staging file is deleted once uploaded.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..core.format import (
    BLOCKS_DIR,
    INDEX_NAME,
    METADATA_NAME,
    PACKING_MARKER,
    block_path,
)
from ..errors import PackError
from ..storage.remote import RemoteError, RemoteStore
from .destination import write_metadata_file

UPLOADS = 4  # blocks uploaded at once
_BLOCK_OBJECT = re.compile(r"^blocks/(\d{8})\.blk$")


def _object_name(block: int) -> str:
    return block_path("", block)  # "blocks/00000000.blk", as in a local dataset


class RemoteDestination:
    """The URL a pack goes to; ``local`` is the staging directory the packer writes into."""

    def __init__(self, url: str, options: dict | None = None, staging_parent: str | None = None) -> None:
        self.remote = RemoteStore(url, options)
        self.display = self.remote.display
        if self.remote.kind == "http":
            self.remote.close()
            raise PackError(f"{self.display}: an HTTP(S) URL is read-only; pack to s3://, gs:// or az://, or to a "
                            "directory a web server serves")  # fmt: skip
        self.staging = self.local = tempfile.mkdtemp(prefix="blockfs-pack-", dir=staging_parent)
        self._uploads = ThreadPoolExecutor(UPLOADS, thread_name_prefix="blockfs-upload")
        self._waiting = threading.BoundedSemaphore(2 * UPLOADS)
        self._futures: list[Future] = []
        self._sizes: dict[int, int] = {}

    def claim(self, src_dir: str | None, force: bool) -> None:
        """Refuse a prefix that would lose data; then mark it as a pack in progress (see the module notes)."""
        try:
            dataset = self.remote.exists(METADATA_NAME)
            ours = self.remote.exists(PACKING_MARKER)
            if dataset and not ours and not force:
                raise PackError(f"destination {self.display} already holds a packed dataset: pass --force to replace it")
            if not dataset and not ours and any(page for page in self.remote.list("")):
                raise PackError(
                    f"destination {self.display} is not empty and holds no blockfs dataset: choose an empty or "
                    "new prefix (--force only replaces an existing blockfs dataset)"
                )
            self.remote.put_bytes(PACKING_MARKER, b"")
            self.remote.delete(METADATA_NAME)
            self.remote.delete(INDEX_NAME)
        except RemoteError as e:
            raise PackError(f"cannot pack to {self.display}: {e}") from None
        os.makedirs(os.path.join(self.staging, BLOCKS_DIR), exist_ok=True)

    def block_written(self, block: int) -> None:
        """Upload a finished block in the background; waits while too many are waiting already.  An
        upload that failed stops the pack here, at the next block, not after every block is written."""
        self._raise_failed(done_only=True)
        path = block_path(self.staging, block)
        self._sizes[block] = os.path.getsize(path)
        self._waiting.acquire()
        future = self._uploads.submit(self._upload_block, block, path)
        future.add_done_callback(lambda _f: self._waiting.release())
        self._futures.append(future)

    def _upload_block(self, block: int, path: str) -> None:
        self.remote.put_file(_object_name(block), path)
        os.unlink(path)

    def blocks_done(self) -> None:
        """Wait for every block's upload; the first failure stops the pack."""
        wait(self._futures)
        self._raise_failed(done_only=False)

    def _raise_failed(self, done_only: bool) -> None:
        for future in self._futures:
            if done_only and not future.done():
                continue
            error = future.exception()
            if error is not None:
                raise PackError(f"cannot upload to {self.display}: {error}") from None

    def block_sizes(self, n_blocks: int) -> list[int]:
        return [self._sizes[b] for b in range(n_blocks)]

    def commit(self, metadata: dict, fsync: bool) -> None:
        """Upload the side files and the index, then ``blockfs.json`` (the commit); drop the marker and the
        blocks an older pack left beyond the new ones."""
        n_blocks = metadata["n_blocks"]
        write_metadata_file(self.staging, metadata, fsync=False)  # staging is thrown away: the PUT is the commit
        try:
            for name in sorted(os.listdir(self.staging)):
                path = os.path.join(self.staging, name)
                if os.path.isfile(path) and name not in (INDEX_NAME, METADATA_NAME):
                    self.remote.put_file(name, path)  # side files (RecordIO's labels.json)
            self.remote.put_file(INDEX_NAME, os.path.join(self.staging, INDEX_NAME))
            self.remote.put_file(METADATA_NAME, os.path.join(self.staging, METADATA_NAME))
            self.remote.delete(PACKING_MARKER)
            for page in self.remote.list(BLOCKS_DIR + "/"):
                for obj in page:
                    m = _BLOCK_OBJECT.match(obj.name)
                    if m and int(m.group(1)) >= n_blocks:
                        self.remote.delete(obj.name)
        except RemoteError as e:
            raise PackError(f"cannot finish the pack at {self.display}: {e}") from None

    def close(self) -> None:
        self._uploads.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.remote.close()
