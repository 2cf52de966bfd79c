"""blockfs/openfiles.py: the one helper that lifts the open-descriptor limit (the store's and the mount's)."""

from __future__ import annotations

import resource

import pytest

from blockfs import openfiles
from blockfs.storage.blockfiles import LocalBlockFiles


@pytest.fixture
def lowered_soft_limit():
    """The soft limit set below the hard one for the test (the hard one is never touched), then restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard - 1), hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_lifted_to_the_hard_one(lowered_soft_limit):
    openfiles.raise_open_files_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (lowered_soft_limit, lowered_soft_limit)


def test_a_refused_lift_keeps_the_soft_limit_quietly(lowered_soft_limit, monkeypatch):
    def refuse(*_args):
        raise ValueError("not allowed here")

    monkeypatch.setattr(openfiles.resource, "setrlimit", refuse)
    openfiles.raise_open_files_limit()  # no exception: EMFILE is met by closing idle descriptors
    monkeypatch.undo()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] < lowered_soft_limit


def test_a_local_store_lifts_the_limit_through_it(lowered_soft_limit, monkeypatch):
    calls = []
    monkeypatch.setattr("blockfs.storage.blockfiles.raise_open_files_limit", lambda: calls.append(1))
    LocalBlockFiles([])
    assert calls == [1]
