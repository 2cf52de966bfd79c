"""The command line: each command's output and every refusal's message and exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from blockfs.cli import main


@pytest.fixture
def packed(tmp_path, edge_tree):
    assert main(["pack", os.fsdecode(edge_tree), str(tmp_path / "p"), "--block-size", "4KiB"]) == 0
    return tmp_path / "p"


def test_pack_info_verify_ls_cat_unpack(tmp_path, edge_tree, packed, capsys):
    capsys.readouterr()
    assert main(["info", str(packed)]) == 0
    out = capsys.readouterr().out
    assert "files        11 " in out and "class_a" in out
    assert main(["info", str(packed), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["files"] == 11 and info["symlinks"] == 3 and info["labels"]["class_b"] == 6
    assert main(["verify", str(packed)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main(["ls", str(packed), "class_b"]) == 0
    listing = capsys.readouterr().out
    assert "-rw-------" in listing and "-leading-dash" in listing
    assert main(["ls", str(packed)]) == 0
    assert "link_to_dir -> class_b/deep" in capsys.readouterr().out
    assert main(["unpack", str(packed), str(tmp_path / "out")]) == 0
    assert (
        subprocess.run(["diff", "-r", "--no-dereference", os.fsdecode(edge_tree), str(tmp_path / "out")]).returncode
        == 0
    )


def test_cat_writes_exact_bytes(packed, edge_tree):
    out = subprocess.run(
        [sys.executable, "-m", "blockfs", "cat", str(packed), "class_a/big.bin"], capture_output=True, check=True
    ).stdout
    assert out == open(os.path.join(edge_tree, b"class_a/big.bin"), "rb").read()


def test_verify_names_the_bad_block_and_its_files(packed, capsys):
    from blockfs import open_dataset

    with open_dataset(packed) as ds:
        block = ds.stat("class_a/big.bin").block
        victims = {os.fsdecode(p) for p in ds.files_in_block(block)}
        path = ds.store.block_paths[block]
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"XXXXX")
    capsys.readouterr()
    assert main(["verify", str(packed)]) == 1
    out = capsys.readouterr().out
    assert f"BAD block {block}" in out and "data checksum mismatch" in out
    assert all(v in out for v in victims)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pack", "{tmp}/missing", "{tmp}/p"], "does not exist"),
        (["pack", "{src}", "{src}/inside"], "inside the source"),
        (["pack", "{src}", "{packed}"], "--force"),
        (["pack", "{src}", "{tmp}/q", "--block-size", "lots"], "lots"),
        (["info", "{tmp}"], "not a packed dataset"),
        (["cat", "{packed}", "no/such/file"], "no such file"),
        (["unpack", "{packed}", "{src}"], "not an empty directory"),
    ],
)
def test_refusals_exit_2_with_a_one_line_reason(tmp_path, edge_tree, packed, capsys, argv, message):
    fill = {"tmp": str(tmp_path), "src": os.fsdecode(edge_tree), "packed": str(packed)}
    capsys.readouterr()
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_help_describes_the_program_and_lists_every_command(capsys):
    from blockfs.cli import build_parser

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    description, commands = out.split("\ncommands:\n")
    assert "FUSE" in description and "blockfs pack" in description and "blockfs mount" in description
    assert "module" not in description  # a user's description, not the developer docstring
    names = build_parser()._subparsers._group_actions[0].choices
    assert {"pack", "mount", "umount", "stats", "verify"} <= set(names)
    listed = {line.split()[0] for line in commands.splitlines() if line.startswith("    ") and line.split()}
    assert set(names) <= listed


def test_every_command_prints_its_help(capsys):
    from blockfs.cli import build_parser

    for name in build_parser()._subparsers._group_actions[0].choices:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0, name
        assert f"usage: blockfs {name}" in capsys.readouterr().out


def test_logging_options_go_before_or_after_the_command(tmp_path, edge_tree, capsys):
    dest = tmp_path / "p"
    assert main(["pack", os.fsdecode(edge_tree), str(dest), "-q", "--no-fsync"]) == 0
    assert capsys.readouterr().out == ""  # -q after the command: no summary
    assert main(["-v", "info", str(dest)]) == 0 and main(["info", str(dest), "--log-level", "warning"]) == 0
    from blockfs.cli import build_parser

    args = build_parser().parse_args(["-v", "info", str(dest)])
    assert args.verbose is True  # given before the command, kept
    args = build_parser().parse_args(["info", str(dest), "--log-level", "debug"])
    assert args.log_level == "debug" and args.verbose is False


def test_stats_lines_say_what_their_numbers_are():
    from blockfs.cli.mount_commands import _epochs_line, _shared_note

    line = _epochs_line(
        [{"files": 79, "hit_rate": 0.0}, {"files": 79, "hit_rate": 0.5}, {"files": 10, "hit_rate": 0.6}], 79
    )
    assert line.endswith("per pass over the 79 files: #1 0.0%, #2 50.0%, #3 60.0% (so far: 10 files)")
    assert _epochs_line([{"files": 0, "hit_rate": 0.0}], 79).endswith("no file read yet")
    many = [{"files": 79, "hit_rate": 1.0}] * 10
    assert _epochs_line(many, 79).split(": ", 1)[1].startswith("#5 100.0%")  # the last six, numbered as read
    assert "skip FUSE and are not counted here" in _shared_note(3) and _shared_note(0) == ""


# `blockfs mount` starts a server that imports NumPy anyway; importing it (and the packer) first in the
# command's own process too cost the mount's return time a second import (issue 30).
_MOUNT_UP_TO_THE_SERVER = """
import sys
from blockfs.cli import main
from blockfs.serve import daemon as process

def start_background(command, *args, **kwargs):
    heavy = sorted(m for m in ("numpy", "blockfs.core.dataset", "blockfs.packing.packer") if m in sys.modules)
    print("heavy:", ",".join(heavy) or "none")
    return 1

process.start_background = start_background
sys.exit(main(["mount", sys.argv[1], sys.argv[2], "-q"]))
"""


def test_mount_command_starts_its_server_without_numpy(tmp_path):
    """A local dataset is opened by the server alone, so the command that starts it need not import NumPy."""
    (tmp_path / "mnt").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _MOUNT_UP_TO_THE_SERVER, str(tmp_path / "ds"), str(tmp_path / "mnt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "heavy: none"


def test_pack_options_block_limit_is_the_formats():
    from blockfs.core import format as fmt
    from blockfs.packing.options import MAX_BLOCK_SIZE

    assert MAX_BLOCK_SIZE == fmt.NARROW_LIMIT
