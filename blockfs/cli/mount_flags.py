"""``MountOptions``' flags, made from their declarations in :mod:`blockfs.serve.mount_options`: the parser's
arguments (:func:`add_flags`) and the parsed command line as ``MountOptions`` (:func:`mount_options`).

Each flag's value lands in ``args`` under its field's name (``--no-prefill`` sets ``args.prefill``), so
nothing is retyped between the parser and ``MountOptions``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..serve.mount_options import Flag, FromFlags, MountOptions, declarations

__all__ = ["add_flags", "flag_value", "mount_options", "not_in_fstab"]


def _flags(section: str | None = None) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, cli) for f, cli in declarations() if isinstance(cli, Flag) and section in (None, cli.section)]


def add_flags(container: argparse._ActionsContainer, section: str) -> None:
    """Add the flags of one section (``serve.options.SECTIONS``) to a parser or group, in field order."""
    for field, cli in _flags(section):
        kwargs: dict[str, Any] = {"dest": field.name, "help": cli.help}
        if isinstance(field.default, bool):  # the flag sets the opposite of the default
            kwargs["action"] = "store_false" if field.default else "store_true"
        else:
            kwargs["default"] = None if cli.repeat else field.default
            kwargs["action"] = "append" if cli.repeat else "store"
            if cli.type is not None:
                kwargs["type"] = cli.type
            if cli.choices is not None:
                kwargs["choices"] = cli.choices  # shown as {a,b,c}
            else:
                kwargs["metavar"] = cli.metavar or cli.flag.lstrip("-").replace("-", "_").upper()
        container.add_argument(cli.flag, **kwargs)


def flag_value(args: argparse.Namespace, name: str) -> Any:
    """The field ``name``'s value from a parsed command line (a size converted, repeats as a tuple)."""
    cli = dict((f.name, c) for f, c in _flags())[name]
    value = getattr(args, name)
    if cli.repeat:
        return tuple(value or ())
    if cli.convert is not None and isinstance(value, str):  # the text given (argparse's defaults are typed)
        return cli.convert(value)
    return value


def mount_options(args: argparse.Namespace, **given: Any) -> MountOptions:
    """The parsed ``mount`` command line as ``MountOptions``.  ``given``: the fields the command works out
    from options of its own (each :class:`~blockfs.serve.mount_options.FromFlags` field: the budget, storage)."""
    missing = [f.name for f, cli in declarations() if isinstance(cli, FromFlags) and f.name not in given]
    if missing:
        raise TypeError(f"mount_options() needs {', '.join(missing)}: the command works them out from its options")
    return MountOptions(**{f.name: flag_value(args, f.name) for f, _ in _flags()}, **given)


def not_in_fstab() -> set[str]:
    """The ``-o`` keys ``mount.fuse.blockfs`` refuses: flags declared ``fstab=False``, dashes as underscores."""
    return {cli.flag.lstrip("-").replace("-", "_") for _, cli in _flags() if not cli.fstab}
