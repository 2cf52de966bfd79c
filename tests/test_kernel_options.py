"""blockfs.serve.fuse.kernel_options: ``-o`` on the kernel route — applied, ignored with a log line, or refused."""

from __future__ import annotations

import pytest

from blockfs.serve.fuse import kernel_options as ko


def test_what_the_kernel_takes_is_applied():
    got = ko.parse(
        [
            "allow_other",
            "default_permissions",
            "max_read=131072",
            "blksize=4096",
            "fsname=data",
            "subtype=bfs",
            "noexec",
            "noatime",
            "nodiratime",
            "ro",
            "nosuid",
            "nodev",
        ]
    )
    assert got.flags == {"allow_other", "default_permissions"}
    assert got.values == {"max_read": "131072", "blksize": "4096"}
    assert got.names == {"fsname": "data", "subtype": "bfs"}
    assert got.mount_flags == ko.MS_NOEXEC | ko.MS_NOATIME and not got.ignored
    assert got.flag_names() == ["noatime", "noexec"]


@pytest.mark.parametrize("item", sorted(ko.LIBFUSE_ONLY))
def test_each_libfuse_only_setting_is_ignored_not_refused(item):
    assert ko.parse([item, "fsname=x"]).ignored == [item]


@pytest.mark.parametrize(
    "items",
    [
        ["uid=0"],
        ["direct_io"],
        ["allow_root"],
        ["auto_unmount"],
        ["max_read=lots"],
        ["fsname="],
        ["allow_other=1"],
        ["entry_timeout=1", "debug"],
    ],
)
def test_the_rest_is_refused_in_one_line_naming_each(items):
    with pytest.raises(ko.OptionRefused) as refused:
        ko.parse(["fsname=ok", *items])
    text = str(refused.value)
    assert "\n" not in text and all(repr(i) in text for i in items) and "--fuse mfusepy" in text, text
    assert "fsname=ok" not in text.split("(")[0]
