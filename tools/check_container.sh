#!/usr/bin/env bash
# Build examples/container/Dockerfile and run its entrypoint on a sample dataset in a real container:
# the image packs the sample, mounts it through /dev/fuse inside the container (--device /dev/fuse
# --cap-add SYS_ADMIN, as the README says), and every file read there must have the bytes written here.
#
#   sudo bash tools/check_container.sh                   # base image: the Dockerfile's (python:3.12-slim)
#   sudo bash tools/check_container.sh --base IMAGE      # any Debian-based image with python3 and venv
#   sudo bash tools/check_container.sh --debootstrap     # no registry: a Debian base built here
#   ... --with-torch                                     # also install PyTorch as the Dockerfile does
#
# Needs root and a Docker engine: on Debian/Ubuntu `apt-get install docker.io` (and `debootstrap` for
# --debootstrap; it is installed on the fly when missing).  Where no Docker engine answers, one is started for this run only (its own
# data root, socket and pid file in a temporary directory; vfs storage, no bridge) and stopped at the
# end.  --debootstrap builds a minimal Debian bookworm base with debootstrap (apt-get installs it) and
# gives it this machine's CA bundle, so pip in the build trusts what the host trusts.  Everything made
# (images, containers, the engine, the work directory) is removed on exit.  Without --with-torch the
# image is built with TORCH= EXTRAS=remote: PyTorch's wheels are several GB, and the check is the mount.
set -euo pipefail
cd "$(dirname "$0")/.."

base="" debootstrap=no torch=no
while [ $# -gt 0 ]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    --debootstrap) debootstrap=yes; shift ;;
    --with-torch) torch=yes; shift ;;
    *) echo "check_container: unknown argument $1 (see the comment at the top of $0)" >&2; exit 2 ;;
  esac
done
say() { echo "check_container: $*"; }
die() { echo "check_container: error: $*" >&2; exit 1; }
INSTALL="on Debian/Ubuntu: apt-get install docker.io debootstrap (elsewhere: Docker Engine, docs.docker.com/engine/install)"
[ "$(id -u)" = 0 ] || die "needs root (a Docker engine, and FUSE inside the container): run it with sudo"
command -v docker >/dev/null || die "no docker command: install a Docker engine, $INSTALL"

work=$(mktemp -d /tmp/blockfs-container.XXXXXX)
tag="blockfs-check-$$"
engine_pid=""
cleanup() {
  docker image rm -f "$tag:image" "$tag:base" >/dev/null 2>&1 || true
  if [ -n "$engine_pid" ]; then
    kill "$engine_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$engine_pid" 2>/dev/null || break; sleep 0.1; done
    # the engine's own mounts under its data root (vfs layers, netns) before the directory goes
    grep -o " $work/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null ||
    die "no Docker engine answers and there is no dockerd to start: start yours, or install one, $INSTALL"
  say "starting a Docker engine for this run ($work/engine)"
  mkdir -p "$work/engine"
  dockerd --data-root "$work/engine/data" --exec-root "$work/engine/exec" --pidfile "$work/engine/dockerd.pid" \
    -H "unix://$work/engine/docker.sock" --iptables=false --bridge=none --storage-driver=vfs \
    >"$work/engine/dockerd.log" 2>&1 &
  engine_pid=$!
  export DOCKER_HOST="unix://$work/engine/docker.sock"
  for _ in $(seq 300); do docker info >/dev/null 2>&1 && break; sleep 0.1; done
  docker info >/dev/null 2>&1 || die "the Docker engine did not start: $(tail -3 "$work/engine/dockerd.log")"
fi

build_args=()
if [ "$debootstrap" = yes ]; then
  command -v debootstrap >/dev/null || { say "installing debootstrap"; apt-get install -y -qq debootstrap >/dev/null; }
  say "building a Debian bookworm base with debootstrap"
  debootstrap --variant=minbase --include=python3,python3-venv,fuse3,ca-certificates bookworm \
    "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 ||
    die "debootstrap failed: $(tail -3 "$work/debootstrap.log")"
  cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -f "$work"/rootfs/var/cache/apt/archives/*.deb
  tar -C "$work/rootfs" -c . | docker import - "$tag:base" >/dev/null
  rm -rf "$work/rootfs"
  base="$tag:base"
fi
[ -n "$base" ] && build_args+=(--build-arg "BASE=$base")
[ "$torch" = yes ] || build_args+=(--build-arg "TORCH=" --build-arg "EXTRAS=remote")

say "docker build -f examples/container/Dockerfile ${build_args[*]} (minutes: a line per step)"
# The classic builder's "Step N/M : ..." lines, one per step and cut short, so minutes of pip show as progress.
set +e
DOCKER_BUILDKIT=0 docker build --network host -f examples/container/Dockerfile -t "$tag:image" "${build_args[@]}" . 2>&1 |
  tee "$work/build.log" | { grep --line-buffered -E '^Step [0-9]+/[0-9]+ : ' || true; } |
  sed -u -E 's/^(.{0,100}).*/check_container: build: \1/'
built=${PIPESTATUS[0]}
set -e
[ "$built" = 0 ] || die "the image did not build: $(tail -5 "$work/build.log")"

# A sample tree (odd names included), its checksums here, and its pack by the image's own blockfs.
mkdir -p "$work/data/tree/cat" "$work/data/tree/dog/é ü" "$work/data/tree/empty"
for i in $(seq 1 40); do
  head -c $((RANDOM * 3 + i)) /dev/urandom >"$work/data/tree/cat/$i.jpg"
  head -c $((RANDOM + i)) /dev/urandom >"$work/data/tree/dog/é ü/$i.png"
done
: >"$work/data/tree/empty/zero"
(cd "$work/data/tree" && find . -type f -print0 | sort -z | xargs -0 md5sum) >"$work/host.md5"
docker run --rm --network none -v "$work/data:/data" --entrypoint blockfs "$tag:image" \
  pack -q /data/tree /data/sample.blockfs

say "docker run --device /dev/fuse --cap-add SYS_ADMIN ... blockfs-entrypoint /data/sample.blockfs md5sum"
docker run --rm --network none --device /dev/fuse --cap-add SYS_ADMIN --security-opt apparmor:unconfined \
  -v "$work/data:/data:ro" "$tag:image" /data/sample.blockfs \
  sh -c 'cd /mnt/dataset && find . -type f -print0 | sort -z | xargs -0 md5sum' >"$work/container.md5" 2>"$work/run.log" ||
  die "the container failed: $(tail -5 "$work/run.log")"
if ! cmp -s "$work/host.md5" "$work/container.md5"; then
  diff "$work/host.md5" "$work/container.md5" | head -5 >&2
  die "the files read through the container's mount differ from the ones packed"
fi
say "ok: $(wc -l <"$work/host.md5") files read through the mount in the container, every byte as packed"
