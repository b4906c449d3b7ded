#!/usr/bin/env bash
# Creates .venv and installs the pinned requirements and this package (editable).
# Usage: bash setup.sh        (idempotent; re-running only installs what is missing)
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt
python -m pip install -q --no-deps -e .
python -c "import jax, flax, optax; print('setup ok: jax', jax.__version__, 'flax', flax.__version__, 'devices', jax.devices())"
