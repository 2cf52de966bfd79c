"""Where users run blockfs: ``mount -t fuse.blockfs``, an ``/etc/fstab`` line, a systemd ``Type=notify`` unit.

The mount(8) tests install the helper as /sbin/mount.fuse.blockfs for the test only (mount(8) looks for
helpers in /sbin alone) and always remove it and unmount.  systemd is not PID 1 on the test machines, so
the notify test plays systemd's part: a datagram socket in ``$NOTIFY_SOCKET``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from capability import has_fuse, require
from mountutil import plain_unmount, release, serve_command
from polling import wait_until

import blockfs
from blockfs.cli import mount_helper
from blockfs.cli.mount_helper import blockfs_argv
from blockfs.serve.daemon import is_mounted

REPO = Path(__file__).resolve().parent.parent
HELPER = Path("/sbin/mount.fuse.blockfs")


def test_mount_options_become_blockfs_options():
    argv = blockfs_argv(
        "/d",
        "/m",
        [
            "ro,_netdev,nofail,x-systemd.automount,cache_size=1GiB,allow_other",
            "storage.endpoint=http://h:9,max_read=131072,no_prefill,defaults",
        ],
    )
    assert argv == [
        "mount",
        "--cache-size=1GiB",
        "--allow-other",
        "--storage-option",
        "endpoint=http://h:9",
        "--no-prefill",
        "-o",
        "max_read=131072",
        "--",
        "/d",
        "/m",
    ]
    with pytest.raises(ValueError, match="write it as cache_size=VALUE"):
        blockfs_argv("/d", "/m", ["cache_size"])
    with pytest.raises(ValueError, match="foreground"):
        blockfs_argv("/d", "/m", ["foreground"])
    for secret in ("storage.secret_access_key=x", "storage.secret=x", "storage.account_key=x"):
        with pytest.raises(ValueError, match="is a credential, and fstab is readable by every user"):
            blockfs_argv("/d", "/m", [secret])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["/d", "/m", "-o", "help"], "option 'help' is not a mount option"),
        (["/d", "/m", "-o", "ro,version"], "option 'version' is not a mount option"),
        (["/d", "/m", "-o", "cache_size=1GiB,no_such_thing=1"], "option 'no_such_thing=1' is not a mount option"),
        (["/d", "/m", "-o", "--help"], "option '--help' is not a mount option"),
    ],
)
def test_the_helper_refuses_what_is_not_a_mount_option_in_one_line(argv, says, capsys):
    """Issue 29, 6: ``-o help`` became ``blockfs mount --help``, which printed usage and exited 0 — mount(8)
    and systemd took that for a mount."""
    assert mount_helper.main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1 and says in err, (out, err)


@pytest.mark.parametrize("dataset", ["--help", "-h", "-o", "--version"])
def test_a_dataset_named_like_an_option_is_a_path_never_a_success(dataset, tmp_path, capsys):
    """mount(8) runs ``mount.fuse.blockfs DATASET MNT -o ...``: a dataset field of ``--help`` printed usage
    and exited 0.  Both positionals now come after ``--``, in the helper and in ``blockfs mount``."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert mount_helper.main([dataset, str(mnt), "-o", "rw,no_prefill", "-f"]) == 0  # -f: what it would run
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"-- {dataset} {mnt}"), out
    assert mount_helper.main([dataset, str(mnt), "-o", "rw,no_prefill"]) == 2
    out, err = capsys.readouterr()
    assert "usage" not in out + err and not os.path.ismount(mnt), (out, err)


@pytest.fixture
def dataset(tmp_path) -> Path:
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(30):
        (src / f"{i}.txt").write_text(f"file {i}\n")
    blockfs.pack(tmp_path / "src", tmp_path / "ds.blockfs", fsync=False)
    return tmp_path / "ds.blockfs"


def own_tmp(tmp_path: Path) -> dict[str, str]:
    """The environment for mount(8), with the test's own temp directory: a mount through the helper logs
    to the default log there, not in the machine's /tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp_path / "tmp"))


@contextlib.contextmanager
def helper_installed(tmp_path: Path) -> Iterator[None]:
    """/sbin/mount.fuse.blockfs running this checkout's helper with this interpreter, for the test only."""
    require(has_fuse() and os.geteuid() == 0, "/dev/fuse and root (mount(8) and /sbin)")
    if HELPER.exists() or HELPER.is_symlink():
        pytest.fail(f"{HELPER} exists already: this test installs its own and would replace it")
    script = tmp_path / "mount.fuse.blockfs"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m blockfs.cli.mount_helper "$@"\n')
    script.chmod(0o755)
    HELPER.symlink_to(script)
    try:
        yield
    finally:
        HELPER.unlink()


@pytest.mark.fuse
def test_mount_t_fuse_blockfs_mounts_and_umount_unmounts(dataset, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with helper_installed(tmp_path):
        try:
            done = subprocess.run(
                ["mount", "-t", "fuse.blockfs", str(dataset), str(mnt), "-o", "ro,cache_size=16MiB,_netdev"],
                capture_output=True,
                text=True,
                timeout=120,
                env=own_tmp(tmp_path),
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert (mnt / "cat" / "7.txt").read_text() == "file 7\n"
            with open("/proc/self/mounts") as f:
                line = next(line for line in f if line.split()[1] == str(mnt))
            assert line.split()[2] == "fuse.blockfs" and line.split()[0] == str(dataset), line
            assert subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60).returncode == 0
            assert not is_mounted(mnt)
        finally:
            release(mnt)


@pytest.mark.fuse
def test_the_readme_fstab_line_mounts(dataset, tmp_path):
    """The README's fstab line (local dataset), through mount --fstab as mount -a would read /etc/fstab."""
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "fuse.blockfs" in ln and ln.startswith("/data/"))
    mnt = tmp_path / "imagenet"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(line.replace("/data/imagenet.blockfs", str(dataset)).replace("/mnt/imagenet", str(mnt)) + "\n")
    with helper_installed(tmp_path):
        try:
            done = subprocess.run(
                ["mount", "--fstab", str(fstab), str(mnt)],
                capture_output=True,
                text=True,
                timeout=120,
                env=own_tmp(tmp_path),
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert sorted(os.listdir(mnt / "cat"))[:2] == ["0.txt", "1.txt"]
        finally:
            release(mnt)


@pytest.mark.fuse
def test_the_readme_fstab_line_for_a_remote_dataset_mounts(s3, tmp_path):
    """The README's S3 line, against the test's S3 server (credentials from the environment, as root's)."""
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "a.txt").write_text("remote a\n")
    url = f"s3://{s3.new_bucket()}/imagenet.blockfs"
    blockfs.pack(tmp_path / "src", url, fsync=False)
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "fuse.blockfs" in ln and ln.startswith("s3://"))
    assert "_netdev" in line and "x-systemd.automount" in line
    mnt = tmp_path / "imagenet-s3"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(
        line.replace("s3://my-bucket/imagenet.blockfs", url)
        .replace("/mnt/imagenet-s3", str(mnt))
        .replace("/var/cache/blockfs", str(tmp_path / "disk"))
        + "\n"
    )
    with helper_installed(tmp_path):
        try:
            done = subprocess.run(
                ["mount", "--fstab", str(fstab), str(mnt)],
                capture_output=True,
                text=True,
                timeout=120,
                env=own_tmp(tmp_path),
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert (mnt / "cat" / "a.txt").read_text() == "remote a\n"
            assert any((tmp_path / "disk").iterdir())  # disk_cache= reached the mount
        finally:
            release(mnt)


@pytest.mark.fuse
def test_a_foreground_mount_tells_systemd_it_is_ready_once_it_answers(dataset, tmp_path):
    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(address)
        systemd.settimeout(60)
        log = tmp_path / "log"
        proc = subprocess.Popen(
            serve_command(dataset, mnt, log),
            env=dict(os.environ, NOTIFY_SOCKET=address),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            message = systemd.recv(4096).decode()
            assert message.splitlines()[0] == "READY=1", message
            # READY=1 only once the mount answers: at this instant it serves, no waiting.
            assert is_mounted(mnt) and (mnt / "cat" / "3.txt").read_text() == "file 3\n"
            plain_unmount(mnt, check=True)
            assert systemd.recv(4096).decode() == "STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            release(mnt, proc)
    wait_until(lambda: not is_mounted(mnt), "the mount to go")


def test_readiness_never_asks_the_mount_itself(tmp_path, monkeypatch):
    """The watcher that sends READY=1 runs inside the server: a stat of the mount point would be a request
    to its own process, and a server killed while that request is in flight can never exit (its mount
    then hangs).  It reads the mount table instead."""
    import threading
    import types

    from blockfs.serve import server

    require(os.geteuid() == 0, "root (a tmpfs mount stands in for the FUSE mount)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(mnt)], check=True, timeout=30)
    try:
        real_stat, real_lstat = os.stat, os.lstat

        def refuse(real):
            def call(path, *args, **kw):
                assert os.fspath(path) != str(mnt), "a request to the server's own mount"
                return real(path, *args, **kw)

            return call

        sent = []
        monkeypatch.setattr(os, "stat", refuse(real_stat))
        monkeypatch.setattr(os, "lstat", refuse(real_lstat))
        monkeypatch.setattr(server, "notify", sent.append)
        fs = types.SimpleNamespace(served=True, stopped=threading.Event())
        server._when_serving(fs, str(mnt))
        assert sent and sent[0].startswith("READY=1")
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


# --- the deployment examples: run what can run here ---------------------------------------------------
def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    """The unit as written, with this machine's blockfs in place of /opt/blockfs/bin/blockfs (systemd is
    not PID 1 here, so the unit cannot be started; its notify path is the foreground test above)."""
    analyze = shutil.which("systemd-analyze")
    require(analyze is not None, "systemd-analyze")
    unit = (REPO / "examples" / "systemd" / "blockfs-imagenet.service").read_text()
    assert "Type=notify" in unit and "--foreground" in unit
    here = tmp_path / "blockfs-imagenet.service"
    here.write_text(unit.replace("/opt/blockfs/bin/blockfs", str(Path(sys.executable).parent / "blockfs")))
    done = subprocess.run([analyze, "verify", str(here)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


@pytest.mark.fuse
def test_the_container_entrypoint_mounts_runs_and_unmounts(dataset, tmp_path):
    """examples/container/entrypoint.sh as the container runs it (no docker engine here: the script alone)."""
    require(has_fuse(), "/dev/fuse")
    mnt = tmp_path / "dataset"
    env = dict(
        os.environ,
        BLOCKFS_MOUNT=str(mnt),
        BLOCKFS_MOUNT_OPTIONS="--cache-size 16MiB --log " + str(tmp_path / "log"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    script = REPO / "examples" / "container" / "entrypoint.sh"
    try:
        done = subprocess.run(
            ["sh", str(script), str(dataset), "sh", "-c", f"cat {mnt}/cat/5.txt; exit 3"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode == 3 and "file 5\n" in done.stdout, done.stdout + done.stderr  # its status, passed on
        assert not is_mounted(mnt)
    finally:
        release(mnt)


def _container_check(tmp_path: Path, docker: str | None, dockerd: bool = False) -> subprocess.CompletedProcess:
    """tools/check_container.sh with a PATH of its few tools, ``id`` saying root, and a fake ``docker``
    (the script ``docker`` given, or none): what it says before and around the build, without an engine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("dirname", "mktemp", "rm", "tee", "grep", "sed", "tail", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    fakes = (
        {"id": "echo 0"}
        | ({"docker": docker} if docker is not None else {})
        | ({"dockerd": "exit 1"} if dockerd else {})
    )
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return subprocess.run(
        ["/bin/bash", str(REPO / "tools" / "check_container.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "TMPDIR": str(tmp_path)},
    )


def test_the_container_check_names_the_packages_it_needs_and_shows_the_build_step_by_step(tmp_path):
    """Issue 28: the check needs an engine the README did not name, and its build printed nothing for minutes."""
    readme = (REPO / "README.md").read_text()
    assert "apt-get install docker.io debootstrap" in readme
    no_docker = _container_check(tmp_path / "a", docker=None)
    no_engine = _container_check(tmp_path / "b", docker="exit 1")  # `docker info`: no engine answers
    for done in (no_docker, no_engine):
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert "apt-get install docker.io debootstrap" in done.stderr
    assert "no docker command" in no_docker.stderr and "no Docker engine answers" in no_engine.stderr
    build = 'case $1 in build) for i in 1 2 3; do echo "Step $i/3 : RUN pip install step-$i"; echo " ---> noise"; done; echo "pip: boom"; exit 1;; *) exit 0;; esac'
    failed = _container_check(tmp_path / "c", docker=build)
    steps = [line for line in failed.stdout.splitlines() if line.startswith("check_container: build: ")]
    assert steps == [f"check_container: build: Step {i}/3 : RUN pip install step-{i}" for i in (1, 2, 3)], failed.stdout
    assert failed.returncode == 1 and "the image did not build" in failed.stderr and "pip: boom" in failed.stderr
    assert not list((tmp_path / "c").glob("blockfs-container.*"))  # its work directory is gone


def test_the_dockerfile_and_the_kubernetes_pod_fit_together():
    """The build itself runs in tools/check_container.sh (it needs a Docker engine; CI has none): here, every
    file the recipe copies exists and is in the build context .dockerignore leaves, and the pod parses and
    runs the image's entrypoint with a dataset and a command, with what FUSE needs."""
    import yaml

    dockerfile = (REPO / "examples" / "container" / "Dockerfile").read_text()
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything is left out but what is named
    kept = {line[1:] for line in ignore if line.startswith("!")}
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"Dockerfile copies {source}, which the checkout lacks"
                assert source.split("/")[0] in kept, f"Dockerfile copies {source}, which .dockerignore leaves out"
    assert "fuse3" in dockerfile and 'ENTRYPOINT ["blockfs-entrypoint"]' in dockerfile
    pod = yaml.safe_load((REPO / "examples" / "kubernetes" / "train-pod.yaml").read_text())
    (container,) = pod["spec"]["containers"]
    assert pod["kind"] == "Pod" and container["securityContext"]["privileged"] is True
    assert container["args"][0].startswith("s3://") and len(container["args"]) > 1
    assert {v["name"] for v in container["volumeMounts"]} <= {v["name"] for v in pod["spec"]["volumes"]}
