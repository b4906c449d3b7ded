#!/usr/bin/env bash
# A second environment with the accelerator image's jax (0.11.2, here its CPU build) and the newest flax,
# optax and orbax-checkpoint that pip resolves with it, plus the rest of requirements.txt's pins less the
# torch oracle and the linters; then the unit tests in it. jax 0.11 needs Python >= 3.12 (the image's).
# Usage: bash tools/device/jax_next_env.sh VENV [pytest args]    (VENV: a folder outside the repository)
#        PYTHON=/path/to/python3.12 bash tools/device/jax_next_env.sh VENV ...
#        JAX_NEXT=0.11.2 (the default) picks the jax/jaxlib pair.
# Default pytest args: tests/unit -n 2 -q. The versions it tested are printed first and recorded in
# docs/accelerators.md. Re-running reuses VENV (pip installs only what is missing).
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash tools/device/jax_next_env.sh VENV [pytest args]  (VENV: a new folder outside the repository)" >&2
  exit 2
fi
VENV="$(realpath -m "$1")"; shift  # relative to where it was called from
cd "$(dirname "$0")/../.."
case "$VENV/" in "$PWD"/*) echo "jax_next_env.sh: VENV=$VENV is inside the repository; choose a folder outside it" >&2; exit 2 ;; esac
JAX_NEXT="${JAX_NEXT:-0.11.2}"

py312() {  # the first Python >= 3.12 of: $PYTHON, python3.12, python3, pyenv's 3.12 and 3.13
  local c
  for c in ${PYTHON:-} python3.12 python3 "$(pyenv root 2>/dev/null)"/versions/3.1[23]*/bin/python3; do
    if [ -n "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}
if [ ! -x "$VENV/bin/python" ]; then
  PY="$(py312)" || { echo "jax_next_env.sh: jax $JAX_NEXT needs Python >= 3.12; none found (set PYTHON=...)" >&2; exit 2; }
  "$PY" -m venv "$VENV"
fi
# requirements.txt less what this environment replaces (jax and the libraries that follow it) and what the
# unit tests do not need (the torch oracle, whose tests skip without it; the linters).
reqs="$(mktemp)"; trap 'rm -f "$reqs"' EXIT
grep -vE '^(jax|jaxlib|flax|optax|orbax-checkpoint|torch|transformers|accelerate|ruff|import-linter)==' \
    requirements.txt > "$reqs"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "jax==$JAX_NEXT" "jaxlib==$JAX_NEXT" flax optax orbax-checkpoint -r "$reqs"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, sys
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "grain", "pydantic", "omegaconf"]
print(f"jax_next_env: Python {sys.version.split()[0]}; " + ", ".join(f"{n} {md.version(n)}" for n in names), flush=True)
EOF
[ $# -gt 0 ] || set -- tests/unit -n 2 -q
PYTHONPATH="$PWD" exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
