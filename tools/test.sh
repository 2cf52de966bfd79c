#!/usr/bin/env bash
# Install what the tests need (tools/setup.sh), then run the whole suite.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
