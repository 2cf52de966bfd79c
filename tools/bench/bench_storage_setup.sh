#!/usr/bin/env bash
# Install what tools/bench/bench_storage.py compares blockfs with, into the project's .venv (after tools/setup.sh):
# ratarmount, squashfuse_ll, s3fs-fuse, rclone, MosaicML Streaming, WebDataset, and hadro (the S3 server the
# object-store runs read from).  Debian/Ubuntu, root (apt-get).  Safe to run again.
#
#   bash tools/setup.sh && bash tools/bench/bench_storage_setup.sh && sudo .venv/bin/python tools/bench/bench_storage.py
#
# MosaicML Streaming is installed without its declared dependencies: it asks for torchvision, which has no
# build for the CPU torch setup.sh installs, and pip would replace that torch with a CUDA one to get it.
# Its other dependencies that an S3 run imports are installed by name.
set -euo pipefail
cd "$(dirname "$0")/../.."
VPY=$PWD/.venv/bin/python
[ -x "$VPY" ] || { echo "bench_storage_setup: run tools/setup.sh first (no .venv)" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for pair in squashfuse_ll:squashfuse mksquashfs:squashfs-tools s3fs:s3fs rclone:rclone ip:iproute2 tc:iproute2 curl:curl; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench_storage_setup: installing ${missing[*]} (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

have() { "$VPY" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$1" >/dev/null 2>&1; }
want=()
for p in ratarmount webdataset hadro matplotlib; do have "$p" || want+=("$p"); done
if [ ${#want[@]} -gt 0 ]; then "$VPY" -m pip install -q "${want[@]}"; fi
if ! have mosaicml-streaming; then
  "$VPY" -m pip install -q --no-deps "mosaicml-streaming==0.13.0"
  "$VPY" -m pip install -q boto3 brotli python-snappy tqdm "transformers<5" xxhash zstd catalogue
fi
"$VPY" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' ||
  { echo "bench_storage_setup: a CUDA torch got into .venv: run tools/setup.sh again" >&2; exit 1; }
echo "bench_storage_setup: ready (sudo .venv/bin/python tools/bench/bench_storage.py)"
