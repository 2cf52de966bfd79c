"""``blockfs mount s3://...`` against a real S3-compatible server on loopback (moto): the edge-case tree
byte for byte, the disk tier across remounts, the store going away mid-epoch, a damaged object, and no
credential in any log, error or control file."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest
from capability import has_fuse, require
from mountutil import mounted
from polling import wait_until
from s3server import SECRET, upload_tree
from treeutil import make_edge_tree

import blockfs
from blockfs.client import control_dir, read_stats

pytestmark = pytest.mark.fuse


@pytest.fixture(autouse=True)
def _fuse():
    require(has_fuse(), "/dev/fuse")


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-edge")
    src = make_edge_tree(root / "src")
    blockfs.pack(src, root / "packed", block_size=4096, fsync=False)  # several blocks
    return root, src


@pytest.fixture
def url(s3, edge):
    """The edge tree packed straight to the store (the same blocks as the local pack: packing is deterministic)."""
    url = f"s3://{s3.new_bucket()}/edge"
    blockfs.pack(edge[1], url, block_size=4096, fsync=False)
    return url


def blockfs_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "blockfs", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def regular_files(root: bytes) -> dict[bytes, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def no_secret_anywhere(m, mountpoint) -> None:
    """The secret is in no log line, no stats, no control file."""
    assert SECRET not in m.log_text()
    control = control_dir(mountpoint)
    for name in os.listdir(control):
        path = os.path.join(control, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                assert SECRET.encode() not in f.read(), name
    for attr in os.listxattr(control):
        assert SECRET.encode() not in os.getxattr(control, attr), attr


def test_a_mounted_remote_dataset_is_the_tree_byte_for_byte(url, edge):
    _, src = edge
    with mounted(url, edge[0] / "mnt-remote", "--cache-size", "64MiB") as m:
        done = subprocess.run(["diff", "-r", "--no-dereference", src, m.path], capture_output=True)
        assert done.returncode == 0 and done.stdout == b"", done.stdout + done.stderr
        s = read_stats(m.path)
        assert s["mount"]["dest"] == url and s["storage"]["remote"]["requests"] > 0
        assert s["storage"]["remote"]["failures"] == 0
        no_secret_anywhere(m, m.path)
        with open("/proc/self/mounts") as f:
            assert SECRET not in f.read()


def test_the_disk_tier_serves_a_remount_with_no_remote_block_reads(url, edge, tmp_path):
    _, src = edge
    expected = regular_files(os.fsencode(src))
    disk = tmp_path / "disk"
    args = ("--cache-size", "0", "--disk-cache", str(disk), "--disk-cache-size", "1GiB")
    with mounted(url, tmp_path / "mnt1", *args) as m:
        assert regular_files(os.fsencode(m.path)) == expected
        first = read_stats(m.path)["storage"]
    assert first["disk_tier"]["blocks"] == blockfs.open_dataset(edge[0] / "packed").n_blocks
    plan = blockfs_cli("plan", url, "--cache-size", "0", "--disk-cache", str(disk), "--disk-cache-size", "1GiB")
    assert "disk tier:" in plan and "all of the blocks" in plan and "remote read per epoch" in plan, plan
    with mounted(url, tmp_path / "mnt2", *args) as m:
        assert regular_files(os.fsencode(m.path)) == expected
        second = read_stats(m.path)["storage"]
        no_secret_anywhere(m, m.path)
        text = blockfs_cli("stats", str(m.path))
        assert "remote     1 requests" in text and "0 from the remote" in text, text
    assert second["disk_tier"]["remote_reads"] == 0 and second["disk_tier"]["disk_reads"] > 0
    assert second["remote"]["requests"] == 1  # the metadata, to learn the dataset did not change


def test_the_store_going_away_fails_reads_with_eio_then_they_succeed_again(s3, url, edge, tmp_path):
    _, src = edge
    expected = regular_files(os.fsencode(src))
    args = ("--policy", "none", "--storage-option", "retry_timeout=1", "--storage-option", "connect_timeout=0.5")
    with blockfs.open_dataset(edge[0] / "packed") as ds:  # a file of the first block, one of the last
        first, last = (min(os.fsdecode(p) for p in ds.files_in_block(b)) for b in (0, ds.n_blocks - 1))
    with mounted(url, tmp_path / "mnt", *args) as m:
        with open(os.path.join(m.path, first), "rb") as f:
            assert f.read() == expected[first.encode()]
        s3.stop()
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as raised:
                with open(os.path.join(m.path, last), "rb") as f:
                    f.read()
            assert raised.value.errno == errno.EIO and time.monotonic() - started < 15
            assert os.listdir(m.path)  # the mount is up: metadata comes from the index
            assert "gave up after" in m.log_text() and SECRET not in m.log_text()
        finally:
            s3.start()
        assert regular_files(os.fsencode(m.path)) == expected
        errors = read_stats(m.path)["errors"]
        assert errors.get("failed_reads", 0) >= 1 and not errors.get("damaged_blocks_reported")


def test_a_damaged_object_fails_only_its_own_files(s3, url, edge, tmp_path):
    _, src = edge
    expected = regular_files(os.fsencode(src))
    bucket, prefix = url[5:].split("/", 1)
    with blockfs.open_dataset(edge[0] / "packed") as ds:
        victims = {os.fsdecode(p).encode() for p in ds.files_in_block(1)}
    key = f"{prefix}/blocks/00000001.blk"
    body = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-2] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with mounted(url, tmp_path / "mnt", "--disk-cache", str(tmp_path / "disk")) as m:
        failed = set()
        for rel, data in expected.items():
            try:
                with open(os.path.join(m.path, os.fsdecode(rel)), "rb") as f:
                    assert f.read() == data, rel
            except OSError as e:
                assert e.errno == errno.EIO
                failed.add(rel)
        assert failed and failed <= victims
        assert not os.path.exists(tmp_path / "disk" / os.listdir(tmp_path / "disk")[0] / "blocks" / "00000001.blk")


def test_commands_read_a_url_and_errors_carry_no_secret(s3, url, edge):
    env = dict(os.environ)
    run = lambda *a: subprocess.run([sys.executable, "-m", "blockfs", *a], capture_output=True, env=env)  # noqa: E731
    info = run("info", url)
    assert info.returncode == 0 and b"blocks" in info.stdout, info.stderr
    assert run("verify", url).returncode == 0
    bad = run("info", url + "-missing")
    assert bad.returncode != 0 and b"not a packed dataset" in bad.stderr
    env["AWS_ACCESS_KEY_ID"] = "AKIAWRONGWRONGWRONG0"
    denied = run("ls", url, "--storage-option", f"secret={SECRET}x")
    for done in (info, bad, denied):
        assert SECRET.encode() not in done.stdout + done.stderr


def test_the_loader_reads_a_remote_mount_as_a_local_one(s3, tmp_path, torch_module):
    """The loader, unchanged, over a mount of s3://: every file once, its bytes and its label."""
    from blockfs.loader.block_loader import BlockLoader

    src = tmp_path / "src"
    for i in range(120):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"{i:03d}.bin").write_bytes(os.urandom(200 + i))
    blockfs.pack(src, tmp_path / "packed", files_per_block=16, fsync=False)
    bucket = s3.new_bucket()
    upload_tree(s3, bucket, "ds", tmp_path / "packed")
    with mounted(
        f"s3://{bucket}/ds", tmp_path / "mnt", "--cache-size", "1MiB", "--disk-cache", str(tmp_path / "d")
    ) as m:
        seen = 0
        with BlockLoader(m.path, 8, num_workers=0, device="cpu") as loader:  # closed before the unmount
            for samples, labels, ids in loader:
                for data, label, i in zip(samples, labels.tolist(), ids.tolist(), strict=True):
                    rel = os.path.relpath(loader.path(i), loader.root)
                    assert data == (src / rel).read_bytes() and rel.split("/")[0] == loader.classes[label]
                    seen += 1
        assert seen == 120
        assert read_stats(m.path)["storage"]["remote"]["failures"] == 0


def test_a_background_mount_fetches_the_index_once_and_leaves_no_copy(url, edge, tmp_path):
    """``blockfs mount`` fetches metadata and index to print the plan and hands them to its serving process:
    the server itself sends only the metadata GET, and the copy is gone after the unmount."""
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    os.makedirs(env["TMPDIR"])
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = [sys.executable, "-m", "blockfs", "mount", url, str(mnt), "--no-prefill", "--log", str(tmp_path / "log")]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    try:
        remote = read_stats(mnt)["storage"]["remote"]
        assert remote["requests"] == 1 and remote["bytes"] == os.path.getsize(edge[0] / "packed" / "blockfs.json")
        assert regular_files(os.fsencode(mnt)) == regular_files(os.fsencode(edge[1]))
    finally:
        blockfs_cli("umount", str(mnt))
    assert os.listdir(env["TMPDIR"]) == []


def test_a_background_mount_keeps_its_secrets_out_of_its_command_line_and_environment(s3, url, edge, tmp_path):
    """Storage options reach the serving process through a pipe: ``/proc/PID/cmdline`` (readable by every
    user) and ``/proc/PID/environ`` hold no secret, and the mount reads with them."""
    from s3server import ACCESS_KEY

    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = [
        sys.executable,
        "-m",
        "blockfs",
        "mount",
        url,
        str(mnt),
        "--no-prefill",
        "--log",
        str(tmp_path / "log"),
        "--storage-option",
        f"key={ACCESS_KEY}",
        f"--storage-opt=secret={SECRET}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    try:
        pid = read_stats(mnt)["mount"]["pid"]
        for name in ("cmdline", "environ"):
            with open(f"/proc/{pid}/{name}", "rb") as f:
                seen = f.read()
            assert SECRET.encode() not in seen and ACCESS_KEY.encode() not in seen, name
        assert b"--storage-opt" not in open(f"/proc/{pid}/cmdline", "rb").read()
        assert regular_files(os.fsencode(mnt)) == regular_files(os.fsencode(edge[1]))
        assert SECRET not in done.stdout + done.stderr + (tmp_path / "log").read_text()
    finally:
        blockfs_cli("umount", str(mnt))


@pytest.mark.parametrize("background", [True, False], ids=["background", "foreground"])
def test_umount_of_a_killed_remote_mount_removes_its_fetched_directory_and_nothing_else(url, tmp_path, background):
    """Issue 29, 7: a remote mount's fetched metadata and index (a directory in the temporary directory,
    named after the mount point) stayed there when its server was SIGKILLed.  ``blockfs umount`` of the
    dead mount removes that directory: never a link planted under its name, another user's, or another
    mount point's."""
    import signal

    from blockfs.serve.daemon import is_mounted
    from blockfs.serve.mount_files import FETCHED_PREFIX

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = [sys.executable, "-m", "blockfs", "mount", url, str(mnt), "--no-prefill", "--log", str(tmp_path / "log")]
    proc = None
    if background:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
    else:
        proc = subprocess.Popen([*command, "--foreground"], env=env)
        wait_until(lambda: os.path.ismount(mnt), "the foreground mount")
    try:
        pid = read_stats(mnt)["mount"]["pid"]
        fetched = [n for n in os.listdir(tmp) if n.startswith(FETCHED_PREFIX)]
        assert len(fetched) == 1 and {"blockfs.json", "index.bfi"} <= set(os.listdir(tmp / fetched[0])), fetched
        prefix = fetched[0][: fetched[0].rindex("-") + 1]
        victim = tmp_path / "victim"
        victim.mkdir()
        (victim / "keep").write_text("kept\n")
        os.symlink(victim, tmp / f"{prefix}link")  # a link under this mount point's name
        (tmp / f"{FETCHED_PREFIX}0123456789abcdef-other").mkdir()  # another mount point's
        (tmp / f"{FETCHED_PREFIX}0123456789abcdef-other" / "index.bfi").write_bytes(b"x")
        theirs = tmp / f"{prefix}theirs"
        theirs.mkdir()
        if os.geteuid() == 0:
            os.chown(theirs, 65534, 65534)  # another user's, under this mount point's name
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: (
                not os.path.exists(f"/proc/{pid}/stat")
                or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] in ("Z", "X")
            ),
            "the server to die",
        )
        assert (tmp / fetched[0]).is_dir()  # what the killed server could not remove
        done = subprocess.run(
            [sys.executable, "-m", "blockfs", "umount", str(mnt)], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        assert not is_mounted(mnt)
        left = sorted(os.listdir(tmp))
        expected = [f"{FETCHED_PREFIX}0123456789abcdef-other", f"{prefix}link"]
        assert left == sorted(expected + ([f"{prefix}theirs"] if os.geteuid() == 0 else [])), left
        assert (victim / "keep").read_text() == "kept\n"
    finally:
        if is_mounted(mnt):
            subprocess.run([sys.executable, "-m", "blockfs", "umount", str(mnt)], capture_output=True, env=env)
        if proc is not None:
            proc.wait(10)
