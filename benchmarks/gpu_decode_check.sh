#!/usr/bin/env bash
# The Triton kernels on a GPU (an H200 or H100), one part a call under the run tool's 10 minutes (parts joined by
# commas run in order: `tests,kernels` in one call, `profile` in a second, `decode` in a third):
#   tests     tests/unit/test_paged_decode_gpu.py with the kernels compiled (not interpreted) against the XLA paths
#   kernels   paged_decode_kernels.py, 1 / 4 / 16 rows of 128K fp8: the scoring kernel at 2 / 4 / 8 pages a program,
#             the MLA kernel's variants and a sweep of its blocks, heads a program, warps and splits, beside XLA
#   profile   decode_profile.py, the 16-row 128K fp8 step: the gpu row, + paged_scoring=triton, + sparse_decode=triton,
#             + the binned selection for lax.top_k (untraced)
#   decode    decode.py: 1 / 4 / 16 rows at 32K and 128K, fp8, sparse and dense; 1 and 16 sparse on both Triton kernels
# Needs .device_bundle beside benchmarks/ (tools/device/device_bundle.sh: the GPU image's missing wheels,
# docs/accelerators.md). Every log lands in OUT as it is written (cut runs still return).
set -uo pipefail
cd "$(dirname "$0")/.."
part="$1"; out="${2:-/tmp/gdc}"; mkdir -p "$out"
site="$(bash tools/device/device_bundle.sh --install .device_bundle python3 2>"$out/install.log")" || { tail -5 "$out/install.log"; exit 1; }
export PYTHONPATH="$PWD:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export JAX_PLATFORMS="${JAX_PLATFORMS-}"  # set, even empty: tests/conftest.py would pick the CPU when unset
python3 -c 'import jax; print(jax.__version__, jax.devices())' 2>&1 | tee "$out/devices.log"
common="--context 131072 --cache-dtype fp8 --iters 7 --top 15 --set weight_dtype=bfloat16"

tests() {  # on the GPU (JAX_PLATFORMS set, empty): the kernels compiled by Triton, not interpreted
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/unit/test_paged_decode_gpu.py \
    tests/unit/test_backend.py 2>&1 | tee "$out/tests.log"
}
kernels() {
  { timeout 200 python3 benchmarks/paged_decode_kernels.py --rows 16 4 1 --contexts 131072 --dtypes fp8 --iters 7 \
      --pages-per-block 2 4 8 --mla-configs 16x16w4 32x32w4 64x32w8 32x64w8 32x32w8s4 64x64w8s8; } 2>&1 \
    | tee "$out/kernels.log"
}
profile() {
  { timeout 120 python3 benchmarks/decode_profile.py --rows 16 $common --out /tmp/dp_gpu_xla
    timeout 90 python3 benchmarks/decode_profile.py --rows 16 $common --no-pieces --out /tmp/dp_gpu_scoring \
      --force paged_scoring=triton
    timeout 90 python3 benchmarks/decode_profile.py --rows 16 $common --no-pieces --out /tmp/dp_gpu_both \
      --force paged_scoring=triton sparse_decode=triton
    timeout 90 python3 benchmarks/decode_profile.py --rows 16 $common --no-pieces --no-trace \
      --force paged_scoring=triton sparse_decode=triton exact_selection=binned; } 2>&1 | tee "$out/profile.log"
}
decode() {
  { timeout 200 python3 benchmarks/decode.py --contexts 32768 131072 --batch 1 4 16 --cache-dtype fp8 --iters 5 \
      --stat median
    timeout 120 python3 benchmarks/decode.py --contexts 131072 --batch 1 16 --cache-dtype fp8 --iters 5 --stat median \
      --sparse-only --force paged_scoring=triton sparse_decode=triton; } 2>&1 | tee "$out/decode.log"
}
for p in ${part//,/ }; do
  case "$p" in
    tests | kernels | profile | decode) "$p" ;;
    *) echo "gpu_decode_check.sh: parts are tests, kernels, profile and decode (joined by commas), got '$p'" >&2; exit 2 ;;
  esac
done
