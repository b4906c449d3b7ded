#!/usr/bin/env bash
# The wheels that the accelerator image lacks for tools/device/device_check.sh (and for python -m MaxText.serve),
# for its Python (3.12, manylinux x86-64), into DIR; fails when DIR holds more than 56 MiB. Dependencies are
# resolved here, so the device installs with no index and no resolution:
#   bash tools/device/device_check.sh --bundle DIR     (docs/accelerators.md)
# What is needed: NEEDS below, at requirements.txt's pins, and all they depend on. What the image has (so is left
# out): tools/device/device_image.txt.
# Usage: bash tools/device/device_bundle.sh DIR
#        BUNDLE_PYTHON=3.11 bash tools/device/device_bundle.sh DIR    (another Python's wheels: to try the install here)
#        BUNDLE_PYTHON=3.11 BUNDLE_IMAGE=tools/device/device_image_tpu.txt bash tools/device/device_bundle.sh DIR
#            (the lent TPU v5e image: Python 3.11, jax 0.10.2 + libtpu, without flax, optax, orbax, ...)
#        bash tools/device/device_bundle.sh --install DIR [PYTHON]    (what device_check.sh --bundle runs: installs
#            DIR's wheels for PYTHON (default python3) into DIR/site-pyXY with no index and no resolution, checks
#            that everything the device check imports imports, and prints that folder: its one line on stdout)
set -euo pipefail
CALLER="$PWD"
cd "$(dirname "$0")/../.."
abs() { case "$1" in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac; }  # a path as the caller meant it
MAX_MIB=56
# The imports of device_check.sh's sections and of tests/unit's collection (pydantic, omegaconf, grain, ...),
# and of the server; datasets and tensorboard stay out (nothing the device runs imports them).
# flax ... pytest-xdist are on the GPU image (so left out there) and missing from the TPU image.
NEEDS=(pydantic omegaconf grain array-record tensorboardX fastapi starlette uvicorn prometheus_client Jinja2 httpx llguidance flax optax orbax-checkpoint safetensors sentencepiece tokenizers pytest-xdist)
# What the device check imports, from the bundle or the image, checked after the install: a failure stops it; what
# only the server imports is a warning.
MODULES="jax flax optax orbax.checkpoint numpy yaml pydantic omegaconf grain array_record tensorboardX sentencepiece
tokenizers safetensors pytest xdist hypothesis MaxText.train"
SERVER_MODULES="fastapi uvicorn prometheus_client jinja2 llguidance MaxText.serve"

install() {  # DIR PYTHON: install offline, check the imports, print the target folder
  local dir="$1" py="$2" tag site
  ls "$dir"/*.whl > /dev/null 2>&1 ||
    { echo "device_bundle.sh: no wheels in $dir; make them with: bash tools/device/device_bundle.sh $dir" >&2; exit 2; }
  dir="$(realpath "$dir")"
  tag="$("$py" -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
  site="$dir/site-$tag"
  if [ ! -f "$site/.complete" ]; then
    rm -rf "$site"
    if "$py" -m pip --version > /dev/null 2>&1; then
      "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$site" \
          "$dir"/*.whl >&2
    else  # no pip: a wheel is a zip of what goes into site-packages
      for whl in "$dir"/*.whl; do "$py" -m zipfile -e "$whl" "$site"; done
    fi
    touch "$site/.complete"
  fi
  PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" MODULES="$MODULES" SERVER_MODULES="$SERVER_MODULES" "$py" -c '
import importlib, os, sys
def failures(names):
  out = []
  for name in names.split():
    try:
      importlib.import_module(name)
    except Exception as e:  # any failure to import is reported the same way
      out.append(f"{name} ({type(e).__name__}: {e})")
  return out
fix = ("add what is missing to NEEDS in tools/device/device_bundle.sh (or take it out of tools/device/device_image.txt) "
       "and rebuild the bundle")
server = failures(os.environ["SERVER_MODULES"])
if server:
  print(f"device_bundle.sh: warning: the server cannot run here: {sys.executable} cannot import "
        f"{chr(59).join(server)}; {fix}", file=sys.stderr)
check = failures(os.environ["MODULES"])
if check:
  sys.exit(f"device_bundle.sh: with the bundle, {sys.executable} cannot import {chr(59).join(check)}; {fix}")
' >&2 || exit 2
  echo "$site"
}

if [ "${1:-}" = --install ]; then
  [ $# -ge 2 ] || { echo "usage: bash tools/device/device_bundle.sh --install DIR [PYTHON]" >&2; exit 2; }
  install "$(abs "$2")" "${3:-python3}"
  exit 0
fi
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash tools/device/device_bundle.sh DIR   (DIR: a new or empty folder for the wheels)" >&2
  exit 2
fi
DIR="$(abs "$1")"
PYV="${BUNDLE_PYTHON:-3.12}"
IMAGE="${BUNDLE_IMAGE:-tools/device/device_image.txt}"
[ -f "$IMAGE" ] || { echo "device_bundle.sh: BUNDLE_IMAGE=$IMAGE is not a file (a pip freeze of the image)" >&2; exit 2; }
pins=()
for n in "${NEEDS[@]}"; do
  pin="$(grep -iE "^${n}==" requirements.txt || true)"
  [ -n "$pin" ] || { echo "device_bundle.sh: $n has no pin in requirements.txt (expected a line '$n==X')" >&2; exit 2; }
  pins+=("${pin%%[[:space:]#]*}")
done
if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR")" ]; then
  echo "device_bundle.sh: $DIR is not empty; give a new or empty folder" >&2
  exit 2
fi
mkdir -p "$DIR"
stage="$(mktemp -d)"; trap 'rm -rf "$stage"' EXIT
platforms=(--platform manylinux2014_x86_64)
for v in 17 24 25 26 27 28 29 30 31; do platforms+=(--platform "manylinux_2_${v}_x86_64"); done

# Resolve and fetch the whole closure for that Python and platform (wheels only), then keep what the image lacks.
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${platforms[@]}" -d "$stage" "${pins[@]}" 2> "$stage/pip.err" ||
  { grep -v "is ignored" "$stage/pip.err" >&2; echo "device_bundle.sh: pip download failed (above)" >&2; exit 1; }
canon() { tr 'A-Z_.' 'a-z--' | sed -E 's/-+/-/g'; }  # a distribution's canonical name (PEP 503)
has="$({ grep -vE '^[[:space:]]*(#|$)' "$IMAGE" || true; } | sed -E 's/[=<> ;#].*//' | canon | sort -u)"
kept=0
for whl in "$stage"/*.whl; do
  name="$(basename "$whl" | cut -d- -f1 | canon)"
  if grep -qxF "$name" <<< "$has"; then
    echo "  left out (the image has it): $(basename "$whl")"
  else
    mv "$whl" "$DIR/"; kept=$((kept + 1))
  fi
done
ls -l "$DIR"/*.whl | awk '{ printf "  %8.2f MiB  %s\n", $5 / 1048576, $NF }'
bytes="$(du -sb "$DIR" | cut -f1)"
mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo "device_bundle.sh: $kept wheels for Python $PYV, $mib MiB in $DIR"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "device_bundle.sh: $DIR holds $mib MiB, more than $MAX_MIB MiB (what travels to the device is 64 MiB" \
       "with the repository)" >&2
  exit 1
fi
