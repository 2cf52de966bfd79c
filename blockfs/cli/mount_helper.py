"""``mount.fuse.blockfs``: what mount(8) runs for ``mount -t fuse.blockfs DATASET MNT -o OPTIONS`` and for
an ``/etc/fstab`` line of type ``fuse.blockfs``.

mount(8) looks for its helper in /sbin only, so a pip-installed helper is linked there once::

    sudo ln -s "$(command -v mount.fuse.blockfs)" /sbin/mount.fuse.blockfs

It calls ``mount.fuse.blockfs DATASET MNT [-n] [-s] [-f] [-v] [-o OPTIONS]``.  The options are mount's
own (``ro``, ``_netdev``, ``nofail``, ``x-systemd.*``: ignored here, mount and systemd act on them),
``blockfs mount``'s long options written with underscores (``cache_size=32GiB``, ``disk_cache=/var/cache/x``,
``allow_other``, ``no_prefill``), ``storage.KEY=VALUE`` for ``--storage-option KEY=VALUE``, and FUSE mount
options (``fsname=``, ``max_read=``, ``noexec``...), which go to ``blockfs mount -o`` (what each route takes
of them: :mod:`blockfs.serve.fuse.kernel_options`).  Any other key is refused in one line, so the helper never
exits 0 without mounting (``-o help`` used to print ``blockfs mount``'s help and say it had mounted); the
dataset and the mount point are given after ``--``, so neither can be taken for an option.  The mount then
runs in the background, as mount(8) expects.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from ..serve.fuse.kernel_options import is_fuse_option
from ..storage.credentials import WHERE_FROM, is_credential
from .mount_flags import not_in_fstab

__all__ = ["blockfs_argv", "main"]

# mount(8)'s and systemd's options, which they act on themselves; blockfs is read-only whatever is asked.
MOUNT_OWN = frozenset(
    {
        "ro",
        "rw",
        "defaults",
        "auto",
        "noauto",
        "user",
        "nouser",
        "users",
        "owner",
        "group",
        "_netdev",
        "nofail",
        "dev",
        "nodev",
        "suid",
        "nosuid",
        "exec",
        "sync",
        "async",
        "atime",
        "relatime",
        "norelatime",
        "strictatime",
        "nodiratime",
        "diratime",
        "lazytime",
        "nolazytime",
        "silent",
        "loud",
    }
)  # not noexec, noatime: the FUSE mount applies them (they go to -o)
MOUNT_OWN_PREFIXES = ("x-", "comment=", "context=", "fscontext=", "defcontext=", "rootcontext=")


def _mount_options() -> dict[str, bool]:
    """``blockfs mount``'s long options: name (with underscores) -> whether it takes a value."""
    from . import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    mount = commands.choices["mount"]  # argparse keeps the subcommands' parsers there
    options = {}
    for action in mount._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue  # not a mount option: "help" in fstab must never print usage and exit 0
        for flag in action.option_strings:
            if flag.startswith("--") and action.help != argparse.SUPPRESS:
                options[flag[2:].replace("-", "_")] = action.nargs != 0
    return options


def _refuse_credential(name: str, dataset: str) -> ValueError:
    """The refusal of ``storage.KEY`` carrying a credential, saying where the credential goes instead."""
    from ..storage.remote import KIND_NAMES
    from ..storage.urls import is_remote, store_kind

    kinds = [store_kind(dataset)] if is_remote(dataset) and store_kind(dataset) in WHERE_FROM else list(WHERE_FROM)
    where = "; ".join(f"{KIND_NAMES[k]}: {WHERE_FROM[k]}" for k in kinds)
    return ValueError(f"option {name!r} is a credential, and fstab is readable by every user: {where}")


def blockfs_argv(dataset: str, mountpoint: str, options: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """``blockfs``'s command line for mount(8)'s ``DATASET MNT -o a,b=c`` (``options``: the ``-o`` values;
    ``extra``: more options).  The dataset and the mount point come after ``--``: a dataset named ``--help``
    or ``-o`` is a path, never an option."""
    known, refused = _mount_options(), {"foreground"} | not_in_fstab()  # not_in_fstab: "o" (-o)
    argv, fuse = ["mount"], []
    for item in (i.strip() for opt in options for i in opt.split(",")):
        if not item or item in MOUNT_OWN or item.startswith(MOUNT_OWN_PREFIXES):
            continue
        name, eq, value = item.partition("=")
        if name.startswith("storage."):
            key = name[len("storage.") :]
            if is_credential(key):
                raise _refuse_credential(name, dataset)
            argv += ["--storage-option", f"{key}={value}"]
        elif name in refused:
            raise ValueError(f"option {name!r} cannot be given in fstab: mount(8) needs the mount in the background")
        elif name in known:
            if known[name] != bool(eq):
                form = f"{name}=VALUE" if known[name] else name
                raise ValueError(f"option {item!r}: write it as {form}")
            argv.append(f"--{name.replace('_', '-')}" + (f"={value}" if eq else ""))  # a value is never an option
        elif is_fuse_option(name):
            fuse.append(item)  # the route mounting it applies, ignores or refuses it (one line each)
        else:
            raise ValueError(
                f"option {item!r} is not a mount option of blockfs's: see 'blockfs mount --help' for "
                "blockfs's own (written with underscores) and -o for the FUSE ones"
            )
    return [*argv, *(["-o", ",".join(fuse)] if fuse else []), *extra, "--", dataset, mountpoint]


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
    p = argparse.ArgumentParser(
        prog="mount.fuse.blockfs",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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

    given = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if len(given) < 2 or given[0] in ("-h", "--help") and len(given) == 1:
        args = parser.parse_args(given)  # run by hand: its help, or what is missing
    else:
        # mount(8) gives DATASET MNT first, then its options: whatever they are named ("--help", "-o"),
        # those two are paths, never options.
        rest = given[2:]
        for i in range(len(rest) - 1):
            if rest[i] == "-o":  # "-o X" as "-oX": an options field "--help" is that field, never a flag
                rest[i : i + 2] = ["-o" + rest[i + 1], ""]
        args = parser.parse_args([*filter(None, rest), "--", *given[:2]])
    try:
        command = blockfs_argv(args.dataset, args.mountpoint, args.o, ["-v"] if args.v else ["-q"])
    except ValueError as e:
        print(f"mount.fuse.blockfs: error: {e}", file=sys.stderr)
        return 2
    if args.f:
        print("mount.fuse.blockfs: would run: blockfs " + " ".join(command))
        return 0
    return blockfs_main(command, wording=in_fstab_words)


if __name__ == "__main__":
    sys.exit(main())
