"""``mount.fuse.blockfs``: what mount(8) runs for ``mount -t fuse.blockfs DATASET MNT -o OPTIONS`` and for
an ``/etc/fstab`` line of type ``fuse.blockfs``.

mount(8) looks for its helper in /sbin only, so a pip-installed helper is linked there once::

    sudo ln -s "$(command -v mount.fuse.blockfs)" /sbin/mount.fuse.blockfs

It calls ``mount.fuse.blockfs DATASET MNT [-n] [-s] [-f] [-v] [-o OPTIONS]``.  The options are mount's
own (``ro``, ``_netdev``, ``nofail``, ``x-systemd.*``: ignored here, mount and systemd act on them),
``blockfs mount``'s long options written with underscores (``cache_size=32GiB``, ``disk_cache=/var/cache/x``,
``allow_other``, ``no_prefill``), ``storage.KEY=VALUE`` for ``--storage-option KEY=VALUE``, and anything
else, which goes to libfuse as ``-o``.  The mount then runs in the background, as mount(8) expects.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from ..storage.credentials import WHERE_FROM, is_credential
from .mount_flags import not_in_fstab

__all__ = ["blockfs_argv", "main"]

# mount(8)'s and systemd's options, which they act on themselves; blockfs is read-only whatever is asked.
MOUNT_OWN = frozenset({
    "ro", "rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "_netdev", "nofail",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "sync", "async", "atime", "noatime", "relatime",
    "norelatime", "strictatime", "nodiratime", "diratime", "lazytime", "nolazytime", "silent", "loud",
})  # fmt: skip
MOUNT_OWN_PREFIXES = ("x-", "comment=", "context=", "fscontext=", "defcontext=", "rootcontext=")


def _mount_options() -> dict[str, bool]:
    """``blockfs mount``'s long options: name (with underscores) -> whether it takes a value."""
    from . import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    mount = commands.choices["mount"]  # argparse keeps the subcommands' parsers there
    options = {}
    for action in mount._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and action.help != argparse.SUPPRESS:
                options[flag[2:].replace("-", "_")] = action.nargs != 0
    return options


def _refuse_credential(name: str, dataset: str) -> ValueError:
    """The refusal of ``storage.KEY`` carrying a credential, saying where the credential goes instead."""
    from ..storage.location import is_remote, store_kind
    from ..storage.remote import KIND_NAMES

    kinds = [store_kind(dataset)] if is_remote(dataset) and store_kind(dataset) in WHERE_FROM else list(WHERE_FROM)
    where = "; ".join(f"{KIND_NAMES[k]}: {WHERE_FROM[k]}" for k in kinds)
    return ValueError(f"option {name!r} is a credential, and fstab is readable by every user: {where}")


def blockfs_argv(dataset: str, mountpoint: str, options: Sequence[str]) -> list[str]:
    """``blockfs``'s command line for mount(8)'s ``DATASET MNT -o a,b=c`` (``options``: the ``-o`` values)."""
    known, refused = _mount_options(), {"foreground"} | not_in_fstab()  # not_in_fstab: "o" (-o)
    argv, fuse = ["mount", dataset, mountpoint], []
    for item in (i.strip() for opt in options for i in opt.split(",")):
        if not item or item in MOUNT_OWN or item.startswith(MOUNT_OWN_PREFIXES):
            continue
        name, eq, value = item.partition("=")
        if name.startswith("storage."):
            key = name[len("storage."):]
            if is_credential(key):
                raise _refuse_credential(name, dataset)
            argv += ["--storage-option", f"{key}={value}"]
        elif name in refused:
            raise ValueError(f"option {name!r} cannot be given in fstab: mount(8) needs the mount in the background")
        elif name in known:
            if known[name] != bool(eq):
                form = f"{name}=VALUE" if known[name] else name
                raise ValueError(f"option {item!r}: write it as {form}")
            argv += [f"--{name.replace('_', '-')}"] + ([value] if eq else [])
        else:
            fuse.append(item)  # libfuse's (max_read=, ...): it names any it does not know
    return argv + (["-o", ",".join(fuse)] if fuse else [])


_FLAG = re.compile(r"--storage-option (\w+)=|--([a-z][a-z-]+)")


def in_fstab_words(text: str) -> str:
    """An error's or a warning's fix in the spelling of the fstab line it came from: ``--storage-option
    anon=true`` is ``storage.anon=true``, ``--cache-size`` is ``cache_size=``; and where it names a
    credential, that fstab (readable by every user) holds none."""
    known = _mount_options()

    def fstab(m: re.Match) -> str:
        if m.group(1):
            return f"storage.{m.group(1)}="
        name = m.group(2).replace("-", "_")
        return name + ("=" if known[name] else "") if name in known else m.group(0)

    said = _FLAG.sub(fstab, text)
    if said != text and any(is_credential(key) for key in re.findall(r"(\w+)=\.\.\.", said)):
        said += " (in fstab, credentials only through mount's environment, a profile or an instance role)"
    return said


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mount.fuse.blockfs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("dataset", help="the packed dataset (a directory or a URL)")
    p.add_argument("mountpoint")
    p.add_argument("-o", action="append", default=[], metavar="OPTIONS", help="comma-separated options")
    p.add_argument("-n", action="store_true", help="(mount's: do not write /etc/mtab; ignored)")
    p.add_argument("-s", action="store_true", help="(mount's: sloppy; ignored)")
    p.add_argument("-f", action="store_true", help="(mount's: fake: do everything but mount)")
    p.add_argument("-v", action="store_true", help="verbose")
    p.add_argument("-t", help="(the type, fuse.blockfs; ignored)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run as mount(8)'s helper; return the exit status (0 mounted, 2 error)."""
    from . import main as blockfs_main

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        command = blockfs_argv(args.dataset, args.mountpoint, args.o)
    except ValueError as e:
        print(f"mount.fuse.blockfs: error: {e}", file=sys.stderr)
        return 2
    if args.f:
        print("mount.fuse.blockfs: would run: blockfs " + " ".join(command))
        return 0
    return blockfs_main(command + (["-v"] if args.v else ["-q"]), wording=in_fstab_words)


if __name__ == "__main__":
    sys.exit(main())
