#!/usr/bin/env bash
# Install what the tests need into .venv (tools/setup.sh), then run the whole suite with .venv's python.
# Extra arguments go to pytest (e.g. -x, -k NAME, tests/test_cli.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest -q "$@"
