#!/usr/bin/env bash
# Install what tools/bench/bench_nodes.py compares blockfs's peer tier with: nginx (proxy_cache, slice,
# upstream hash ... consistent) and Varnish (shard director), from Debian, plus iproute2 for the network
# namespaces.  Debian/Ubuntu, root (apt-get).  Safe to run again.  Benchmarks only: blockfs needs none of it.
#
#   bash tools/setup.sh && bash tools/bench/bench_nodes_setup.sh && sudo .venv/bin/python tools/bench/bench_nodes.py
#
# The packages' own services are kept from starting (a policy-rc.d for the length of the install, when none
# is there): the benchmark starts its own nginx and varnishd with their own configuration in a temp dir.
set -euo pipefail
cd "$(dirname "$0")/../.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for pair in nginx:nginx-light varnishd:varnish ip:iproute2 tc:iproute2; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench_nodes_setup: installing ${missing[*]} (apt-get)"
  policy=/usr/sbin/policy-rc.d
  added=
  if [ ! -e $policy ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee $policy >/dev/null
    as_root chmod 755 $policy
    added=yes
  fi
  trap '[ -n "$added" ] && as_root rm -f '"$policy" EXIT
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
/usr/sbin/nginx -V 2>&1 | tr ' ' '\n' | grep -q -- '--with-http_slice_module' ||
  echo "bench_nodes_setup: note: this nginx has no slice module; the nginx mode caches whole responses" >&2
echo "bench_nodes_setup: ready (sudo .venv/bin/python tools/bench/bench_nodes.py)"
