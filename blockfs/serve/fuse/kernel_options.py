"""``-o`` on the kernel route: which FUSE mount options it applies, which it ignores, which it refuses.

The kernel route mounts without libfuse (:mod:`blockfs.serve.fuse.session`), so of libfuse's ``-o`` options it can
apply only what the kernel's mount takes; those that only tune libfuse itself change nothing here and are
ignored with a log line (an fstab line written for libfuse still mounts); anything else would silently not
do what was asked, and is refused in one line naming it.  The libfuse routes (``--fuse mfusepy``/``fusepy``)
take libfuse's options as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME = 1024

KERNEL_FLAGS = ("allow_other", "default_permissions")  # the kernel's FUSE options without a value
KERNEL_VALUES = ("max_read", "blksize")  # ... and with a number
NAMES = ("fsname", "subtype")  # the mount's source and its type (fuse.SUBTYPE) in the mount table
MOUNT_FLAGS = {"noexec": MS_NOEXEC, "noatime": MS_NOATIME}  # applied (libfuse's routes take them too)
ALWAYS = frozenset({"ro", "nosuid", "nodev", "nodiratime"})  # every blockfs mount is so already (read-only)
# libfuse's own settings: each changes nothing on this route, which already does what they ask or has
# nothing for them to act on (no writes, no locks, its own request loop, the index's inode numbers).
LIBFUSE_ONLY = frozenset(
    {
        "use_ino",
        "readdir_ino",
        "kernel_cache",
        "auto_cache",
        "noauto_cache",
        "big_writes",
        "max_write",
        "writeback_cache",
        "no_writeback_cache",
        "atomic_o_trunc",
        "hard_remove",
        "no_remote_lock",
        "no_remote_posix_lock",
        "no_remote_flock",
        "splice_read",
        "splice_write",
        "splice_move",
        "no_splice_read",
        "no_splice_write",
        "no_splice_move",
        "async_read",
        "sync_read",
        "max_threads",
        "max_idle_threads",
        "clone_fd",
        "nonempty",
        "intr",
        "intr_signal",
        "rw",
        "suid",
        "dev",
        "exec",
        "atime",
        "relatime",
        "strictatime",
        "sync",
        "async",
        "dirsync",
    }
)
# libfuse's options the kernel route refuses (they would need libfuse to act on them): with LIBFUSE_ONLY and the
# rest above, every option a libfuse route takes — what mount.fuse.blockfs lets through to -o.
LIBFUSE_OTHER = frozenset(
    {
        "allow_root",
        "auto_unmount",
        "uid",
        "gid",
        "umask",
        "entry_timeout",
        "negative_timeout",
        "attr_timeout",
        "ac_attr_timeout",
        "noforget",
        "remember",
        "modules",
        "subdir",
        "direct_io",
        "nopath",
        "debug",
        "max_readahead",
        "max_background",
        "congestion_threshold",
        "time_gran",
        "large_read",
        "blkdev",
    }
)
ACCEPTED = (*KERNEL_FLAGS, *(f"{k}=N" for k in KERNEL_VALUES), *(f"{k}=NAME" for k in NAMES), *MOUNT_FLAGS)


class OptionRefused(ValueError):
    """An ``-o`` option the kernel route cannot honour; ``str()`` is one line naming it and the way out."""


@dataclass
class KernelMount:
    """``-o`` as the kernel route mounts with it."""

    flags: set[str] = field(default_factory=set)  # KERNEL_FLAGS given
    values: dict[str, str] = field(default_factory=dict)  # KERNEL_VALUES given
    names: dict[str, str] = field(default_factory=dict)  # fsname / subtype given
    mount_flags: int = 0  # MOUNT_FLAGS given, as mount(2) flags
    ignored: list[str] = field(default_factory=list)  # libfuse's own settings, ignored (to be logged)

    def flag_names(self) -> list[str]:
        """The mount flags as fusermount3 takes them."""
        return sorted(name for name, bit in MOUNT_FLAGS.items() if self.mount_flags & bit)


def parse(options: Iterable[str]) -> KernelMount:
    """``options`` (``name`` or ``name=value`` items) as the kernel route applies them; OptionRefused for
    any it cannot honour (all of them named)."""
    out, refused = KernelMount(), []
    for item in options:
        key, eq, value = item.partition("=")
        if key in KERNEL_FLAGS and not eq:
            out.flags.add(key)
        elif key in KERNEL_VALUES and eq and value.isdigit() and int(value) > 0:
            out.values[key] = value
        elif key in NAMES and eq and value:
            out.names[key] = value
        elif key in MOUNT_FLAGS and not eq:
            out.mount_flags |= MOUNT_FLAGS[key]
        elif key in ALWAYS and not eq:
            pass
        elif key in LIBFUSE_ONLY:
            out.ignored.append(item)
        else:
            refused.append(item)
    if refused:
        raise OptionRefused(
            f"mount option{'s' if len(refused) > 1 else ''} {', '.join(map(repr, refused))} "
            f"{'are not ones' if len(refused) > 1 else 'is not one'} the kernel route takes (it takes {', '.join(ACCEPTED)}; "
            f"libfuse's own settings are ignored): remove {'them' if len(refused) > 1 else 'it'} from -o, or mount "
            "with --fuse mfusepy for libfuse's options"
        )
    return out


def is_fuse_option(key: str) -> bool:
    """Whether ``key`` names a FUSE mount option that some route takes (the kernel's or libfuse's)."""
    return (
        key in KERNEL_FLAGS
        or key in KERNEL_VALUES
        or key in NAMES
        or key in MOUNT_FLAGS
        or key in ALWAYS
        or key in LIBFUSE_ONLY
        or key in LIBFUSE_OTHER
    )
