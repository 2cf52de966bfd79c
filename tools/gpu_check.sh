#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI has not: every test of the loader and of the training examples
# (their batches go to the GPU where there is one: device=None picks CUDA), the tests marked gpu among
# them made to fail rather than skip (BLOCKFS_REQUIRE_GPU=1, tests/capability.py), and the suite's rules
# for that switch.
#
#     PYTHON=/path/to/python bash tools/gpu_check.sh [PYTEST ARGS]
#
# PYTHON: an interpreter whose torch is a CUDA build and that has blockfs's requirements (default .venv's,
# which tools/setup.sh makes with torch's CPU build: on a GPU machine, name another). Tests that mount
# need /dev/fuse as the rest of the suite does.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
"$python" - <<'PY'
import torch

if not torch.cuda.is_available():
    raise SystemExit(
        f"gpu_check.sh: torch {torch.__version__} sees no CUDA GPU here: "
        "run it on a GPU machine, with PYTHON= an interpreter whose torch is a CUDA build"
    )
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
export BLOCKFS_REQUIRE_GPU=1
unset PYTHONDONTWRITEBYTECODE
exec "$python" -m pytest -q -n "${BLOCKFS_TEST_WORKERS:-4}" \
    tests/test_loader.py tests/test_train_example.py tests/test_suite_rules.py "$@"
