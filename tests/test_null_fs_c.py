"""tools/bench/helpers/null_fs.py --fuse c: the compiled no-work server (null_fs_c.c) that bench_lookup_read.py
reads beside null_fs.py's kernel route.  It must show the source tree as that route does (names, sizes, modes
less the write bits) and answer reads with zeros of the file's length, or the benchmark's row compares
different work; and its mount must never outlive it, whichever of its two processes goes first."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import release
from polling import wait_until

from blockfs.serve.daemon import is_mounted, wait_until_mounted

pytestmark = [pytest.mark.fuse, pytest.mark.any_route]  # a kernel-protocol server of its own: no other route

HELPERS = Path(__file__).resolve().parent.parent / "tools" / "bench" / "helpers"
sys.path.insert(0, str(HELPERS))
import null_fs  # noqa: E402


def need_capabilities() -> None:
    require(has_fuse(), "/dev/fuse")
    require(null_fs.compiler() is not None, "a C compiler (cc, gcc or $CC) to build null_fs_c.c")


def small_tree(root: Path) -> dict[str, tuple[int, int]]:
    """A tree with the shapes a listing and a read can get wrong: sizes around a page and over one read
    (1 MiB), an empty file and directory, odd names, a directory of 1,500 entries (~300 KB of READDIRPLUS
    records: several replies even where the kernel asks for 128 KiB at a time, each resumed at its offset).
    Returns relative path -> (size, mode)."""
    sizes = {"empty": 0, "one": 1, "page": 4096, "page+1": 4097, "a/b/deep": 5000, "big": (3 << 19) + 7}
    sizes.update({f"many/f{i:04d}-{'x' * (i % 40)}": i * 3 for i in range(1500)})
    sizes["a/naïve name with spaces"] = 123
    (root / "a" / "empty dir").mkdir(parents=True)
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    os.chmod(root / "one", 0o755)
    os.chmod(root / "page", 0o600)
    return {
        os.path.relpath(os.path.join(d, n), root): (
            os.lstat(os.path.join(d, n)).st_size,
            os.lstat(os.path.join(d, n)).st_mode,
        )
        for d, dirs, files in os.walk(root)
        for n in dirs + files
    }


def start(src: Path, mnt: Path, *args: str) -> subprocess.Popen:
    mnt.mkdir()
    log = open(mnt.parent / "null_fs_c.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "null_fs.py"), str(src), str(mnt), "--fuse", "c", *args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    try:
        wait_until_mounted(mnt, proc, 120, str(mnt.parent / "null_fs_c.log"))
    except BaseException:
        release(mnt, proc)
        raise
    return proc


def server_pid(proc: subprocess.Popen) -> int:
    """The C program's pid: the supervisor's one child."""
    path = f"/proc/{proc.pid}/task/{proc.pid}/children"
    wait_until(lambda: Path(path).read_text().split(), "null_fs.py to start the C server")
    return int(Path(path).read_text().split()[0])


# FUSE over io_uring flips the machine-wide enable_uring switch around its INIT: alone, after the parallel step.
URING = pytest.param("2 uring", marks=pytest.mark.serial)


@pytest.mark.parametrize("threads", ["1", "3 clone", URING])
def test_the_compiled_no_work_server_shows_the_tree_and_reads_zeros_on_the_kernel_protocol(tmp_path, threads):
    need_capabilities()
    n, *how = threads.split()
    if how == ["uring"]:
        require(
            os.geteuid() == 0 and os.path.exists(null_fs.URING_PARAMETER),
            "FUSE over io_uring (Linux 6.14+, and root to switch it on)",
        )
    src, mnt, counts = tmp_path / "src", tmp_path / "mnt", tmp_path / "counts.json"
    src.mkdir()
    want = small_tree(src)
    proc = start(src, mnt, "--threads", n, "--counts", str(counts), *(f"--{h}" for h in how))
    try:
        for d, dirs, files in os.walk(src):
            rel = os.path.relpath(d, src)
            assert sorted(os.listdir(mnt / rel)) == sorted(dirs + files), rel
        got = {
            os.path.relpath(os.path.join(d, n), mnt): os.lstat(os.path.join(d, n))
            for d, dirs, files in os.walk(mnt)
            for n in dirs + files
        }
        assert sorted(got) == sorted(want)
        for rel, (size, mode) in want.items():
            st = got[rel]
            assert (st.st_mode, st.st_size) == (mode & ~0o222, size), rel
            if stat.S_ISREG(mode):
                with open(mnt / rel, "rb") as f:  # open(): CPython's isatty ioctl is answered too
                    assert not f.isatty()
                    data = f.read()
                assert len(data) == size and data == bytes(size), rel
                with open(mnt / rel, "rb", buffering=0) as f:
                    f.seek(max(0, size - 3))
                    assert f.read(10) == bytes(min(3, size)), rel
        with pytest.raises(FileNotFoundError):
            os.lstat(mnt / "a" / "not there")
        assert os.statvfs(mnt).f_files == len(want) + 1
        os.kill(proc.pid, signal.SIGUSR1)  # passed on to the C program, which writes what it was sent
        wait_until(counts.exists, "the request counts")
        sent = json.loads(counts.read_text())
        read = sum(1 for size, mode in want.values() if size and stat.S_ISREG(mode))
        # 5 directories: one reply each and an empty one at the end, and more for "many"; the listing's entries
        # need no LOOKUP, the unknown name does
        assert sent["readdirplus"] > 2 * 5 and sent["lookup"] >= 1 and sent["read"] >= read
        if how == ["uring"]:  # the reads at least came over the ring (a stat at the start may beat its set-up)
            assert sent["via_ring"] >= sent["read"]
    finally:
        release(mnt, proc)
    assert not is_mounted(mnt)


@pytest.mark.parametrize("who", ["supervisor SIGTERM", "server SIGKILL"])
def test_the_compiled_servers_kernel_protocol_mount_goes_with_either_of_its_processes(tmp_path, who):
    need_capabilities()
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    (src / "f").write_bytes(b"12345")
    proc = start(src, mnt, "--threads", "2")
    try:
        server = server_pid(proc)
        assert (mnt / "f").read_bytes() == bytes(5)
        if who == "supervisor SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(server, signal.SIGKILL)
        assert proc.wait(30) == 0
        assert not is_mounted(mnt)
        wait_until(lambda: not Path(f"/proc/{server}").exists(), "the C server to exit")
    finally:
        release(mnt, proc)


def test_without_a_compiler_the_c_route_says_so_in_one_line(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    done = subprocess.run(
        [sys.executable, str(HELPERS / "null_fs.py"), str(src), str(mnt), "--fuse", "c"],
        env={**os.environ, "PATH": str(tmp_path / "nothing"), "CC": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and not is_mounted(mnt)
    assert done.stderr.strip().splitlines() == [
        "null_fs.py --fuse c: no C compiler found (cc, gcc or $CC): install one (apt-get install gcc)"
    ]
