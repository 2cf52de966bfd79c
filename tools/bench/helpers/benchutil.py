"""Helpers shared by the benchmarks in tools/bench/: dropping caches, a memory cgroup, child servers on a port."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from blockfs.serve.daemon import mount_points  # the table's parser blockfs's own mount checks use


def scratch_dir(given: str | None, prefix: str) -> Path:
    """A benchmark's working directory: ``given`` (``--work``: kept), or a new one in the temp dir, removed when
    the benchmark's process exits (after its own clean-up unmounted what it mounted), left with a line saying
    so if something is still mounted below it (removing would reach into that mount)."""
    if given:
        return Path(given).resolve()
    path = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    atexit.register(remove_scratch, path)
    return path


def remove_scratch(path: Path) -> None:
    """Remove ``path`` unless a mount lies below it (then say so, and leave it)."""
    below = [m for m in mount_points() if m == str(path) or m.startswith(str(path) + "/")]
    if below:
        print(f"left {path}: {below[0]} is still mounted", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def drop_caches(level: int = 3) -> bool:
    """Drop the kernel's page cache (1), dentries and inodes (2) or both (3); False when not permitted.

    Needs root.  The benchmarks use it for "cold" runs: the next reads come from the disk.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
        return True
    except OSError:
        return False


def evict_file(path: str) -> None:
    """Drop one file's pages from the page cache (written back first), leaving every other file cached.

    For "this input is cold, the programs reading it are not": a global drop also evicts the
    interpreter and its libraries, which costs a Python tool far more to load again than a C one.
    """
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class MemoryCgroup:
    """A memory cgroup with a hard limit, for "this process has only so much page cache" runs (root only).

    The page cache a process reads into is charged to its cgroup, so a reader started with
    ``preexec_fn=group.enter`` keeps at most ``limit_bytes`` of file pages (its own memory included), as on a
    machine whose free memory is that small.  Works with cgroup v2 (``memory.max``) and v1
    (``memory.limit_in_bytes``).
    """

    def __init__(self, name: str, limit_bytes: int) -> None:
        v2, v1 = "/sys/fs/cgroup", "/sys/fs/cgroup/memory"
        if (
            os.path.exists(os.path.join(v2, "cgroup.controllers"))
            and "memory" in open(os.path.join(v2, "cgroup.subtree_control")).read().split()
        ):
            self.path, limit_file = os.path.join(v2, name), "memory.max"
        elif os.path.isdir(v1) and os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
            self.path, limit_file = os.path.join(v1, name), "memory.limit_in_bytes"
        else:
            raise OSError("no memory cgroup controller (cgroup v2 memory.max or v1 memory.limit_in_bytes)")
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, limit_file), "w") as f:
            f.write(str(limit_bytes))

    def enter(self) -> None:
        """Move the calling process into the group (use as ``preexec_fn``)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def close(self) -> None:
        """Remove the group (its processes must have exited; their charged pages move to the parent)."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass


# --- servers and processes a benchmark starts and must stop ------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def started_server(
    what: str, command: list[str], port: int, log: Path, env: dict | None = None, host: str = "127.0.0.1"
) -> Iterator[subprocess.Popen]:
    """A server in a child process in its own session (Ctrl-C reaches only the benchmark, whose ``finally``
    stops it); yields the process once ``host:port`` answers."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while not answers(port, host):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-10:]
                raise RuntimeError(f"{what} did not start:\n  " + "\n  ".join(tail))
            time.sleep(0.1)
        yield proc
    finally:
        stop_process(proc)


@contextlib.contextmanager
def child_server(what: str, command: list[str], port: int, log: Path, env: dict | None = None) -> Iterator[str]:
    """:func:`started_server` on loopback; yields its URL."""
    with started_server(what, command, port, log, env):
        yield f"http://127.0.0.1:{port}"


def read_files_threads(paths: list[str], threads: int) -> tuple[float, int]:
    """Read every file of ``paths`` whole, dealt round-robin to ``threads`` threads (a DataLoader with
    workers, roughly): (seconds, bytes read)."""
    from concurrent.futures import ThreadPoolExecutor

    def work(part: list[str]) -> int:
        total = 0
        for path in part:
            with open(path, "rb") as f:
                total += len(f.read())
        return total

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(work, [paths[k::threads] for k in range(threads)]))
    return time.perf_counter() - start, nbytes


def run_storage_reader(root: Path, order_file: Path, threads: int) -> dict:
    """One pass of ``storage_reader.py`` (a separate process, so the reader's memory and caches are its
    own) over the files listed in ``order_file`` under ``root``: its JSON result; an error read ends the run."""
    from . import HELPERS

    done = subprocess.run(
        [sys.executable, str(HELPERS / "storage_reader.py"), str(root), str(order_file), "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["errors"]:
        raise SystemExit(f"reader errors under {root}: {result}")
    return result


def compiled(checkout: str | os.PathLike) -> None:
    """Write the bytecode of ``checkout``'s blockfs, so a timed command does not compile it each run: an
    environment with ``PYTHONDONTWRITEBYTECODE`` (some images set it) never caches a module edited since
    the install, and a fresh ``--before`` checkout has none at all (~0.1 s of every mount)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(checkout, "blockfs")], check=True)


def before_after_parser(doc: str, rounds: int, work_help: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times one packed dataset with this checkout and ``--before``'s:
    ``ds``, ``--before``, ``--rounds``, ``--json``, ``--work`` (``doc``: the script's, its first paragraph
    the description)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("ds", help="a packed dataset")
    parser.add_argument("--before", help="a checkout of blockfs before the change (its parent directory)")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--work", help=work_help)
    return parser


def compile_timed(before: str | None) -> None:
    """:func:`compiled` for this checkout's blockfs and, when given, ``before``'s."""
    import blockfs

    compiled(os.path.dirname(os.path.dirname(os.path.abspath(blockfs.__file__))))
    if before:
        compiled(before)


def checkout_main(checkout: Path) -> str:
    """``python -c`` code that runs the ``blockfs`` command of the blockfs in ``checkout``: put first on
    ``sys.path``, before the current directory (``python -m blockfs`` run from another checkout's root would
    import that one's, whatever ``PYTHONPATH`` says)."""
    return f"import sys; sys.path.insert(0, {str(checkout)!r}); from blockfs.cli import main; sys.exit(main())"


def mount_checkout(
    checkout: Path,
    packed: Path,
    mnt: Path,
    route: str,
    extra: Sequence[str] = (),
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> int:
    """A background ``blockfs mount PACKED MNT --foreground EXTRA`` of ``checkout``'s blockfs on FUSE route
    ``route``, logging to ``MNT.log`` beside it, ``env`` added to its environment; its pid once it serves."""
    from blockfs.serve.daemon import start_background

    mnt.mkdir(parents=True, exist_ok=True)
    env_before = dict(os.environ)
    os.environ["PYTHONPATH"] = str(checkout)
    os.environ["BLOCKFS_FUSE"] = route
    os.environ.update(env or {})
    try:
        command = [sys.executable, "-c", checkout_main(checkout), "mount", str(packed), str(mnt), "--foreground"]
        return start_background([*command, *extra], mnt, str(mnt.parent / f"{mnt.name}.log"), timeout=timeout)
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def shuffled_order(src: Path, order_file: Path, seed: int = 0) -> list[str]:
    """Every file under ``src`` (relative paths) in one shuffled order, written one a line to ``order_file``
    (what ``storage_reader.py`` reads from a list); the names, in that order."""
    names = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
    random.Random(seed).shuffle(names)
    order_file.write_text("\n".join(names) + "\n")
    return names


def add_variant_options(parser: argparse.ArgumentParser) -> None:
    """``--variant`` (repeatable, :func:`variant_checkouts`), ``--work`` and ``--json``: what the benchmarks
    that compare mounts of blockfs side by side in one run all take."""
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=VAR=VALUE[,VAR=VALUE]",
        help="this blockfs mounted again with these environment variables, read in the same repeats; repeatable",
    )
    parser.add_argument("--work", help="scratch directory (default: a new one in the temp dir)")
    parser.add_argument("--json", help="write every sample here")


def variant_checkouts(given: list[str], checkout: Path) -> dict[str, tuple[Path, dict[str, str]]]:
    """Each ``--variant`` as ``label: (checkout, the environment it adds)``, to mount beside the others."""
    return {label: (checkout, env) for label, env in map(parse_variant, given)}


def parse_variant(given: str) -> tuple[str, dict[str, str]]:
    """``LABEL=VAR=VALUE[,VAR=VALUE...]`` (a benchmark's ``--variant``): the label and the environment it adds."""
    label, sep, assignments = given.partition("=")
    env = dict(item.split("=", 1) for item in assignments.split(",") if "=" in item)
    if not sep or not label or not env:
        raise SystemExit(f"--variant {given!r}: give LABEL=VAR=VALUE[,VAR=VALUE...], e.g. libfuse=BLOCKFS_FUSE=mfusepy")
    return label, env


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (all its threads), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
