"""Every failure a user meets on the first day is one line naming the thing and the fix (issue 24).

Each test makes the mistake for real where the machine allows (a bad ``-o``, a URL of an unknown scheme, an
S3 bucket without credentials, a server that ignores ``Range``, a killed server) and checks the one line.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import mounted, plain_unmount, release
from polling import wait_until

import blockfs
from blockfs.cli import main
from blockfs.serve.fuse.libfuse_messages import distill

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def packed(tmp_path) -> Path:
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.txt").write_bytes(b"a" * 100)
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    return tmp_path / "p"


def needs_obstore() -> None:
    import importlib.util

    require(importlib.util.find_spec("obstore") is not None, "obstore (Python >= 3.11, pip install -e '.[test]')")


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# --- libfuse ------------------------------------------------------------------------------------------
@pytest.mark.fuse
@pytest.mark.parametrize(
    "route, says",
    [
        ("kernel", "mount option 'no_such_opt' is not one the kernel route takes"),
        ("mfusepy", "libfuse does not know the option 'no_such_opt'"),
    ],
)
def test_a_bad_fuse_option_is_one_line_and_the_plan_is_printed_once(packed, tmp_path, route, says):
    require(has_fuse(), "/dev/fuse")
    (tmp_path / "mnt").mkdir()
    command = [
        sys.executable,
        "-m",
        "blockfs",
        "mount",
        str(packed),
        str(tmp_path / "mnt"),
        "-o",
        "no_such_opt",
        "--log",
        str(tmp_path / "log"),
        "--fuse",
        route,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1, done.stderr
        assert says in done.stderr and "remove it" in done.stderr
        assert done.stdout.count("memory budget:") == 1 and done.stdout.count("memory plan:") == 1, done.stdout
    finally:
        release(tmp_path / "mnt")


def test_libfuse_and_fusermount_messages_become_the_cause_and_the_fix():
    # Their own words (libfuse 3.14, fusermount3), as they reach a serving process's stderr; the test
    # below meets one of them for real, whichever this machine gives a user.
    assert "modprobe fuse" in distill("fuse: device not found, try 'modprobe fuse' first\n")
    assert "--device /dev/fuse" in distill("fusermount3: failed to open /dev/fuse: Permission denied\n")
    said = "fusermount3: option allow_other only allowed if 'user_allow_other' is set in /etc/fuse.conf\n"
    assert "add it as root" in distill(said) and "/etc/fuse.conf" in distill(said)
    assert "CAP_SYS_ADMIN" in distill("fusermount3: mount failed: Operation not permitted\n")
    assert distill("fuse: something new\n") == "fuse: something new"  # unknown: libfuse's line, verbatim
    assert distill("unrelated noise\n") is None


@pytest.mark.fuse
def test_a_user_without_dev_fuse_or_user_allow_other_gets_one_line(packed):
    """Mount as the user nobody with --allow-other, in a forked child (this interpreter's files may not be
    readable by nobody, so nothing is imported after the fork).  What libfuse refuses depends on the
    machine: /dev/fuse closed to other users (crw-------), or allow_other without user_allow_other in
    /etc/fuse.conf; where it allows both, the mount must work."""
    import shutil
    import stat
    import tempfile

    from polling import wait_until

    import blockfs.cli.mount_commands  # noqa: F401  (everything the child runs, imported before the fork)
    import blockfs.serve.fuse.libfuse_adapter
    import blockfs.serve.server  # noqa: F401
    from blockfs.serve.daemon import is_mounted

    require(has_fuse() and os.geteuid() == 0, "/dev/fuse and root (to become nobody)")
    blockfs.serve.fuse.libfuse_adapter.load_binding("mfusepy")  # the binding, loaded (and kept) before the fork
    dev_open = stat.S_IMODE(os.stat("/dev/fuse").st_mode) & 0o006 == 0o006
    conf = Path("/etc/fuse.conf")
    allowed = conf.exists() and "user_allow_other" in [ln.strip() for ln in conf.read_text().splitlines()]
    base = Path(tempfile.mkdtemp(prefix="blockfs-nobody-", dir="/tmp"))  # not under root's 0700 pytest dir
    try:
        shutil.copytree(packed, base / "p")
        (base / "mnt").mkdir()
        for path in [base, *base.rglob("*")]:
            os.chown(path, 65534, 65534)
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nobody, running the command in this process
            status = 99
            try:
                os.dup2(err_w, 2)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                # pytest replaced sys.stdout and sys.stderr with its own capture: back to the descriptors
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                status = main(
                    [
                        "mount",
                        str(base / "p"),
                        str(base / "mnt"),
                        "--foreground",
                        "--allow-other",
                        "--cache-size",
                        "1MiB",
                        "--no-mlock",
                    ]
                )
            finally:
                sys.stderr.flush()
                os._exit(status)
        os.close(err_w)
        try:
            if dev_open and allowed:  # this machine lets nobody mount with allow_other: it must serve
                wait_until(lambda: is_mounted(base / "mnt"), "nobody's mount")
                plain_unmount(base / "mnt", check=True)
        finally:
            with os.fdopen(err_r, "rb") as f:
                err = f.read().decode()
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if dev_open and allowed:
            assert status == 0, err
        else:
            assert status == 2 and err.count("\n") == 1, err
            if not dev_open:
                assert "/dev/fuse is not accessible to this user" in err and "ls -l /dev/fuse" in err
            else:
                assert "user_allow_other" in err and "/etc/fuse.conf" in err
    finally:
        release(base / "mnt")
        shutil.rmtree(base, ignore_errors=True)


# --- where a dataset is -------------------------------------------------------------------------------
def test_an_unknown_scheme_lists_the_supported_ones(capsys, tmp_path):
    for argv in (["info", "s4://bucket/ds"], ["pack", str(tmp_path), "s4://bucket/ds"]):
        err = one_line_error(capsys, argv)
        assert "unknown scheme 's4://'" in err and "s3://, gs://, az://" in err


@pytest.fixture
def no_cloud_credentials(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(("AWS_", "AZURE_", "GOOGLE_")) and key != "AWS_CA_BUNDLE":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials


def test_s3_without_credentials_says_which_variables_and_options_to_set(capsys, no_cloud_credentials):
    needs_obstore()
    # A closed local port as the metadata service: what a machine outside EC2 ends with, without waiting.
    err = one_line_error(
        capsys,
        [
            "info",
            "s3://bucket/ds",
            "--storage-option",
            "metadata_endpoint=http://127.0.0.1:9",
            "--storage-option",
            "region=us-east-1",
        ],
    )
    assert "no S3 credentials found" in err and "AWS_ACCESS_KEY_ID" in err and "anon=true" in err


def test_azure_without_an_account_names_the_option(capsys, no_cloud_credentials):
    needs_obstore()
    err = one_line_error(capsys, ["info", "az://container/ds"])
    assert "account_name" in err and "AZURE_STORAGE_ACCOUNT_NAME" in err


def test_a_bad_storage_option_key_lists_the_valid_keys(capsys):
    needs_obstore()
    err = one_line_error(capsys, ["info", "s3://bucket/ds", "--storage-option", "acess_key_id=x"])
    assert "--storage-option acess_key_id is not an option of S3" in err
    assert "access_key_id" in err.split("valid keys:")[1] and "part_size" in err and "endpoint_url" in err


def test_a_url_on_python_3_10_says_remote_needs_3_11(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # as on 3.10, where no obstore wheel exists
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    err = one_line_error(capsys, ["info", "s3://bucket/ds"])
    assert "need Python >= 3.11" in err and "pip install obstore" not in err


def test_the_loader_without_torch_says_how_to_install_the_cpu_build():
    code = "import sys; sys.modules['torch'] = None\nfrom blockfs.loader import BlockLoader"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("ModuleNotFoundError: blockfs.loader.BlockLoader needs PyTorch")
    assert "--index-url https://download.pytorch.org/whl/cpu" in last


def test_verify_against_a_server_ignoring_ranges_blames_the_server_not_the_blocks(capsys, tmp_path):
    needs_obstore()
    from httpserver import serving

    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(20):
        (src / f"{i}.bin").write_bytes(os.urandom(20_000))
    blockfs.pack(tmp_path / "src", tmp_path / "p", files_per_block=10, fsync=False)
    with serving(tmp_path / "p") as (base, faults):
        assert main(["verify", base + "/"]) == 0
        faults.ignore_range = True
        err = one_line_error(capsys, ["verify", base + "/"])
    assert "the server cannot serve byte ranges" in err and "BAD" not in err


# --- a mount whose server is gone ---------------------------------------------------------------------
@pytest.mark.fuse
def test_stats_on_a_dead_mount_says_to_umount_it(packed, tmp_path, capsys):
    require(has_fuse(), "/dev/fuse")
    with mounted(packed, tmp_path / "mnt") as m:
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(10)
        err = one_line_error(capsys, ["stats", str(m.path)])
        assert f"run 'blockfs umount {m.path}'" in err


# --- a full disk, Ctrl-C: a failed pack removes what it wrote (issue 28) -------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a pack of 8 MiB fills it for real."""
    disk = tmp_path / "small"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    require(done.returncode == 0, "mount -t tmpfs (root, or CAP_SYS_ADMIN)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _eight_mib(root: Path) -> Path:
    (root / "c").mkdir(parents=True)
    for i in range(32):
        (root / "c" / f"{i:02d}.bin").write_bytes(os.urandom(256 << 10))
    return root


def _pack_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockfs", "pack", *args, "--block-size", "1MiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("workers", ["1", "2"])  # threads; forked processes
def test_a_pack_that_fills_the_disk_says_so_in_one_line_and_removes_what_it_wrote(tmp_path, small_disk, workers):
    src = _eight_mib(tmp_path / "src")
    (small_disk / "mine").mkdir()  # a destination the user made: emptied, not removed
    new, mine = small_disk / "new", small_disk / "mine"
    for dest, removed in (
        (new, f"removed '{new}', which it had created"),
        (mine, f"removed what it wrote in '{mine}'"),
    ):
        done = _pack_cli(str(src), str(dest), "--workers", workers)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"no space left on the device of '{dest}': the pack needs about 8.00 MiB, and 4.00 MiB" in done.stderr
        assert f"; {removed}; free some space there or pack to a disk with room" in done.stderr
    assert os.listdir(small_disk) == ["mine"] and os.listdir(small_disk / "mine") == []
    assert os.statvfs(small_disk).f_bfree == os.statvfs(small_disk).f_blocks  # every byte given back


def test_a_failed_pack_beside_files_it_did_not_write_keeps_them_and_info_says_why(tmp_path, small_disk, capsys):
    src = _eight_mib(tmp_path / "src")
    (tmp_path / "tiny" / "c").mkdir(parents=True)
    (tmp_path / "tiny" / "c" / "a.txt").write_bytes(b"a")
    dest = small_disk / "ds"
    blockfs.pack(tmp_path / "tiny", dest)
    (dest / "NOTES").write_text("the user's")
    done = _pack_cli(str(src), str(dest), "--force")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (
        f"left its marker '{dest}/.blockfs-packing', saying why it failed, beside what '{dest}' held before"
        in done.stderr
    )
    assert sorted(os.listdir(dest)) == [".blockfs-packing", "NOTES"] and (dest / "NOTES").read_text() == "the user's"
    err = one_line_error(capsys, ["info", str(dest)])
    assert "an unfinished pack (it failed: no space left on the device" in err and "run 'blockfs pack' again" in err


@pytest.mark.parametrize("workers", ["1", "2"])  # threads; forked processes (which leave Ctrl-C to the pack)
def test_ctrl_c_during_a_pack_removes_what_it_wrote_and_says_so(tmp_path, workers):
    src = _eight_mib(tmp_path / "src")
    dest = tmp_path / "ds"
    slow = (
        "import sys, time\n"
        "from blockfs.cli import main\n"
        "from blockfs.packing.sources import DirectorySource\n"
        "read = DirectorySource.read_into\n"
        "def slow(self, e, buf, offset=0):\n"
        "    time.sleep(0.5)\n"  # 32 blocks of one file: many seconds to go when the signal comes, even under load
        "    return read(self, e, buf, offset)\n"
        "DirectorySource.read_into = slow\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", slow, "pack", str(src), str(dest), "--block-size", "256KiB", "--workers", workers]
    # As a terminal's Ctrl-C finds it: a suite started in the background by a non-interactive shell
    # inherits SIGINT ignored, which Python (rightly) keeps, so the pack would never see the signal.
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        wait_until(
            lambda: len(os.listdir(dest / "blocks")) >= 2 if (dest / "blocks").exists() else proc.poll(),
            "the pack to write its first blocks",
            timeout=60,
        )
        assert proc.poll() is None, "the pack finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and err == f"blockfs pack: interrupted; removed '{dest}', which it had created\n"
    assert not dest.exists()


# --- a typo in a command or flag; a path that starts with '-' (issue 28) -----------------------------
@pytest.mark.parametrize(
    "argv, usage, says",
    [
        (
            ["mount", "ds", "mnt", "--cache-sise", "8GiB"],
            "usage: blockfs mount [OPTIONS] dest mountpoint",
            "blockfs mount: error: unrecognized argument --cache-sise (did you mean --cache-size?)",
        ),
        (
            ["pack", "src", "ds", "--block-szie=1MiB"],
            "usage: blockfs pack [OPTIONS] SOURCE [SOURCE ...] dest",
            "blockfs pack: error: unrecognized argument --block-szie=1MiB (did you mean --block-size?)",
        ),
        (
            ["-v", "mout", "ds", "mnt"],
            "usage: blockfs [OPTIONS] COMMAND",
            "blockfs: error: unknown command 'mout' (did you mean mount?)",
        ),
        (
            ["ls", "ds", "-four"],
            "usage: blockfs ls [OPTIONS] dest [path]",
            "blockfs ls: error: unrecognized argument -four; a path that begins with '-' goes after '--': "
            "blockfs ls ... -- -four, or write it as ./-four",
        ),
    ],
)
def test_a_typo_gets_the_commands_usage_line_and_the_closest_spelling(capsys, argv, usage, says):
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(usage + "  (") and lines[1] == says, lines


# --- a budget that will not do what it seems to (issue 28) --------------------------------------------
@pytest.fixture
def sixteen_kib_blocks(tmp_path) -> Path:
    """40 KB in 20 files, in blocks of about 16 KiB."""
    (tmp_path / "src" / "c").mkdir(parents=True)
    for i in range(20):
        (tmp_path / "src" / "c" / f"{i:02d}.bin").write_bytes(os.urandom(2000))
    blockfs.pack(tmp_path / "src", tmp_path / "p", block_size=16 << 10, fsync=False)
    return tmp_path / "p"


def test_a_cache_size_above_the_memory_available_is_one_warning_in_the_plan(capsys, packed):
    capsys.readouterr()
    assert main(["plan", str(packed), "--cache-size", "1PiB"]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--cache-size 1.0 PiB is more than the " in warned[0], warned
    assert "of memory available now" in warned[0] and "give --cache-size auto" in warned[0]
    assert main(["plan", str(packed), "--cache-size", "1KiB"]) == 0  # fits: nothing to say
    assert "warning" not in capsys.readouterr().out


def test_a_cache_smaller_than_one_block_says_one_request_per_file(capsys, sixteen_kib_blocks):
    capsys.readouterr()
    assert main(["plan", str(sixteen_kib_blocks), "--cache-size", "4KiB", "--no-retain"]) == 0
    out = capsys.readouterr().out
    assert "block cache:      4.00 KiB, less than one block (" in out and "one request per file" in out
    assert "expected hits per epoch (from the 2nd): 0.0% of files, 0.0% of bytes" in out  # not 10 %
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--cache-size 4.0 KiB is smaller than one block (" in warned[0], warned
    assert "one request per file" in warned[0] and "give --cache-size of at least" in warned[0]


@pytest.mark.fuse
def test_mount_warns_in_one_line_of_a_cache_smaller_than_one_block(tmp_path, sixteen_kib_blocks):
    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = [
        sys.executable,
        "-m",
        "blockfs",
        "mount",
        str(sixteen_kib_blocks),
        str(mnt),
        "--cache-size",
        "4KiB",
        "--log",
        str(tmp_path / "log"),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("\n") == 1 and "smaller than one block" in done.stderr, done.stderr
        assert "one request per file" in done.stdout  # the plan says it too
        assert (mnt / "c" / "00.bin").stat().st_size == 2000
    finally:
        release(mnt)


def test_a_disk_tier_smaller_than_one_block_is_one_warning_in_the_plan(s3, tmp_path, capsys):
    needs_obstore()
    (tmp_path / "src").mkdir()
    for i in range(8):
        (tmp_path / "src" / f"{i}.bin").write_bytes(os.urandom(4000))
    url = f"s3://{s3.new_bucket()}/ds"
    blockfs.pack(tmp_path / "src", url, block_size=16 << 10, fsync=False)
    capsys.readouterr()
    argv = ["plan", url, "--disk-cache", str(tmp_path / "tier"), "--disk-cache-size", "1KiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cache-once, none of the blocks: smaller than one block (" in out
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--disk-cache-size 1.0 KiB is smaller than one block" in warned[0], warned
    assert "will hold nothing" in warned[0]


def test_a_mount_from_fstab_is_told_the_fix_in_fstab_words(capsys, no_cloud_credentials, tmp_path):
    needs_obstore()
    from blockfs.cli.mount_helper import main as mount_helper

    (tmp_path / "mnt").mkdir()
    options = "storage.metadata_endpoint=http://127.0.0.1:9,storage.region=us-east-1,cache_size=1GiB"
    capsys.readouterr()
    assert mount_helper(["s3://bucket/ds", str(tmp_path / "mnt"), "-o", options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no S3 credentials found" in err, err
    assert "storage.anon=true" in err and "--storage-option" not in err
    assert "in fstab, credentials only through mount's environment" in err


# --- the small things of a first week (issue 28, item 8) ----------------------------------------------
@pytest.fixture
def awkward(tmp_path) -> Path:
    """A class directory named -four (a hard link, an empty file, links in and out), one with a newline."""
    src = tmp_path / "src"
    (src / "-four").mkdir(parents=True)
    (src / "-four" / "a.txt").write_bytes(b"four")
    (src / "two\nlines").mkdir()
    (src / "two\nlines" / "b.txt").write_bytes(b"bee")
    (src / "-four" / "zero").write_bytes(b"")
    os.link(src / "-four" / "a.txt", src / "-four" / "hard")
    os.symlink("a.txt", src / "-four" / "link")
    os.symlink("../two\nlines/b.txt", src / "-four" / "up")
    os.symlink("/etc/hostname", src / "-four" / "out")
    os.symlink("loop", src / "-four" / "loop")
    return src


def test_info_escapes_a_label_with_a_newline_as_ls_does(capsys, awkward, tmp_path):
    assert main(["pack", str(awkward), str(tmp_path / "p")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "p")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.endswith("  two\\nlines") for line in lines) and "lines" not in [line.strip() for line in lines]


def test_one_block_is_one_block(capsys, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"a")
    capsys.readouterr()
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "p")]) == 0
    assert main(["verify", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "packed 1 file (" in out and "into 1 block at" in out and "ok: 1 block and" in out, out


def test_the_mounts_one_line_plan_counts_files_as_its_table_does(awkward, tmp_path):
    from blockfs.cli.mount_commands import _plan_line
    from blockfs.serve.cache.retain import plan_dataset

    blockfs.pack(awkward, tmp_path / "p", fsync=False)
    with blockfs.open_dataset(tmp_path / "p") as ds:
        plan, _ = plan_dataset(ds.index.arrays, 1 << 30)
        line = _plan_line(ds.metadata, 1 << 30, "given", "cache-once", plan.n_files)
    assert plan.n_files == 3 and "in 3 files" in plan.describe()  # a.txt and its hard link are one
    assert "in 4 files (3 distinct: hard links share one), 1 block:" in line, line


def test_paths_in_errors_are_shown_one_way_and_dot_slash_is_the_same_path(capsys, awkward, tmp_path):
    blockfs.pack(awkward, tmp_path / "p", fsync=False)
    p = str(tmp_path / "p")
    err = one_line_error(capsys, ["cat", p, "nope.txt"])
    assert "no such file or directory in the packed dataset: 'nope.txt'" in err  # not b'nope.txt'
    err = one_line_error(capsys, ["ls", p, "./-four/a.txt/x"])
    assert "'-four/a.txt/x'" in err and "b'" not in err
    for spelled in (["./-four"], ["--", "-four"], ["--", "-four/"], [".//-four/."]):
        assert main(["ls", p, *spelled]) == 0
        assert "a.txt" in capsys.readouterr().out


def test_cat_follows_a_link_inside_the_dataset_as_cat_does(capsys, awkward, tmp_path):
    blockfs.pack(awkward, tmp_path / "p", fsync=False)
    p = str(tmp_path / "p")
    capsys.readouterr()
    for link, data in (("./-four/link", "four"), ("./-four/up", "bee")):
        assert main(["cat", p, link]) == 0
        assert capsys.readouterr().out == data
    assert "an absolute link, out of the packed dataset" in one_line_error(capsys, ["cat", p, "./-four/out"])
    assert "links in a loop" in one_line_error(capsys, ["cat", p, "./-four/loop"])


def test_a_dataset_path_that_does_not_exist_says_so(capsys, tmp_path):
    err = one_line_error(capsys, ["info", str(tmp_path / "nowhere")])
    assert f"'{tmp_path / 'nowhere'}' does not exist: check the path" in err and "not a directory" not in err


@pytest.mark.fuse
def test_stats_says_what_the_ioctl_requests_are(packed, tmp_path, capsys):
    require(has_fuse(), "/dev/fuse")
    from blockfs.cli.mount_commands import _stats_text
    from blockfs.client import read_stats

    with mounted(packed, tmp_path / "mnt") as m:
        with open(m.path / "c" / "a.txt") as f:  # text mode: Python asks isatty() of it
            assert f.read() == "a" * 100
        stats = read_stats(m.path)
    stats["requests"] = {"lookup": 2000, "open": 2000, "ioctl": 6000}  # the counts of issue 28's run
    shown = _stats_text(stats, None, 1.0)
    assert "6,000 ioctl" in shown and "the terminal check (isatty)" in shown, shown


@pytest.mark.fuse
def test_the_training_example_counts_the_samples_it_reads(torch_module, tmp_path):
    require(has_fuse(), "/dev/fuse")
    sys.path.insert(0, str(REPO / "tools"))
    import make_dataset as md

    md.make_dataset(tmp_path / "src", "learnable", files=32, classes=2, seed=1)
    (tmp_path / "src" / "README.txt").write_text("not a sample")  # outside the class directories: label -1
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    with mounted(tmp_path / "p", tmp_path / "mnt") as m:
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "examples" / "train_block_loader.py"),
                str(m.path),
                "--epochs",
                "1",
                "--batch-size",
                "8",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    first, epoch = done.stdout.splitlines()[0], done.stdout.splitlines()[1]
    assert first.startswith("32 images in 2 classes") and "(left out, as ImageFolder does: 1 outside them)" in first
    assert epoch.endswith(" 32 samples"), epoch


def test_any_failed_pack_says_what_it_left_and_info_why(tmp_path, monkeypatch):
    import errno

    from blockfs.errors import NotADatasetError, PackError
    from blockfs.packing.sources import DirectorySource

    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.txt").write_bytes(b"a" * 100)
    blockfs.pack(tmp_path / "src", tmp_path / "p", fsync=False)
    (tmp_path / "p" / "NOTES").write_text("the user's")

    def refused(self, entry, buf, offset=0):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(DirectorySource, "read_into", refused)
    with pytest.raises(
        PackError, match=r"fix its permissions or pass --skip-unreadable; the failed pack left its marker"
    ):
        blockfs.pack(tmp_path / "src", tmp_path / "p", force=True, workers=1)
    assert sorted(os.listdir(tmp_path / "p")) == [".blockfs-packing", "NOTES"]
    with pytest.raises(NotADatasetError, match=r"unfinished pack \(it failed: cannot read 'c/a.txt'"):
        blockfs.open_dataset(tmp_path / "p")
