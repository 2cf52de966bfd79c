#!/usr/bin/env bash
# Install everything blockfs needs on a fresh Debian/Ubuntu machine: the FUSE libraries (libfuse 3 and
# libfuse 2), PyTorch's CPU build (before the project, so pip never pulls CUDA wheels), and blockfs with
# its test and loader extras.  Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${BLOCKFS_TORCH_VERSION:-2.13.0}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
ldconfig -p 2>/dev/null | grep 'libfuse\.so\.2' >/dev/null || missing+=(libfuse2)  # no grep -q: pipefail + SIGPIPE
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]} (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION (CPU build)"
  "$PYTHON" -m pip install -q "torch==$TORCH_VERSION"
fi

# Reinstall when blockfs is missing, or installed from another checkout than this one.
here=$PWD
if ! (cd / && "$PYTHON" -c "import blockfs, hypothesis, PIL, fuse, mfusepy, os, sys
sys.exit(os.path.dirname(blockfs.__file__) != os.path.join(sys.argv[1], 'blockfs'))" "$here") 2>/dev/null; then
  echo "setup: installing blockfs and its test extras"
  "$PYTHON" -m pip install -q -e ".[torch,test]"
fi
echo "setup: ready ($("$PYTHON" -c 'import blockfs, torch; print("blockfs", blockfs.__version__, "torch", torch.__version__)'))"
