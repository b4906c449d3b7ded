#!/usr/bin/env bash
# The prepared check for one accelerator (about 8 minutes on an H200); on the CPU it runs at small
# sizes (a few minutes). Prints a table and one JSON line; each section's log goes to --out.
# Usage: bash tools/device/device_check.sh [--only tests mfu_tiny mfu_large selection decode serving] [--out DIR]
#        PYTHON=python3 bash tools/device/device_check.sh    (a Python that already has jax for the device)
#        bash tools/device/device_check.sh --bundle DIR ...  (the accelerator image: its python3, plus the wheels
#            of tools/device/device_bundle.sh DIR installed offline into DIR/site-pyXY, no index, no resolution)
# What each section measures, the device command, and the figures so far: docs/accelerators.md.
set -euo pipefail
BUNDLE=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) [ $# -ge 2 ] || { echo "device_check.sh: --bundle needs a folder (from tools/device/device_bundle.sh DIR)" >&2; exit 2; }
              BUNDLE="$2"; shift 2 ;;
    --bundle=*) BUNDLE="${1#--bundle=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$BUNDLE" in "" | /*) ;; *) BUNDLE="$PWD/$BUNDLE" ;; esac  # relative to where it was called from
cd "$(dirname "$0")/../.."
if [ -n "$BUNDLE" ]; then
  PY="${PYTHON:-python3}"
else
  PY="${PYTHON:-.venv/bin/python}"
  [ -x "$PY" ] || PY="$(command -v python3)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's MaxText, whatever is installed
if [ -n "$BUNDLE" ]; then
  site="$(bash tools/device/device_bundle.sh --install "$BUNDLE" "$PY")"
  export PYTHONPATH="$PWD:$site${PYTHONPATH#"$PWD"}"  # after the checkout, before the image's own packages
fi
export JAX_PLATFORMS="${JAX_PLATFORMS-}"  # set, even empty: tests/conftest.py would pick the CPU when unset
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"  # a GPU: room for the largest config
exec "$PY" tools/device/device_check.py ${args[@]+"${args[@]}"}
