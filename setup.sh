#!/usr/bin/env bash
# Creates .venv and installs the pinned requirements and this package (editable).
# Usage: bash setup.sh                      the CPU build of jax (CI, laptops)
#        ACCELERATOR=cuda bash setup.sh     + the CUDA 12 build (jax[cuda12]: NVIDIA driver >= 525)
#        ACCELERATOR=cuda13 bash setup.sh   + the CUDA 13 build (jax[cuda13]: NVIDIA driver >= 580)
#        ACCELERATOR=tpu bash setup.sh      + the TPU build (jax[tpu]: libtpu)
# Idempotent; re-running only installs what is missing. The accelerator builds pin jax's plugin to
# the jax of requirements.txt; the CUDA libraries come from PyPI (nvidia-* wheels), no local CUDA.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
ACCELERATOR="${ACCELERATOR:-cpu}"
JAX_VERSION="$(sed -n 's/^jax==//p' requirements.txt)"
case "$ACCELERATOR" in
  cpu) extra=() ;;
  cuda | cuda12) extra=("jax[cuda12]==$JAX_VERSION") ;;
  cuda13) extra=("jax[cuda13]==$JAX_VERSION") ;;
  tpu) extra=("jax[tpu]==$JAX_VERSION") ;;
  *) echo "setup.sh: ACCELERATOR=$ACCELERATOR; expected cpu, cuda (= cuda12), cuda12, cuda13 or tpu" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements.txt ${extra[@]+"${extra[@]}"}
python -m pip install -q --no-deps -e .
python -c "import jax, flax, optax; print('setup ok: jax', jax.__version__, 'flax', flax.__version__, 'backend', jax.default_backend(), 'devices', jax.devices())"
if [ "$ACCELERATOR" != cpu ]; then
  python -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')" || \
      echo "setup.sh: warning: the $ACCELERATOR build is installed but jax sees no accelerator here (driver? JAX_PLATFORMS?)" >&2
fi
