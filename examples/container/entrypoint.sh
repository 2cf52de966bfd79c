#!/bin/sh
# blockfs-entrypoint DATASET COMMAND...: mount DATASET (a path or a URL) at $BLOCKFS_MOUNT (default
# /mnt/dataset), run COMMAND, and unmount when it ends, whatever its exit status.  Extra `blockfs mount`
# options go in $BLOCKFS_MOUNT_OPTIONS (e.g. "--cache-size 16GiB --disk-cache /cache").
set -eu
if [ $# -lt 2 ]; then
    echo "usage: blockfs-entrypoint DATASET COMMAND..." >&2
    exit 2
fi
dataset=$1
shift
mnt=${BLOCKFS_MOUNT:-/mnt/dataset}
mkdir -p "$mnt"
# shellcheck disable=SC2086  # the options are words
blockfs mount "$dataset" "$mnt" ${BLOCKFS_MOUNT_OPTIONS:-} >&2   # its messages on stderr: stdout is the command's
status=0
"$@" || status=$?
blockfs umount "$mnt" >&2
exit "$status"
