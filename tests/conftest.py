"""Shared test fixtures and the suite's hooks; the helpers tests import are plain modules (capability, treeutil).

Tests marked ``serial`` cannot run beside others (they time a wait, or count what other processes move):
under pytest-xdist (``-n N``) they are deselected, and ``--only-serial`` runs them alone afterwards
(tools/test.sh runs both steps).

A test that needs a machine capability (``/dev/fuse``, PyTorch, root) is skipped where that capability is
missing, *unless* ``BLOCKFS_REQUIRE_ALL=1`` is set: then every skip, however it was asked for
(:func:`require`, a ``skipif`` mark, ``pytest.skip``), is reported as a failure, so CI (which has all of
them) can never go green by skipping. The one exception is a test marked ``gpu``: CI has no GPU, so those
skip there, and fail instead only under ``BLOCKFS_REQUIRE_GPU=1`` (capability.require_gpu).
"""

from __future__ import annotations

import importlib.util

import pytest
from capability import REQUIRE_ALL, REQUIRE_GPU, has_torch, require
from hypothesis import settings
from treeutil import make_edge_tree

# No deadline anywhere: how long an example takes on a shared machine is a wall-clock assertion, and
# speed is measured in tools/bench/.  CI runs the property tests on a fixed set of examples, so its verdict is
# the code's and not the draw's; local runs keep exploring new examples (and remember failures in
# .hypothesis/).  Both profiles say derandomize outright: Hypothesis derandomizes by itself when it sees
# a CI variable (CI=true), and a profile that inherited that would make the two modes the same.
settings.register_profile("local", deadline=None, derandomize=False)
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if REQUIRE_ALL else "local")


def pytest_addoption(parser):
    parser.addoption(
        "--only-serial",
        action="store_true",
        help="run only the tests marked serial (those a parallel run (-n N) leaves out)",
    )


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, leave out the tests marked serial; with --only-serial, run only them."""
    only_serial = config.getoption("--only-serial")
    parallel = bool(getattr(config.option, "numprocesses", None)) or hasattr(config, "workerinput")
    if not (only_serial or parallel):
        return
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("serial") is not None) == only_serial else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under BLOCKFS_REQUIRE_ALL=1, a skipped test is a failed one (an expected failure stays one), except a
    test marked ``gpu`` where BLOCKFS_REQUIRE_GPU=1 is not set."""
    outcome = yield
    report = outcome.get_result()
    may_skip = item.get_closest_marker("gpu") is not None and not REQUIRE_GPU
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail") and not may_skip:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}), and BLOCKFS_REQUIRE_ALL=1 says nothing may skip here"


def pytest_collectreport(report):
    """Under BLOCKFS_REQUIRE_ALL=1, a module skipped whole at collection fails too."""
    if REQUIRE_ALL and report.skipped:
        report.outcome = "failed"


@pytest.fixture(scope="session", autouse=True)
def checked_index_record(tmp_path_factory):
    """Mounts made by the suite (and the servers they start) keep their record of checked indexes
    (blockfs/core/checked_indexes.py) and their index copies (blockfs/core/index_copy.py) in directories of
    the session's, never in the user's ~/.cache."""
    import os

    names = {"BLOCKFS_CHECKED_DIR": "checked-indexes", "BLOCKFS_INDEX_COPY_DIR": "index-copies"}
    saved = {name: os.environ.get(name) for name in names}
    for name, directory in names.items():
        os.environ[name] = str(tmp_path_factory.mktemp(directory))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def torch_module():
    """The torch module, or a skip (a failure under BLOCKFS_REQUIRE_ALL=1) where it is not installed."""
    require(has_torch(), "PyTorch")
    import torch

    return torch


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto) on loopback for the whole session, always stopped at the end."""
    require(
        importlib.util.find_spec("moto") is not None and importlib.util.find_spec("obstore") is not None,
        "moto[server] and obstore (pip install -e '.[test]')",
    )
    from s3server import S3Server

    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, reachable from this process and its children through the AWS variables."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    s3_server.start() if s3_server._server is None else None  # a test that stopped it and failed
    return s3_server


@pytest.fixture
def edge_tree(tmp_path) -> bytes:
    return make_edge_tree(tmp_path / "src")
