"""A cluster of Varnish caches in front of an S3 store, one per node, for ``tools/bench/bench_nodes.py``.

One ``varnishd`` per node, two named listen addresses:

* ``front`` on the node's loopback, where the node's blockfs mount points its S3 endpoint: no cache
  (``pass``), the shard director (``directors.shard``, by URL) picks the object's owner among every node's
  ``owner`` address; a health probe every second takes a dead owner out of the ring (the next one serves);
* ``owner`` on the node's fabric address: caches every object whatever the request's credentials (the
  builtin VCL would pass a request with ``Authorization``), keyed by its URL alone, fetched from the store.

Varnish fetches whole objects on a miss (it drops ``Range`` going to the store and serves ranges itself),
so a store that checks a ranged request's signature refuses the fetch.

:func:`vcl` is the configuration a user writes per node; :func:`started` runs ``varnishd -F`` in the node's
namespace with its own work directory (``-n``), never the system service, and stops it on the way out.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .benchutil import stop_process

VARNISHD = "/usr/sbin/varnishd"
FRONT_PORT = 8490
OWNER_PORT = 8491
HEALTH = "/_cluster_health"


def vcl(owners: list[str], store: str) -> str:
    """The VCL for one node: ``owners`` every node's fabric address (same order on every node), ``store``
    the S3 endpoint as ``host:port`` as this node reaches it."""
    host, port = store.rsplit(":", 1)
    backends = "\n".join(
        f'backend owner{k} {{ .host = "{a}"; .port = "{OWNER_PORT}"; .probe = owner_up; }}'
        for k, a in enumerate(owners)
    )
    adds = "\n".join(f"    owners.add_backend(owner{k});" for k in range(len(owners)))
    return f"""\
vcl 4.1;
import directors;

probe owner_up {{ .url = "{HEALTH}"; .interval = 1s; .timeout = 500ms; .window = 2; .threshold = 1; .initial = 1; }}
backend store {{ .host = "{host}"; .port = "{port}"; }}
{backends}

sub vcl_init {{
    new owners = directors.shard();
{adds}
    owners.reconfigure();
}}

sub vcl_recv {{
    if (local.socket == "owner") {{
        if (req.url == "{HEALTH}") {{ return (synth(200)); }}
        set req.backend_hint = store;
        return (hash);  # cached whatever the credentials: the builtin VCL passes requests with Authorization
    }}
    set req.backend_hint = owners.backend(by=URL);
    return (pass);
}}

sub vcl_hash {{
    hash_data(req.url);
    return (lookup);
}}

sub vcl_backend_response {{
    if (bereq.backend == store) {{
        if (beresp.status != 200 && beresp.status != 206) {{  # an error (a refused signature...) is not kept
            set beresp.ttl = 0s;
            set beresp.uncacheable = true;
            return (deliver);
        }}
        set beresp.ttl = 7d;
        unset beresp.http.Set-Cookie;
        return (deliver);
    }}
}}
"""


@contextlib.contextmanager
def started(
    command_prefix: list[str], workdir: Path, text: str, owner_address: str, cache_bytes: int
) -> Iterator[subprocess.Popen]:
    """varnishd with VCL ``text`` in the foreground (``-F``), work directory ``workdir``; stopped on the way out."""
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "cluster.vcl"
    conf.write_text(text)
    log = workdir.parent / f"{workdir.name}.log"
    command = [
        *command_prefix,
        VARNISHD,
        "-F",
        "-n",
        str(workdir / "instance"),
        "-j",
        "none",
        "-a",
        f"front=127.0.0.1:{FRONT_PORT}",
        "-a",
        f"owner={owner_address}:{OWNER_PORT}",
        "-f",
        str(conf),
        "-s",
        f"malloc,{max(cache_bytes, 16 << 20)}",
        "-p",
        "thread_pools=1",
        "-p",
        "thread_pool_min=16",
        "-p",
        "thread_pool_max=200",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process(proc)


def store_bytes(workdir: Path) -> int:
    """Bytes this node's varnish has received from the store so far (headers and bodies; ``varnishstat``'s
    counters of the ``store`` backend)."""
    done = subprocess.run(
        ["varnishstat", "-n", str(workdir / "instance"), "-1", "-j"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return 0
    counters = json.loads(done.stdout)
    counters = counters.get("counters", counters)
    return sum(
        int(v["value"])
        for k, v in counters.items()
        if k.startswith("VBE.") and ".store." in k and k.endswith(("beresp_bodybytes", "beresp_hdrbytes"))
    )
