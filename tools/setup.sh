#!/usr/bin/env bash
# Install everything blockfs needs on a fresh Debian/Ubuntu machine: the FUSE libraries (libfuse 3 and
# libfuse 2) system-wide, and a virtual environment in the checkout (.venv) holding PyTorch's CPU build
# (installed before the project, so no CUDA wheels are pulled) and blockfs, editable, with its torch and
# test extras.  Everything Python goes into .venv because a distribution's own python3 refuses `pip
# install` (PEP 668, Debian 12 and Ubuntu 23.04 on) and may have no pip at all.  The installer is uv (from
# PyPI, into .venv: it resolves and installs the ~80 packages in seconds where pip took minutes), or pip
# where uv cannot be installed; the torch wheel itself always comes through pip, which reads this machine's
# pip configuration (a local wheel, a mirror) that uv does not.
#
#   bash tools/setup.sh                        # base interpreter: python3 on PATH
#   PYTHON=/opt/python3.12/bin/python3 bash tools/setup.sh   # any Python >= 3.10; rebuilds .venv with it
#
# Safe to run again: each step is skipped when already done.  Afterwards: .venv/bin/blockfs, or
# `source .venv/bin/activate` and then `blockfs`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_GIVEN=${PYTHON:+yes}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${BLOCKFS_TORCH_VERSION:-2.13.0}
VENV=$PWD/.venv
VPY=$VENV/bin/python

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "$* missing and no apt-get here: install them with your package manager"
  say "installing $* (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- system packages: FUSE ---------------------------------------------------------------------------
missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
ldconfig -p 2>/dev/null | grep 'libfuse\.so\.2' >/dev/null || missing+=(libfuse2)  # no grep -q: pipefail + SIGPIPE
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

# --- the virtual environment -------------------------------------------------------------------------
venv_works() { [ -x "$VPY" ] && "$VPY" -c 'import pip' >/dev/null 2>&1; }
same_base() {  # is .venv built on $PYTHON?  (only asked when PYTHON was given)
  [ "$("$VPY" -c 'import os, sys; print(os.path.realpath(sys._base_executable))' 2>/dev/null)" = \
    "$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null)" ]
}

if venv_works && { [ -z "$PYTHON_GIVEN" ] || same_base; }; then
  :  # already there
else
  version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    die "cannot run '$PYTHON': install Python >= 3.10, or set PYTHON=/path/to/python3"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    die "$PYTHON is Python $version: blockfs needs Python >= 3.10 (set PYTHON=/path/to/python3.10+)"
  # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a separate package.
  if ! "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    packages=(python3-venv)
    if apt-cache show "python$version-venv" >/dev/null 2>&1; then packages+=("python$version-venv"); fi
    apt_install "${packages[@]}"
    "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1 ||
      die "$PYTHON has no working venv module (ensurepip missing): install its venv package, or set PYTHON to another Python >= 3.10"
  fi
  if [ -e "$VENV" ]; then say "rebuilding .venv with $PYTHON"; rm -rf "$VENV"; fi
  say "creating .venv with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PYTHON" -m venv "$VENV"
fi

# --- the installer: uv where it can be had, else pip ----------------------------------------------------
# Neither byte-compiles what it installs (pip one file after another took ~40 s of CPU here; uv does not by
# default): warm_imports then compiles what the package and its tests import, by importing it once.  The
# stamp is removed before an install and written after the imports, so an interrupted run compiles next time.
compiled=$VENV/.compiled
UV=$VENV/bin/uv
if ! "$UV" --version >/dev/null 2>&1; then
  say "installing uv (the installer) into .venv"
  "$VPY" -m pip install -q uv >/dev/null 2>&1 || say "uv could not be installed: installing with pip"
fi
# uv reads none of pip's configuration (pip.conf's index, certificate, proxy; PIP_CERT): where only pip can
# reach an index (a mirror, a proxy), uv fails, and pip installs instead.
pip_install() {
  rm -f "$compiled"
  if "$UV" --version >/dev/null 2>&1; then
    # The platform's certificates (UV_SYSTEM_CERTS), as pip uses: uv's own roots refuse a network whose TLS
    # goes through a local authority.  Whatever uv cannot do, pip does.
    UV_SYSTEM_CERTS=1 "$UV" pip install -q --python "$VPY" "$@" && return 0
    say "uv could not install $*: installing with pip"
  fi
  "$VPY" -m pip install -q --no-compile "$@"
}
# Compiling all of site-packages (10,000 modules: sympy's, every moto service's) took ~75 s of CPU; importing
# what the suite imports compiles ~1,500, and the first process that imports anything else compiles it.  A
# distribution may set PYTHONDONTWRITEBYTECODE: unset here, or nothing would be written.
warm_imports() {
  (cd / && env -u PYTHONDONTWRITEBYTECODE "$VPY" -W ignore -c "
import importlib
for name in ('torch', 'numpy', 'PIL.Image', 'hypothesis', 'pytest', 'xdist', 'fuse', 'mfusepy', 'obstore',
             'boto3', 'botocore.session', 'yaml', 'tqdm', 'blake3', 'zlib_ng', 'moto.server', 'moto.s3.responses'):
    try:
        importlib.import_module(name)
    except ImportError:
        pass  # an optional one missing (obstore before Python 3.11): the setup's own checks name what must be there
") >/dev/null 2>&1 || true
  touch "$compiled"
}

# --- torch, CPU build, before the project ------------------------------------------------------------
# Versions are read from the installed metadata: importing torch takes seconds.
version_of() { "$VPY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true; }
# On Linux, PyPI's torch is the CUDA build: ask for the CPU build by its local version (+cpu), which
# only PyTorch's CPU index (or a local wheel) has, so pip fails rather than fetch CUDA wheels.
torch_want=$TORCH_VERSION torch_from=()
if [ "$(uname -s)" = Linux ]; then
  torch_want=$TORCH_VERSION+cpu torch_from=(--extra-index-url "${BLOCKFS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}")
fi
if [ "$(version_of torch)" != "$torch_want" ]; then
  say "installing torch==$torch_want (CPU build) into .venv"
  # torch alone from the CPU index, then its dependencies from the usual one (an unreachable CPU index
  # then costs one lookup, not one per dependency, and one retry, not pip's five with their back-off).
  rm -f "$compiled"
  "$VPY" -m pip install -q --no-compile --no-deps --retries 1 "torch==$torch_want" "${torch_from[@]}"
  pip_install "torch==$torch_want"
  env -u PYTHONDONTWRITEBYTECODE "$VPY" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' ||
    die "pip installed a CUDA build of torch; set BLOCKFS_TORCH_INDEX to an index of CPU wheels, then: rm -rf .venv && bash tools/setup.sh"
fi

# --- blockfs, editable, with its extras --------------------------------------------------------------
# Reinstall when an import fails, when blockfs in .venv comes from another checkout, or when
# pyproject.toml changed since the last install (a new dependency).
stamp=$VENV/.blockfs-pyproject here=$PWD
if ! cmp -s pyproject.toml "$stamp" ||
   ! (cd / && "$VPY" -c "import blockfs, PIL, hypothesis, pytest, fuse, mfusepy, numpy, os, sys
sys.exit(os.path.dirname(blockfs.__file__) != os.path.join(sys.argv[1], 'blockfs'))" "$here") 2>/dev/null; then
  say "installing blockfs (editable) and its torch, remote and test extras into .venv"
  pip_install -e ".[torch,remote,test]"
  cp pyproject.toml "$stamp"
fi
if [ ! -e "$compiled" ]; then say "compiling the modules the suite imports"; warm_imports; fi
say "ready: blockfs $(version_of blockfs), torch $(version_of torch) in .venv" \
    "(run .venv/bin/blockfs, or source .venv/bin/activate)"
