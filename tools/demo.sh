#!/usr/bin/env bash
# The main job, end to end, on a generated sample: install what is needed, generate a small learnable
# ImageFolder tree, pack it, verify it, mount it, train the unmodified example script on the mount, show
# the mount's statistics, unmount.  Safe to run again (everything lives under .demo/ and is redone).
# Runs in the checkout's .venv, which tools/setup.sh creates (PYTHON=... picks its base interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
PY=.venv/bin/python BLOCKFS=.venv/bin/blockfs

DEMO=${BLOCKFS_DEMO_DIR:-.demo}
SRC=$DEMO/src PACKED=$DEMO/packed MNT=$DEMO/mnt
mkdir -p "$DEMO" "$MNT"
# A mount left by an interrupted earlier run would make the mount point busy: clear it first.
if mountpoint -q "$MNT"; then "$BLOCKFS" umount "$MNT"; fi

echo "== generate: 2,000 learnable 32x32 images in 4 classes"
"$PY" tools/make_dataset.py "$SRC" --mode learnable --files 2000 --classes 4 --seed 0 --force
echo "== pack"
"$BLOCKFS" pack "$SRC" "$PACKED" --block-size 1MiB --force
"$BLOCKFS" verify "$PACKED"
"$BLOCKFS" info "$PACKED"

echo "== mount"
"$BLOCKFS" mount "$PACKED" "$MNT" --cache-size 64MiB
trap '"$BLOCKFS" umount "$MNT" 2>/dev/null || true' EXIT
diff -r "$SRC" "$MNT" && echo "diff -r $SRC $MNT: identical"

echo "== train the unmodified example script on the mount"
"$PY" examples/train_imagefolder.py "$MNT" --epochs 3 --seed 0

echo "== mount statistics"
"$BLOCKFS" stats "$MNT"
"$BLOCKFS" umount "$MNT"
trap - EXIT
echo "== done: unmounted $MNT"
