"""blockfs.serve.view: the mount's one namespace, in-process (no FUSE adapter, no kernel): nodes of the
dataset and of the control directory, one attribute type, listings in bulk, errors as errno values, the
keep-pages decision, the forgetting of dropped snapshots and the statistics."""

from __future__ import annotations

import errno
import logging
import os
import stat

import numpy as np
import pytest
from polling import wait_until
from treeutil import make_edge_tree

import blockfs
from blockfs import protocol
from blockfs.core.dataset import PackedDataset
from blockfs.errors import CorruptBlockError, EntryNotFoundError
from blockfs.serve import view as view_module
from blockfs.serve.cache.block_cache import BlockCache
from blockfs.serve.control import control_dir
from blockfs.serve.mount_options import MountOptions
from blockfs.serve.view import ROOT, Attr, MountView, Route

CTL = os.fsencode(protocol.DEFAULT_CONTROL)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    src = make_edge_tree(root / "src")
    blockfs.pack(root / "src", root / "packed", block_size=4096, fsync=False)
    return root / "packed", src


def make_view(dest, open_mode: str = "enosys", stats=None) -> tuple[MountView, PackedDataset, BlockCache]:
    ds = PackedDataset(dest)
    cache = BlockCache(ds.store, 1 << 20, lock_memory=False)
    options = MountOptions(cache_bytes=1 << 20, prefill=False, lock_memory=False)
    route = Route({"binding": "test", "open_mode": open_mode}, open_mode, stats=stats)
    return MountView(ds.reading_through(cache), cache, options, route, prefetch_address=b"\0p"), ds, cache


@pytest.fixture
def view(packed):
    v, ds, cache = make_view(packed[0])
    yield v
    v.close()
    cache.close()
    ds.close()


def test_nodes_of_both_layers_are_looked_up_by_path_and_by_name(view):
    n = view.n_entries
    assert view.lookup(b"/") == ROOT and view.lookup(b"/class_a/one.txt") == view.child(
        view.lookup(b"/class_a"), b"one.txt"
    )
    assert view.lookup(b"/" + CTL) == view.child(ROOT, CTL) == n  # the control directory's first node
    stats = view.lookup(b"/" + CTL + b"/stats.json")
    assert stats > n and view.child(n, b"stats.json") == stats
    assert view.child(ROOT, b"nope") == -1  # a name the dataset lacks: a negative entry
    with pytest.raises(EntryNotFoundError):
        view.child(n, b"nope")  # a name the control directory lacks: an error (its snapshots come and go)
    with pytest.raises(EntryNotFoundError):
        view.lookup(b"/nope")
    assert view.parent(stats) == n and view.parent(n) == ROOT and view.parent(view.lookup(b"/class_a")) == ROOT


def test_one_attribute_type_for_both_layers(view, packed):
    _, src = packed
    one = view.attr(view.lookup(b"/class_a/one.txt"))
    ctl = view.attr(view.lookup(b"/" + CTL))
    link = view.attr(view.lookup(b"/" + CTL + b"/stats.json"))
    assert type(one) is type(ctl) is type(link) is Attr
    assert one.size == os.lstat(os.path.join(src, b"class_a/one.txt")).st_size and stat.S_ISREG(one.mode)
    assert stat.S_ISDIR(ctl.mode) and stat.S_ISLNK(link.mode) and ctl.ino != one.ino
    assert view.attr(view.lookup(b"/class_a/link_rel")).size == len(b"one.txt")  # a link's size: its target's


def test_listings_in_bulk_match_the_one_by_one_answers(view, packed):
    _, src = packed
    d = view.lookup(b"/class_b")
    whole = view.listing(d)
    names = [whole.table[s : s + k].tobytes() for s, k in zip(whole.start.tolist(), whole.length.tolist(), strict=True)]
    assert sorted(names) == sorted(os.listdir(os.path.join(src, b"class_b")))
    assert view.child_names(d) == b"".join(name + b"\0" for name in names) and view.n_children(d) == len(names)
    for node, name, row in zip(whole.nodes.tolist(), names, whole.attrs, strict=True):
        assert view.child(d, name) == node and tuple(row.tolist()) == tuple(view.attr(node))
    part = view.listing(d, 1, 3)
    assert part.nodes.tolist() == whole.nodes[1:3].tolist() and np.array_equal(part.attrs, whole.attrs[1:3])
    assert CTL not in view.child_names(ROOT).split(b"\0")  # the control directory is not listed


def test_the_control_layer_lists_by_node_too(view):
    ctl = view.lookup(b"/" + CTL)
    listed = view.listing(ctl)
    names = [
        listed.table[s : s + k].tobytes() for s, k in zip(listed.start.tolist(), listed.length.tolist(), strict=True)
    ]
    assert names == [b"blocks", b"index.bfi", b"metadata.json", b"stats.json"]
    assert [view.child(ctl, name) for name in names] == listed.nodes.tolist()
    assert listed.attrs["ino"].tolist() == [view.attr(node).ino for node in listed.nodes.tolist()]
    blocks = view.lookup(b"/" + CTL + b"/blocks")
    assert view.n_children(blocks) == view.ds.n_blocks and view.is_dir(blocks) and not view.is_dir(listed.nodes[1])
    with pytest.raises(OSError) as raised:
        view.n_children(view.lookup(b"/" + CTL + b"/metadata.json"))
    assert raised.value.errno == errno.ENOTDIR


def test_bytes_links_and_extended_attributes_of_both_layers(view, packed):
    _, src = packed
    assert view.read(view.lookup(b"/class_a/one.txt"), 0, 100) == b"hello\n"
    ctl = b"/" + CTL
    meta = view.read(view.lookup(ctl + b"/metadata.json"), 0, 1 << 20)
    assert meta == view.ds.metadata_bytes
    snapshot = view.readlink(view.lookup(ctl + b"/stats.json"))
    assert view.read(view.lookup(ctl + b"/" + snapshot), 0, 1 << 20).startswith(b"{")
    assert view.getxattr(ROOT, protocol.CONTROL_XATTR) == CTL
    assert view.getxattr(view.lookup(ctl), protocol.PREFETCH_XATTR) == b"\0p"  # given when the view was made
    assert protocol.BLOCK_XATTR in view.listxattr(view.lookup(b"/class_a/one.txt"))
    assert view.in_memory(view.lookup(ctl + b"/metadata.json"))
    assert not view.in_memory(view.lookup(ctl + b"/blocks/00000000"))  # read through the cache: may wait


def test_errors_become_errno_values_with_the_error_log_told(view, caplog):
    assert view.report(EntryNotFoundError("x")) == errno.ENOENT
    assert view.report(OSError(errno.EINVAL, "x")) == errno.EINVAL
    assert view.report(OSError("no errno")) == errno.EIO
    assert view.report(CorruptBlockError("block 3: damaged", block=3)) == errno.EIO
    assert view.error_log.stats()["damaged_blocks_reported"] == [3]
    with caplog.at_level(logging.ERROR, logger="blockfs.serve.view"):
        assert view.report(RuntimeError("a bug"), "read of node 5") == errno.EIO
    said = [r for r in caplog.records if r.name == "blockfs.serve.view"]
    assert [r.getMessage() for r in said] == ["unexpected error in read of node 5; answering EIO"] and said[0].exc_info
    for call, expected in [
        (lambda: view.readlink(view.lookup(b"/class_a/one.txt")), errno.EINVAL),
        (lambda: view.getxattr(view.lookup(b"/class_a"), "user.x"), errno.ENODATA),
        (lambda: view.read(view.lookup(b"/class_a"), 0, 1), errno.EISDIR),
    ]:
        with pytest.raises(Exception) as raised:
            call()
        assert view.report(raised.value) == expected


@pytest.mark.parametrize(
    "mode, keeps_files", [("enosys", True), ("keep_cache", True), ("none", False), ("targets", True)]
)
def test_one_keep_pages_decision_by_open_mode(packed, mode, keeps_files):
    v, ds, cache = make_view(packed[0], open_mode=mode)
    try:
        assert v.keep_pages(v.lookup(b"/class_a/one.txt")) == keeps_files  # targets: no plan, all of it kept
        assert v.keep_pages(v.lookup(b"/" + CTL + b"/metadata.json"))  # control files: always (fixed bytes)
    finally:
        v.close(), cache.close(), ds.close()


def test_dropped_snapshots_are_handed_to_the_routes_forget_by_node(packed, monkeypatch):
    monkeypatch.setattr(view_module, "FORGET_INTERVAL_S", 0.01)
    monkeypatch.setattr(control_dir, "SNAPSHOTS_MAX", control_dir.SNAPSHOTS_KEPT)
    v, ds, cache = make_view(packed[0], stats=lambda: {"page_cache": {"files_pushed": 7}})
    forgotten: list[tuple[int, bytes, bytes]] = []
    try:
        v.start_serving("a test", lambda parent, name, path: forgotten.append((parent, name, path)))
        link = v.lookup(b"/" + CTL + b"/stats.json")
        first = v.readlink(link)
        for _ in range(control_dir.SNAPSHOTS_KEPT):
            v.readlink(link)
        wait_until(lambda: forgotten, "the dropped snapshot forgotten")
        parent, name, path = forgotten[0]
        assert parent == v.lookup(b"/" + CTL + b"/stats") and path == b"/" + CTL + b"/" + first
        assert path.endswith(b"/" + name)
        stats = v.stats()
        assert stats["page_cache"] == {"files_pushed": 7} and stats["mount"]["binding"] == "test"  # the route's
    finally:
        v.close(), cache.close(), ds.close()
