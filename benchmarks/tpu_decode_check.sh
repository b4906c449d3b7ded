#!/usr/bin/env bash
# Issue 54's device run, one command per part (each under the run tool's 10 minutes):
#   bash benchmarks/tpu_decode_check.sh kernels OUT   the Pallas kernels compiled by Mosaic, checked against the
#                                                    XLA path and timed at 128K, rows 1/4/16, fp8 and fp32
#   bash benchmarks/tpu_decode_check.sh decode OUT    benchmarks/decode.py at 128K, rows 1/4/16, fp8 cache, sparse
#                                                    and dense, bytes and roofline fraction (the contiguous
#                                                    reference where its copy fits 1 GiB)
# Expects .device_bundle (benchmarks/device_bundle.sh, docs/accelerators.md) beside this checkout's benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
part="$1"; out="${2:-/tmp/tdc}"; mkdir -p "$out"
site="$(bash benchmarks/device_bundle.sh --install .device_bundle python3 2>"$out/install.log")" || { tail -5 "$out/install.log"; exit 1; }
export PYTHONPATH="$PWD:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.devices())'
case "$part" in
  kernels)
    python3 benchmarks/paged_decode_kernels.py --rows 1 4 16 --contexts 131072 --iters 7 2>&1 | tee "$out/kernels.log" ;;
  decode)
    python3 benchmarks/decode.py --contexts 131072 --batch 1 4 16 --cache-dtype fp8 --iters 5 --stat median 2>&1 \
      | tee "$out/decode.log" ;;
  *) echo "tpu_decode_check.sh: part must be kernels or decode, got '$part'" >&2; exit 2 ;;
esac
