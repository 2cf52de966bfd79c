"""``blockfs ls ds DIR | head -1`` and ``blockfs cat ... | head -c 100``: a reader that stops early is not
an error (issue 17 #13): no "Broken pipe" message, no traceback, exit status 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blockfs.packing.packer import pack

PIPE_CAPACITY = 1 << 16  # Linux's default; the output must outgrow it so the writer meets the closed end


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipes")
    (root / "src" / "class0").mkdir(parents=True)
    for i in range(1500):  # an `ls` line of ~90 bytes each: twice the pipe's capacity
        (root / "src" / "class0" / f"a_rather_long_file_name_so_the_listing_outgrows_a_pipe_{i:05d}.bin").write_bytes(
            b"x"
        )
    (root / "src" / "big.bin").write_bytes(os.urandom(4 * PIPE_CAPACITY))
    pack(root / "src", root / "ds", fsync=False, workers=1)
    return root / "ds"


@pytest.mark.parametrize("command", [["ls", "class0"], ["cat", "big.bin"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(big, command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockfs", command[0], str(big), *command[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert len(proc.stdout.read(100)) == 100  # like `head -c 100`, then the reader goes away
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert err == b""


def test_the_whole_listing_still_reaches_a_reader_that_reads_it_all(big):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "blockfs", "ls", str(big), "class0"], capture_output=True, env=env, check=True
    ).stdout
    assert out.count(b"\n") == 1500 and out.endswith(b"01499.bin\n")
