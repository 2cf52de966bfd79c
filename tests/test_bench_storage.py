"""The storage benchmark's parts: the delay proxy relays every byte late and counts what crossed it, the reader
splits a list as DataLoader workers do, and tools/bench/bench_storage.py runs end to end on the local disk through
its blkio cgroup, leaving no mount, cgroup or process behind."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from capability import has_fuse, require
from pagecache import resident_pages
from polling import wait_until

BENCH = Path(__file__).resolve().parent.parent / "tools" / "bench"
sys.path.insert(0, str(BENCH))

from helpers import HELPERS, storage_emulation  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server(tmp_path):
    """A plain HTTP file server on loopback, serving tmp_path/www."""
    root = tmp_path / "www"
    root.mkdir()
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, server.server_address[1]
    server.shutdown()
    server.server_close()


def _wait_for_port(port: int, proc: subprocess.Popen) -> None:
    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            return False

    wait_until(listening, "the proxy to listen", timeout=30)


def test_the_delay_proxy_relays_every_byte_a_round_trip_late_and_counts_requests_and_bytes(tmp_path, http_server):
    root, target = http_server
    payload = os.urandom(300_000)
    (root / "object.bin").write_bytes(payload)
    port, stats = _free_port(), tmp_path / "stats.json"
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(HELPERS / "delay_proxy.py"),
            f"127.0.0.1:{port}",
            f"127.0.0.1:{target}",
            "--rtt-ms",
            "40",
            "--stats",
            str(stats),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_port(port, proxy)
        started = time.monotonic()
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/object.bin", timeout=30) as answer:
                assert answer.read() == payload
        # Each request waits at least one round trip for its answer (a lower bound: no timing upper bound).
        assert time.monotonic() - started >= 3 * 0.040
        proxy.send_signal(__import__("signal").SIGUSR1)
        wait_until(stats.exists, "the proxy's counters")
        counters = json.loads(stats.read_text())
        assert counters["requests"] == 3
        assert counters["connections"] == 4  # the three requests' and the one that saw the port open
        assert counters["bytes_down"] > 3 * len(payload)  # the bodies and their headers
    finally:
        proxy.terminate()
        proxy.wait(10)


def test_the_reader_splits_the_list_among_threads_and_counts_every_file_and_error(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    names = []
    for i in range(50):
        (tree / f"f{i}").write_bytes(b"x" * i)
        names.append(f"f{i}")
    order = tmp_path / "order"
    order.write_text("\n".join([*names, "missing"]) + "\n")
    done = subprocess.run(
        [sys.executable, str(HELPERS / "storage_reader.py"), str(tree), str(order), "--threads", "4"],
        check=True,
        capture_output=True,
        text=True,
    )
    out = json.loads(done.stdout)
    assert out["files"] == 50 and out["bytes"] == sum(range(50)) and out["errors"] == 1
    assert "missing" in out["first_error"] and out["complete"] is False
    assert sum(out["timeline"]) == 50  # every file read, in the tick it was read in


def test_evict_drops_only_the_named_files_pages(tmp_path):
    evicted, kept = tmp_path / "data", tmp_path.parent / f"{tmp_path.name}-kept"
    for path in (evicted, kept):
        path.write_bytes(os.urandom(1 << 20))
        path.read_bytes()  # in the page cache now
    try:
        assert any(resident_pages(evicted)) and any(resident_pages(kept))
        assert storage_emulation.evict([tmp_path]) == 1 << 20
        assert not any(resident_pages(evicted))
        assert any(resident_pages(kept))  # a file outside the named paths keeps its pages
    finally:
        kept.unlink()


def _blkio() -> bool:
    return os.geteuid() == 0 and (storage_emulation.BLKIO / "blkio.throttle.read_iops_device").exists()


def run_bench_storage_locally(tmp_path: Path, files: int, *extra: str) -> tuple[list[dict], int]:
    """``bench_storage.py`` on the local disk (tiny files, no peers, 5 s a system) with ``extra`` arguments:
    its result rows, and its pid (the cgroups it made are named after it)."""
    require(has_fuse(), "/dev/fuse")
    require(_blkio(), "root and a cgroup v1 blkio controller")
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(BENCH / "bench_storage.py"),
        *("--storages", "local", "--datasets", "tiny", "--tiny-files", str(files), "--no-peers", "--seconds", "5"),
        *extra,
        *("--work", str(tmp_path / "work"), "--json", str(out)),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout + stderr[-3000:]
    return json.loads(out.read_text())["results"], proc.pid


@pytest.mark.fuse
@pytest.mark.any_route  # the benchmark's harness: its mounts' route is not what it checks
def test_bench_storage_runs_on_the_local_disk_and_leaves_nothing_behind(tmp_path):
    rows, pid = run_bench_storage_locally(tmp_path, 400)
    systems = {(r["system"], r["readers"], r["epoch"]) for r in rows}
    for want in [
        ("raw", 1, "1"),
        ("raw", 4, "1"),
        ("raw DataLoader", 4, "1"),
        ("null FUSE (ceiling)", 4, "1"),
        ("blockfs mount", 1, "1"),
        ("blockfs mount", 4, "2"),
        ("blockfs mount", 4, "remount"),
        ("blockfs loader", 4, "1"),
    ]:
        assert want in systems, (want, sorted(systems))
    assert all(r["complete"] and "errors" not in r for r in rows), rows
    # Every reader listed the tree first, as ImageFolder does (the loaders list nothing of their own).
    assert all("list_seconds" in r for r in rows if "loader" not in r["system"] and "DataLoader" not in r["system"])
    by = {(r["system"], r["readers"], r["epoch"]): r for r in rows}
    # Epoch 1 read the evicted pack from the disk (counted by the cgroup); epoch 2 was served from memory.
    # Epoch 2's bound, not zero: the cgroup counts every read of the benchmark's processes, and on a busy
    # machine the kernel may drop and re-read a page or two of the pack, Python's own files, the log.
    first = by[("blockfs mount", 4, "1")]["storage_bytes"]
    assert first > 0
    assert by[("blockfs mount", 4, "2")]["storage_bytes"] <= first // 10
    assert by[("raw", 4, "1")]["storage_requests"] >= 400
    with open("/proc/self/mounts") as f:
        assert str(tmp_path) not in f.read()
    assert not any(p.name.startswith(f"bfs-{pid}-") for p in storage_emulation.BLKIO.iterdir())
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], check=False, capture_output=True, text=True)
    assert left.stdout == "", left.stdout


@pytest.mark.fuse
@pytest.mark.any_route  # the benchmark's harness: its mounts' route is not what it checks
def test_bench_storage_runs_only_the_systems_asked_reading_from_the_list_without_a_listing(tmp_path):
    """``--systems raw,blockfs --readers 4 --no-list``: the raw directory and the mount's two epochs, 4 readers
    each, and no reader lists the tree first (paths straight from the list, as a CSV-driven dataset)."""
    rows, _pid = run_bench_storage_locally(tmp_path, 300, "--systems", "raw,blockfs", "--readers", "4", "--no-list")
    assert sorted((r["system"], r["readers"], r["epoch"]) for r in rows) == [
        ("blockfs mount", 4, "1"),
        ("blockfs mount", 4, "2"),
        ("raw", 4, "1"),
        ("raw", 4, "2"),  # local only: the plain directory warm
    ]
    assert all(r["complete"] and "errors" not in r for r in rows), rows
    assert not [r for r in rows if "list_seconds" in r], rows
    first = next(r for r in rows if r["system"] == "blockfs mount" and r["epoch"] == "1")
    if "storage_done_s" in first:  # not when the storage had sent it all before the first sample (a fast disk)
        assert 0 <= first["files_by_storage_done"] <= first["files"] == sum(first["timeline"])
    with open("/proc/self/mounts") as f:
        assert str(tmp_path) not in f.read()
