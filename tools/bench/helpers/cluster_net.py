"""N nodes and one object store on one machine, for ``tools/bench/bench_nodes.py``: network namespaces and
capped links, made with ``ip`` and ``tc`` only.

::

    this namespace ── host link (uncapped) ── STORE namespace (the S3 server, listening on all its links)
                                                │ │ │ │   one link per node, tbf-capped at store_mbit on the store's end
    NODE namespaces  n0  n1  n2  n3  ──────────────┘ │ │ │
                      │   │   │   │
                     FABRIC namespace: one bridge; each node's link capped at node_mbit on both ends

Each node has two links: its own to the store (what it fetches from the store shares only that link, as a
node's share of the store's bandwidth would) and one to the fabric bridge, where the nodes reach each other
(peers, caching proxies) at ``node_mbit``.  The store's end of every store link is capped with ``tbf`` (the
kernel here has no ``netem``); the fabric links are capped on both ends, so a node neither sends nor
receives faster than its NIC would.

A process runs inside a node with :meth:`Cluster.command`: ``nsenter --net=...`` changes the network
namespace *only*.  ``ip netns exec`` would not do for a FUSE mount: it also gives the process a mount
namespace of its own, so a mount made inside is invisible to the rest of the machine (checked: a tmpfs
mounted through ``ip netns exec`` does not appear in this namespace's ``/proc/mounts``; through ``nsenter
--net`` it does).

Needs root; raises :class:`storage_emulation.Unavailable` naming what is missing.  :meth:`Cluster.close`
(the class is a context manager) deletes every namespace and link, also a previous run's leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from typing_extensions import Self

from .storage_emulation import Unavailable, _run

PREFIX = "bfnb"  # every namespace and link this module makes starts with it (interface names: 15 chars at most)
NETNS_DIR = "/var/run/netns"


class Cluster:
    """``nodes`` node namespaces, a store namespace and a fabric bridge (see the module's text)."""

    def __init__(self, nodes: int, node_mbit: int, store_mbit: int, subnet: str = "10.219") -> None:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        for tool in ("ip", "tc", "nsenter"):
            if shutil.which(tool) is None:
                raise Unavailable(f"`{tool}` is missing (Debian: iproute2, util-linux)")
        if nodes > 200:
            raise Unavailable("at most 200 nodes")
        self.nodes, self.node_mbit, self.store_mbit = nodes, node_mbit, store_mbit
        self.store_ns, self.fabric_ns = f"{PREFIX}-store", f"{PREFIX}-fabric"
        self.node_ns = [f"{PREFIX}-n{k}" for k in range(nodes)]
        self.host_address = f"{subnet}.250.1"  # this namespace's end of the host link
        self.store_host_address = f"{subnet}.250.2"  # the store, as this namespace reaches it
        self.store_address = [f"{subnet}.{k}.1" for k in range(nodes)]  # the store, as node k reaches it
        self.node_store_address = [f"{subnet}.{k}.2" for k in range(nodes)]
        self.fabric_address = [f"{subnet}.254.{k + 1}" for k in range(nodes)]  # node k on the fabric
        self.store_link = [f"{PREFIX}s{k}" for k in range(nodes)]  # the store's end of node k's store link
        self.close()
        try:
            self._build(subnet)
        except Unavailable:
            self.close()
            raise

    def _build(self, subnet: str) -> None:
        for ns in (self.store_ns, self.fabric_ns, *self.node_ns):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        # this namespace <-> the store: uploads and the benchmark's own requests; no cap
        _run("ip", "link", "add", f"{PREFIX}h", "type", "veth", "peer", "name", f"{PREFIX}hs", "netns", self.store_ns)
        _run("ip", "addr", "add", f"{self.host_address}/30", "dev", f"{PREFIX}h")
        _run("ip", "link", "set", f"{PREFIX}h", "up")
        _run("ip", "-n", self.store_ns, "addr", "add", f"{self.store_host_address}/30", "dev", f"{PREFIX}hs")
        _run("ip", "-n", self.store_ns, "link", "set", f"{PREFIX}hs", "up")
        # the fabric: one bridge
        _run("ip", "-n", self.fabric_ns, "link", "add", f"{PREFIX}br", "type", "bridge")
        _run("ip", "-n", self.fabric_ns, "link", "set", f"{PREFIX}br", "up")
        for k, ns in enumerate(self.node_ns):
            # node k <-> the store, capped on the store's end (what the store sends to node k)
            _run(
                "ip",
                "-n",
                self.store_ns,
                "link",
                "add",
                self.store_link[k],
                "type",
                "veth",
                "peer",
                "name",
                f"{PREFIX}n{k}s",
                "netns",
                ns,
            )
            _run("ip", "-n", self.store_ns, "addr", "add", f"{self.store_address[k]}/30", "dev", self.store_link[k])
            _run("ip", "-n", self.store_ns, "link", "set", self.store_link[k], "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_store_address[k]}/30", "dev", f"{PREFIX}n{k}s")
            _run("ip", "-n", ns, "link", "set", f"{PREFIX}n{k}s", "up")
            self._cap(self.store_ns, self.store_link[k], self.store_mbit)
            # node k <-> the fabric bridge, capped on both ends
            _run(
                "ip",
                "-n",
                self.fabric_ns,
                "link",
                "add",
                f"{PREFIX}f{k}",
                "type",
                "veth",
                "peer",
                "name",
                f"{PREFIX}n{k}f",
                "netns",
                ns,
            )
            _run("ip", "-n", self.fabric_ns, "link", "set", f"{PREFIX}f{k}", "master", f"{PREFIX}br")
            _run("ip", "-n", self.fabric_ns, "link", "set", f"{PREFIX}f{k}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.fabric_address[k]}/24", "dev", f"{PREFIX}n{k}f")
            _run("ip", "-n", ns, "link", "set", f"{PREFIX}n{k}f", "up")
            self._cap(self.fabric_ns, f"{PREFIX}f{k}", self.node_mbit)
            self._cap(ns, f"{PREFIX}n{k}f", self.node_mbit)

    @staticmethod
    def _cap(ns: str, dev: str, mbit: int) -> None:
        # burst: a few packets' worth at this rate; latency bounds the queue (as a NIC's ring would)
        burst = max(32, mbit // 4)  # KiB: enough for the rate at the kernel's timer granularity
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            f"{burst}kb",
            "latency",
            "50ms",
        )

    def command(self, node: int | None, *cmd: str) -> list[str]:
        """``cmd`` run in node ``node``'s network namespace (None: the store's), this mount namespace kept."""
        ns = self.store_ns if node is None else self.node_ns[node]
        return ["nsenter", f"--net={NETNS_DIR}/{ns}", *cmd]

    def store_sent(self) -> list[int]:
        """Bytes the store has sent down each node's link so far (frames on the wire: payload, TCP/IP, HTTP)."""
        done = subprocess.run(
            ["ip", "-n", self.store_ns, "-j", "-s", "link", "show"], capture_output=True, text=True, check=True
        )
        sent = {link["ifname"]: int(link["stats64"]["tx"]["bytes"]) for link in json.loads(done.stdout)}
        return [sent.get(name, 0) for name in self.store_link]

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", f"{PREFIX}h"], capture_output=True, check=False)
        for ns in {self.store_ns, self.fabric_ns, *getattr(self, "node_ns", []), *leftovers()}:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def leftovers() -> list[str]:
    """Namespaces this module made that still exist (a run killed with SIGKILL leaves them)."""
    try:
        return sorted(name for name in os.listdir(NETNS_DIR) if name.startswith(PREFIX))
    except FileNotFoundError:
        return []
