#!/usr/bin/env bash
# The TPU figures of docs/kernels.md and docs/accelerators.md ("Current figures"), one part a call (each under the
# run tool's 10 minutes), this checkout's tpu row of kernels/backend.py: bash benchmarks/tpu_decode_check.sh PART OUT
#   step      decode_profile.py untraced: the sparse decode step, 128K fp8, page 256, bf16 weights: 16, 4 and 1 rows,
#             16 rows of 4 layers, 16 rows with 15 at 4K
#   profile   decode_profile.py: the 16-row step traced (device time per part and source line), the pieces, the launches
#   kernels   paged_decode_kernels.py: the Pallas kernels compiled by Mosaic beside their XLA paths, 1 / 4 / 16 rows
#   decode    decode.py at 128K, 1 / 4 / 16 rows, fp8, sparse and dense, paged against contiguous where its copy fits
#   mfu       train_mfu.py: configs/models/deepseek3.2-v5e.yml's train step (remat none), 1 and 2 x 2048 tokens, its
#             profile (splash and the KL target kernel among its parts)
#   long OUT [LENGTHS [PATHS]]   long_context.py: gather beside mask (splash) per length (default 8192,16384,32768;
#             gather,mask) under 560 s, the first path profiled (--trace); MaxText 0.2.5's: long_context_peer.sh
#   prefill OUT [CONTEXTS]   decode.py --prompt: one prompt through the 2048-token chunked prefill, sparse beside
#             dense, fp8 cache, each's tokens/s (default 32768,131072), under 560 s
# A comparison with another tree is two runs of a part, one in each checkout. Expects .device_bundle
# (tools/device/device_bundle.sh, docs/accelerators.md) beside benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
part="$1"; out="${2:-/tmp/tdc}"; mkdir -p "$out"
site="$(bash tools/device/device_bundle.sh --install .device_bundle python3 2>"$out/install.log")" || { tail -5 "$out/install.log"; exit 1; }
export PYTHONPATH="$PWD:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.devices())'
step="python3 benchmarks/decode_profile.py --context 131072 --cache-dtype fp8 --iters 7 --no-pieces
  --set serve_page_size=256 weight_dtype=bfloat16"
case "$part" in
  step)
    { for rows in 16 4 1; do timeout 150 $step --rows $rows --no-trace; done
      timeout 200 $step --rows 16 --layers 4 --no-trace
      timeout 150 $step --rows 16 --short-context 4096 --no-trace; } 2>&1 | tee "$out/step.log" ;;
  profile)
    timeout 400 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
      --set serve_page_size=256 weight_dtype=bfloat16 --out /tmp/decode_profile_16 2>&1 | tee "$out/profile.log" ;;
  kernels)
    python3 benchmarks/paged_decode_kernels.py --rows 1 4 16 --contexts 131072 --dtypes fp8 --iters 7 2>&1 \
      | tee "$out/kernels.log" ;;
  decode)
    python3 benchmarks/decode.py --contexts 131072 --batch 1 4 16 --cache-dtype fp8 --iters 5 --stat median 2>&1 \
      | tee "$out/decode.log" ;;
  mfu)
    { timeout 250 python3 benchmarks/train_mfu.py --set remat_policy=none --set remat_policy=full
      timeout 200 python3 benchmarks/train_mfu.py --no-trace --set global_batch_size=2 remat_policy=none \
        --set global_batch_size=2 remat_policy=full; } 2>&1 | tee "$out/mfu.log" ;;
  long)
    timeout 560 python3 benchmarks/long_context.py --lengths "${3:-8192,16384,32768}" --paths "${4:-gather,mask}" \
      --trace /tmp/long_trace \
      --budget 520 2>&1 | tee "$out/long.log" ;;
  prefill)
    ctx="${3:-32768,131072}"
    timeout 560 python3 benchmarks/decode.py --prompt --prompt-attention sparse dense --contexts ${ctx//,/ } \
      --chunk 2048 --cache-dtype fp8 --set serve_page_size=256 weight_dtype=bfloat16 2>&1 | tee "$out/prefill.log" ;;
  *) echo "tpu_decode_check.sh: part must be step, profile, kernels, decode, mfu, long or prefill, got '$part'" >&2
     exit 2 ;;
esac
