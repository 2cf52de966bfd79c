"""The process's limit on open descriptors, lifted once by whichever part holds many of them.

A local store keeps one descriptor per block file it reads (:mod:`blockfs.storage.blockfiles`), and a
mount that shares its cached blocks one memfd per shared block (:mod:`blockfs.serve.server`): both lift
the soft limit (often 1024) to the hard one (often 1M) through :func:`raise_open_files_limit`.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_files_limit() -> None:
    """Lift this process's soft limit on open descriptors to its hard limit; keep it where that fails
    (``EMFILE`` is then met by closing idle descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)
