"""One place to add a mount option: every ``MountOptions`` field is declared in ``serve/mount_options.py``, and
``blockfs mount`` and ``mount.fuse.blockfs -o`` reach each with the declared type and value (parametrized
over the fields themselves, so a new field is covered, or fails, without editing this file)."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from blockfs.cli import build_parser, mount_flags
from blockfs.cli.mount_commands import _budget, _mount_options
from blockfs.cli.mount_helper import blockfs_argv
from blockfs.core.location import StorageOptions
from blockfs.serve import mount_options as options
from blockfs.serve.mount_options import CLI, Flag, FromFlags, MountOptions, NoFlag, size_or_auto

FIELDS = dataclasses.fields(MountOptions)
REACHABLE = [f for f in FIELDS if not isinstance(f.metadata.get(CLI), NoFlag)]
CONTEXT = ["--nodes", "8"]  # so that the node rank a sample picks is one of the nodes
CONVERTED = {size_or_auto: ("3MiB", 3 << 20)}  # a sample text for each `convert` a Flag may declare
# FromFlags fields: (blockfs mount's options, mount.fuse.blockfs's -o items, the value they give)
WORKED_OUT = {
    "cache_bytes": (["--cache-size", "3MiB"], ["cache_size=3MiB"], 3 << 20),
    "storage": (
        ["--storage-option", "region=eu", "--disk-cache", "/nonexistent/tier", "--disk-cache-size", "1GiB"],
        ["storage.region=eu", "disk_cache=/nonexistent/tier", "disk_cache_size=1GiB"],
        StorageOptions({"region": "eu"}, "/nonexistent/tier", 1 << 30, None, remove_fetched=False),
    ),
}


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _sample(field: dataclasses.Field, cli: Flag) -> tuple[list[str], list[str], object]:
    """A value for a Flag field: (blockfs mount's tokens, mount.fuse.blockfs's -o items, the field's value)."""
    key = _key(cli.flag)
    if isinstance(field.default, bool):
        return [cli.flag], [key], not field.default
    if cli.repeat:
        return [cli.flag, "max_read=4096", cli.flag, "noatime"], [], ("max_read=4096", "noatime")
    if cli.choices:
        text = value = next(c for c in cli.choices if c != field.default)
    elif cli.convert is not None:
        assert cli.convert in CONVERTED, f"{field.name}: add a sample text for {cli.convert.__name__} to CONVERTED"
        text, value = CONVERTED[cli.convert]
    elif cli.type in (int, float):
        value = cli.type(field.default + 3)
        text = str(value)
    elif cli.type is None:
        text = value = f"blake3:{'ab' * 32}" if field.name == "expect" else f"given-{field.name}"
    else:
        raise AssertionError(f"{field.name}: no sample for type {cli.type}: add one to _sample")
    return [cli.flag, text], [f"{key}={text}"], value


def _runtime_types(hint) -> tuple[type, ...]:
    """The classes ``isinstance`` checks for a field's annotation (``int | str | None``, ``tuple[str, ...]``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _runtime_types(arg))
    return (typing.get_origin(hint) or hint,)


def _options_from(argv: list[str]) -> MountOptions:
    """What ``blockfs ARGV --foreground`` serves with: the parser, the budget, and ``_serve_here``'s options."""
    args = build_parser().parse_args(argv)
    return _mount_options(args, _budget(args)[0])


def _check(field: dataclasses.Field, got: MountOptions, expected: object) -> None:
    value = getattr(got, field.name)
    assert value == expected and type(value) is type(expected), f"{field.name}: {value!r}, not {expected!r}"
    # StorageOptions is imported for type checking only (the mount command imports no NumPy): named here.
    hint = typing.get_type_hints(MountOptions, localns={"StorageOptions": StorageOptions})[field.name]
    assert isinstance(value, _runtime_types(hint)), f"{field.name}: {value!r} is no {hint}"


def test_every_field_declares_its_command_line():
    undeclared = [f.name for f in FIELDS if not isinstance(f.metadata.get(CLI), (Flag, FromFlags, NoFlag))]
    assert not undeclared, f"MountOptions fields without a Flag, FromFlags or NoFlag: {undeclared}"
    worked_out = [f.metadata[CLI] for f in FIELDS if isinstance(f.metadata.get(CLI), FromFlags)]
    assert sorted(WORKED_OUT) == sorted(f.name for f in FIELDS if isinstance(f.metadata.get(CLI), FromFlags))
    mount = build_parser()._subparsers._group_actions[0].choices["mount"]  # argparse keeps them there
    assert {flag for cli in worked_out for flag in cli.flags} <= set(mount._option_string_actions)


@pytest.mark.parametrize("field", REACHABLE, ids=lambda f: f.name)
def test_blockfs_mount_reaches_the_field(field):
    cli = field.metadata.get(CLI)
    assert isinstance(cli, (Flag, FromFlags)), f"{field.name} declares no command line"
    tokens, _, expected = WORKED_OUT[field.name] if isinstance(cli, FromFlags) else _sample(field, cli)
    _check(field, _options_from(["mount", "/d", "/m", *CONTEXT, *tokens]), expected)
    if isinstance(cli, Flag) and field.name != "nodes":  # not given: the field's default
        assert getattr(_options_from(["mount", "/d", "/m", *CONTEXT]), field.name) == field.default


@pytest.mark.parametrize("field", REACHABLE, ids=lambda f: f.name)
def test_mount_fuse_blockfs_reaches_the_field(field):
    cli = field.metadata.get(CLI)
    assert isinstance(cli, (Flag, FromFlags)), f"{field.name} declares no command line"
    if isinstance(cli, Flag) and not cli.fstab:
        with pytest.raises(ValueError, match="cannot be given in fstab"):
            blockfs_argv("/d", "/m", [f"{_key(cli.flag)}=x"])
        return
    _, items, expected = WORKED_OUT[field.name] if isinstance(cli, FromFlags) else _sample(field, cli)
    argv = blockfs_argv("/d", "/m", [",".join(["ro", "nodes=8", *items])])
    _check(field, _options_from(argv), expected)


def test_fstab_items_that_are_fuse_mount_options_go_to_dash_o():
    argv = blockfs_argv("/d", "/m", ["noatime,max_read=4096,allow_other,fsname=x,relatime"])
    assert _options_from(argv).fuse_options == ("noatime,max_read=4096,fsname=x",)


def test_plan_takes_the_memory_and_nodes_flags():
    args = build_parser().parse_args(["plan", "/d", "--no-retain", "--retain-threshold", "auto", "--nodes", "2"])
    assert (args.retain, mount_flags.flag_value(args, "retain_threshold"), args.nodes) == (False, "auto", 2)


def _with_field(monkeypatch, name: str, cli: Flag | None, default: object) -> type:
    """MountOptions with one more field (declared by ``cli``, or undeclared), as the cli and helper see it."""
    meta = {CLI: cli} if cli is not None else {}
    cls = dataclasses.make_dataclass(
        "MountOptions",
        [(name, type(default), dataclasses.field(default=default, metadata=meta))],
        bases=(MountOptions,),
        frozen=True,
    )
    monkeypatch.setattr(options, "MountOptions", cls)
    monkeypatch.setattr(mount_flags, "MountOptions", cls)
    return cls


def test_a_new_declared_field_needs_nothing_else(monkeypatch):
    _with_field(monkeypatch, "sample_blocks", Flag("--sample-blocks", type=int, section="tuning", help="x"), 4)
    assert _options_from(["mount", "/d", "/m", "--sample-blocks", "9"]).sample_blocks == 9
    assert _options_from(blockfs_argv("/d", "/m", ["sample_blocks=7"])).sample_blocks == 7
    assert _options_from(["mount", "/d", "/m"]).sample_blocks == 4


def test_a_field_without_a_declaration_is_refused(monkeypatch):
    _with_field(monkeypatch, "undeclared", None, 0)
    with pytest.raises(TypeError, match="MountOptions.undeclared declares no command line"):
        build_parser()
    with pytest.raises(TypeError, match="MountOptions.undeclared declares no command line"):
        options.declarations()


def test_a_flag_outside_the_sections_is_refused():
    with pytest.raises(ValueError, match="section 'extras' is not one of"):
        Flag("--x", help="x", section="extras")
