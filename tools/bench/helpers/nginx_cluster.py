"""A cluster of caching nginx proxies in front of an S3 store, one per node, for ``tools/bench/bench_nodes.py``.

Each node's nginx has two servers:

* the **front**, on the node's loopback, where the node's blockfs mount sends its S3 requests (its
  ``endpoint``): no cache, ``upstream ... hash $uri consistent`` over every node's owner server, so each
  object (a block) has one owner in the cluster; a dead owner is skipped (``proxy_next_upstream``) and the
  next one on the ring serves the block, from its cache or the store;
* the **owner cache**, on the node's fabric address: ``proxy_cache`` keyed by the object's path (``$uri``),
  ``proxy_cache_lock`` (one fetch per object at a time: the other requests for it wait), a cache as large as
  the node's budget; the store behind it.  With ``slice_bytes`` the ``slice`` module caches objects in
  pieces of that size (for objects larger than a block; blockfs's objects are blocks, whole).

``pass_range``: the owner sends the client's ``Range`` to the store unchanged and caches each range
apart (keyed ``$uri$http_range``), so a signed ranged GET reaches the store as signed.

``keep_host``: both hops pass the client's ``Host`` header on (``proxy_set_header Host $http_host``), so a
request signed by the client (SigV4 signs the host) reaches the store as signed; nginx's default sends the
upstream's name instead.  nginx's cache also drops ``Range`` (and the slice module rewrites it) on the way
to the store, which a store checking signatures may refuse when the client signed it.

:func:`config` is the whole configuration a user would write per node (the benchmark's doc quotes it);
:func:`started` runs ``nginx -p PREFIX -c nginx.conf -g 'daemon off;'`` in the node's namespace, never the
system service, and stops it on the way out.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .benchutil import stop_process

NGINX = "/usr/sbin/nginx"
FRONT_PORT = 8480  # on each node's loopback
OWNER_PORT = 8481  # on each node's fabric address
WORKER_USER = "www-data"


def config(
    prefix: Path,
    owner_address: str,
    owners: list[str],
    store: str,
    cache_bytes: int,
    *,
    keep_host: bool = True,
    slice_bytes: int = 0,
    pass_range: bool = False,
) -> str:
    """nginx.conf for one node: ``owner_address`` its fabric address, ``owners`` every node's (same order on
    every node), ``store`` the S3 endpoint as ``host:port`` as this node reaches it."""
    # proxy_set_header is inherited only by a block that sets none itself: every location sets all of its own
    headers = '            proxy_set_header Connection "";\n'
    headers += "            proxy_set_header Host $http_host;\n" if keep_host else ""
    servers = "\n".join(f"        server {a}:{OWNER_PORT} max_fails=1 fail_timeout=10s;" for a in owners)
    if slice_bytes:
        caching = (
            f"            slice {slice_bytes};\n"
            "            proxy_cache_key $uri$slice_range;\n"
            "            proxy_set_header Range $slice_range;\n"
        )
    elif pass_range:  # the client's Range to the store as signed; each range cached apart
        caching = "            proxy_cache_key $uri$http_range;\n            proxy_set_header Range $http_range;\n"
    else:
        caching = "            proxy_cache_key $uri;\n"
    return f"""\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    log_format owner '$request_uri $status $upstream_cache_status $body_bytes_sent range=$http_range up=$upstream_bytes_received st=$upstream_status';
    proxy_cache_path {prefix}/cache levels=1:2 keys_zone=blocks:16m max_size={cache_bytes} inactive=7d use_temp_path=off;
    proxy_http_version 1.1;
    upstream owners {{
        hash $uri consistent;
{servers}
        keepalive 32;
    }}
    upstream store {{
        server {store};
        keepalive 32;
    }}

    # the front: this node's blockfs points its S3 endpoint here
    server {{
        listen 127.0.0.1:{FRONT_PORT};
        location / {{
{headers}            proxy_pass http://owners;
            proxy_next_upstream error timeout http_502 http_504;
            proxy_connect_timeout 1s;
            proxy_read_timeout 30s;
        }}
    }}

    # the owner cache: the blocks this node owns, for every node
    server {{
        listen {owner_address}:{OWNER_PORT};
        access_log {prefix}/owner.log owner;
        location / {{
{caching}{headers}            proxy_cache blocks;
            proxy_cache_valid 200 206 7d;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 60s;
            proxy_cache_lock_age 60s;
            proxy_ignore_headers Cache-Control Expires Set-Cookie;
            proxy_force_ranges on;
            proxy_pass http://store;
        }}
    }}
}}
"""


@contextlib.contextmanager
def started(command_prefix: list[str], prefix: Path, text: str) -> Iterator[subprocess.Popen]:
    """nginx with configuration ``text`` under ``prefix`` (``command_prefix``: e.g. the node's nsenter), in the
    foreground as a child of this process; stopped (SIGTERM, then SIGKILL) on the way out.  The directories
    above ``prefix`` must let nginx's worker user through (mode 0711)."""
    for sub in ("tmp", "cache"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:  # nginx's workers run as its user (Debian: www-data): they write the cache
        try:
            worker = pwd.getpwnam(WORKER_USER)
        except KeyError:
            pass
        else:
            for path in (prefix, prefix / "tmp", prefix / "cache"):
                os.chown(path, worker.pw_uid, worker.pw_gid)
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    log = prefix / "stderr.log"
    with open(log, "ab") as out:
        check = subprocess.run(
            [*command_prefix, NGINX, "-t", "-q", "-p", str(prefix), "-c", str(conf)],
            stdout=out,
            stderr=out,
            check=False,
        )
        if check.returncode != 0:
            raise RuntimeError(f"nginx refused {conf}: {log.read_text(errors='replace').strip()[-400:]}")
        proc = subprocess.Popen(
            [*command_prefix, NGINX, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_process(proc)


_UP = re.compile(r"up=([0-9, :-]+) st=")


def upstream_bytes(prefix: Path) -> int:
    """Bytes this node's owner cache has received from the store so far (its log's ``$upstream_bytes_received``:
    responses whole, headers included; a request tried on several upstreams lists each)."""
    log = prefix / "owner.log"
    if not log.exists():
        return 0
    total = 0
    for match in _UP.finditer(log.read_text(errors="replace")):
        total += sum(int(x) for x in re.findall(r"\d+", match.group(1)))
    return total


def cached_range(prefix: Path) -> tuple[str, str] | None:
    """The path and ``Range`` of a request the store answered 206 to (a cached range), if any."""
    log = prefix / "owner.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        found = re.match(r"(\S+) .* range=(bytes=\S+) up=.* st=206$", line)
        if found:
            return found.group(1), found.group(2)
    return None


def cache_statuses(prefix: Path) -> dict[str, int]:
    """How many of the owner cache's requests were HIT, MISS, ... so far."""
    out: dict[str, int] = {}
    log = prefix / "owner.log"
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 2:
                out[parts[2]] = out.get(parts[2], 0) + 1
    return out
