"""blockfs.serve.cache.mount_plan: a mount's plan is made once, by its server, and reported to the command that prints
it; ``blockfs plan`` makes the same one the same way.  Mechanisms, not speed: counted calls and live objects."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from capability import has_fuse, require
from mountutil import release
from treeutil import make_class_tree

import blockfs
from blockfs import cli
from blockfs.client import read_stats
from blockfs.core.dataset import PackedDataset
from blockfs.serve.cache import memory_plan as plan_module
from blockfs.serve.cache.mount_plan import make_mount_plan, retains


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mountplan")
    make_class_tree(root / "src", files=240, seed=5, sizes=(1, 30_000))
    blockfs.pack(root / "src", root / "packed", block_size=128 << 10, fsync=False)
    return root / "packed"


@pytest.mark.fuse
@pytest.mark.parametrize("binding", ["kernel", "mfusepy"])
def test_blockfs_mount_prints_the_plan_its_server_made_and_makes_none_itself(
    packed, tmp_path, monkeypatch, capsys, binding
):
    require(has_fuse(), "/dev/fuse")
    monkeypatch.setenv("BLOCKFS_FUSE", binding)  # the serving process's route
    budget = json.loads((packed / "blockfs.json").read_text())["file_bytes"] // 3  # does not fit: files retained
    with PackedDataset(packed) as ds:  # what `blockfs plan` makes, made here before planning is forbidden
        made = make_mount_plan(ds, budget).report()["plan"]

    def no_plan_here(*args, **kwargs):
        raise AssertionError("blockfs mount made a memory plan itself: only its server may")

    monkeypatch.setattr(plan_module, "make_memory_plan", no_plan_here)  # this process only, not the server
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        assert (
            cli.main(["mount", str(packed), str(mnt), "--cache-size", str(budget), "--log", str(tmp_path / "log")]) == 0
        )
        out = capsys.readouterr().out
        served = read_stats(mnt)["plan"]
    finally:
        release(mnt)
    assert out.count("memory plan:") == 1 and out.count("memory budget:") == 1, out
    assert f"retained files:   {served['retained_files']:,} files" in out, out
    assert out.index("memory budget:") < out.index("mounted ")
    chosen = ("retained_files", "retained_bytes", "block_cache_bytes", "threshold", "n_files", "dataset_bytes")
    assert {k: served[k] for k in chosen} == {k: made[k] for k in chosen}  # the server's plan is `blockfs plan`'s


def test_blockfs_plan_is_the_plan_a_server_makes(packed, capsys):
    budget = json.loads((packed / "blockfs.json").read_text())["file_bytes"] // 3
    assert cli.main(["plan", str(packed), "--cache-size", str(budget), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    with PackedDataset(packed) as ds:
        made = make_mount_plan(ds, budget).report()["plan"]
    assert {k: printed[k] for k in made} == made


def test_a_policy_that_caches_nothing_retains_nothing(packed):
    assert retains(True, "cache-once") and not retains(False, "cache-once") and not retains(True, "none")
    with PackedDataset(packed) as ds:
        budget = int(ds.metadata["file_bytes"]) // 3
        kept, none = make_mount_plan(ds, budget), make_mount_plan(ds, budget, policy="none")
    assert kept.retains and kept.memory.retained_files > 0
    assert not none.retains and none.memory.retain_share == 0 and none.memory.block_cache_bytes == budget


def test_the_plan_counts_what_the_kernel_holds_for_a_listing(packed, capsys):
    """Issue 30 item 4: after a full listing the kernel holds an inode and a dentry per entry (~1.2 KB, slab);
    the plan says so, in its text and its report, and ``blockfs plan`` prints it."""
    with PackedDataset(packed) as ds:
        listed = ds.index.n_entries - 1  # every entry but the root
        plan = make_mount_plan(ds, 1 << 30).memory
    assert listed > 240 and plan.n_entries == listed
    assert plan.kernel_listing_bytes == listed * plan_module.KERNEL_BYTES_PER_ENTRY
    assert 800 <= plan_module.KERNEL_BYTES_PER_ENTRY <= 2000
    assert plan.to_dict()["kernel_listing_bytes"] == plan.kernel_listing_bytes
    assert f"each of {listed:,} entries" in plan.describe()
    assert plan_module.MemoryPlan.from_dict(plan.to_dict()).kernel_listing_bytes == plan.kernel_listing_bytes
    assert cli.main(["plan", str(packed), "--cache-size", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "kernel:" in out and f"each of {listed:,} entries" in out, out


def test_the_mount_command_prints_its_servers_plan_without_importing_numpy(packed):
    """``blockfs mount`` returns once its server serves, after printing the plan the server reported: that
    process only describes a plan, and numpy's import (~0.1 s, more on a busy machine) would delay it."""
    with PackedDataset(packed) as ds:
        report = json.dumps(make_mount_plan(ds, 1 << 20).report())
    probe = (
        "import json, sys\n"
        "from blockfs.cli import mount_commands\n"
        f"report = json.loads({report!r})\n"
        "text = mount_commands._describe(report)\n"
        "plan = mount_commands._plan_of(report)\n"
        "assert 'retained files:' in text and plan.retained is None, text\n"
        "print('numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "the mount command's process imported numpy"
