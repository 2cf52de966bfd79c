"""tools/bench/bench_remote.py runs end to end on a tiny tree: every scenario in its JSON, the remount served from
the disk tier with no block byte from the remote, and nothing left behind (no mount, no server)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from capability import has_fuse, require

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench" / "bench_remote.py"


@pytest.mark.fuse
@pytest.mark.any_route  # the benchmark's harness and the tiers below the adapter: not the route
def test_a_quick_mount_run_reports_every_scenario_and_a_remount_with_no_remote_block_bytes(tmp_path):
    require(has_fuse(), "/dev/fuse")
    require(
        importlib.util.find_spec("moto") is not None and importlib.util.find_spec("obstore") is not None,
        "moto[server] and obstore (pip install -e '.[test]')",
    )
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(TOOL),
        "--quick",
        "--files",
        "60",
        "--mount",
        "--json",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    scenarios = results["mount"]["scenarios"]
    assert list(scenarios) == ["memory", "small-memory", "disk-tier", "disk-tier-remount"]
    assert [len(s["epochs"]) for s in scenarios.values()] == [2, 2, 2, 1]
    remount = scenarios["disk-tier-remount"]["epochs"][0]
    assert remount["disk_remote_bytes"] == 0 and remount["remote_bytes"] == 0 and remount["disk_bytes"] > 0
    assert set(results["mount"]["baseline"]) == {"boto3", "obstore"}
    # Every check but small-memory's ratio, which on 60 files is dominated by the 64 KiB block-header reads.
    assert all(ok for what, ok in results["checks"] if not what.startswith("small-memory")), results["checks"]
    with open("/proc/self/mounts") as f:
        assert str(tmp_path) not in f.read()
    servers = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], check=False, capture_output=True, text=True)
    assert servers.stdout == "", servers.stdout
