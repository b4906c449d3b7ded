#!/usr/bin/env bash
# The prepared check for one accelerator (about 8 minutes on an H200); on the CPU it runs at small
# sizes (a few minutes). Prints a table and one JSON line; each section's log goes to --out.
# Usage: bash benchmarks/device_check.sh [--only tests mfu_tiny mfu_large selection decode serving] [--out DIR]
#        PYTHON=python3 bash benchmarks/device_check.sh    (a Python that already has jax for the device)
# What each section measures, and the figures so far: docs/accelerators.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export JAX_PLATFORMS="${JAX_PLATFORMS-}"  # set, even empty: tests/conftest.py would pick the CPU when unset
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's MaxText, whatever is installed
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"  # a GPU: room for the largest config
exec "$PY" benchmarks/device_check.py "$@"
