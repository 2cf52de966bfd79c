#!/usr/bin/env bash
# Install what the tests need into .venv (tools/setup.sh), then run the whole suite with .venv's python, in
# two steps: every test on BLOCKFS_TEST_WORKERS pytest-xdist workers (default 4: most tests wait on FUSE
# round trips, servers and subprocesses, so more workers than cores pays on 2 cores), a file to a worker
# (--dist loadfile: a module's fixtures are made once; worksteal, which splits files, cost 9-26% more CPU
# and was slower here); then the tests marked serial, alone (those
# that time a wait or count what other processes move; see tests/conftest.py).  BLOCKFS_TEST_WORKERS=0:
# one process, serial tests included, as plain pytest.  Extra arguments go to pytest in both steps (e.g.
# -x, -k NAME, -m fuse, tests/test_cli.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# Bytecode is cached (__pycache__, ignored by git) even where PYTHONDONTWRITEBYTECODE is set: without it
# every pytest process rewrites and compiles every test module (~8 s of CPU each) and every mount or
# example the suite starts compiles blockfs anew.
unset PYTHONDONTWRITEBYTECODE
workers=${BLOCKFS_TEST_WORKERS:-4}
if [ "$workers" = 0 ]; then exec .venv/bin/python -m pytest -q "$@"; fi
par=0 ser=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@" || par=$?
.venv/bin/python -m pytest -q --only-serial "$@" || ser=$?
# pytest exits 5 when a step selects no test (no serial test among those asked for): an error only if both do.
if [ "$par" = 5 ] && [ "$ser" = 5 ]; then exit 5; fi
for rc in "$par" "$ser"; do if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi; done
