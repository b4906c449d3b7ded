#!/usr/bin/env bash
# Issue 54's device run, one command per part (each under the run tool's 10 minutes):
#   bash benchmarks/tpu_decode_check.sh kernels OUT   the Pallas kernels compiled by Mosaic, checked against the
#                                                    XLA path and timed at 128K, rows 1/4/16, fp8 and fp32
#   bash benchmarks/tpu_decode_check.sh decode OUT    benchmarks/decode.py at 128K, rows 1/4/16, fp8 cache, sparse
#                                                    and dense, bytes and roofline fraction (the contiguous
#                                                    reference where its copy fits 1 GiB)
#   bash benchmarks/tpu_decode_check.sh profile OUT   benchmarks/decode_profile.py: the 16- and 1-row 128K fp8 sparse
#                                                    step traced (device time per part and source line) and its
#                                                    pieces timed alone (docs/kernels.md's breakdown); ROWS="16"
#                                                    for one of them
#   bash benchmarks/tpu_decode_check.sh mfu OUT       benchmarks/train_mfu.py: configs/models/deepseek3.2-v5e.yml's
#                                                    train step (remat none, else full), MFU and its profile with
#                                                    the mask path in splash (--force mask_attention=splash), then
#                                                    2 x 2048 tokens a step; before: the tpu row (the XLA path)
#   bash benchmarks/tpu_decode_check.sh kl OUT        benchmarks/kl_target.py: the indexer KL target's Pallas kernel
#                                                    beside the XLA head_summed_probs at 1 and 2 x 2048 tokens, h 128
#   bash benchmarks/tpu_decode_check.sh probe OUT     what the 16-row step's whole-pool copies are: benchmarks/pool_gather.py
#                                                    (a row gather per pool storage form), the step's and write's
#                                                    compiled HLO scanned and unscanned (OUT/hlo.tgz), and the scoring
#                                                    kernel at 8-64 pages a grid step (fp32 and fp8 queries)
#   BASE=DIR bash benchmarks/tpu_decode_check.sh step OUT   the 16-row 128K fp8 step of the checkout in DIR (before:
#                                                    untraced) then of this one (traced, its HLO in OUT/hlo.tgz),
#                                                    this one's 1- and 4-row steps, and the scoring kernel at 8 and
#                                                    16 pages a grid step (fp32 queries, as the engine) beside XLA
#   BASE=DIR bash benchmarks/tpu_decode_check.sh rows OUT   the 16-row 128K fp8 step of this checkout (traced, pieces
#                                                    alone, HLO in OUT/hlo.tgz), then of DIR's (untraced, pieces),
#                                                    this one's 1-row step traced (the per-call floor) and 4-row step
#   BASE=DIR bash benchmarks/tpu_decode_check.sh pages OUT  benchmarks/scoring_pages.py, the 16-row step of DIR, then this one's at 64- and (traced,
#                                                    pieces) 256-slot pages; `pages_rows`: this one's 1 and 4 rows at 256
#   bash benchmarks/tpu_decode_check.sh fixes OUT     the 16-row step as the tpu row runs it (traced, pieces), then
#                                                    with index_placement=search (the row before), then unscanned
#   BASE=DIR bash benchmarks/tpu_decode_check.sh ways OUT   DIR's 16-row step (page 256), this one's, with
#                                                    index_placement=grouped, and with exact_selection=pallas too (traced)
#   WAYS="index_placement=grouped" bash benchmarks/tpu_decode_check.sh ways_rows OUT   bf16 weights, 1 and 4 rows
#   bash benchmarks/tpu_decode_check.sh keys OUT      key_order natural vs paired, 16 / 4 / 1 rows (16 paired traced)
#   bash benchmarks/tpu_decode_check.sh layers OUT    the 16-row step of 4 layers (traced) beside 1 layer's, 15 of its
#                                                    rows at 4K, 8 rows x 8 layers, and pool_gather.py (a slot's latent
#                                                    by pool layout)
# Expects .device_bundle (tools/device/device_bundle.sh, docs/accelerators.md) beside this checkout's benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
part="$1"; out="${2:-/tmp/tdc}"; mkdir -p "$out"
site="$(bash tools/device/device_bundle.sh --install .device_bundle python3 2>"$out/install.log")" || { tail -5 "$out/install.log"; exit 1; }
export PYTHONPATH="$PWD:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.devices())'
case "$part" in
  kernels)
    python3 benchmarks/paged_decode_kernels.py --rows 1 4 16 --contexts 131072 --iters 7 2>&1 | tee "$out/kernels.log" ;;
  decode)
    python3 benchmarks/decode.py --contexts 131072 --batch 1 4 16 --cache-dtype fp8 --iters 5 --stat median 2>&1 \
      | tee "$out/decode.log" ;;
  profile)
    for rows in ${ROWS:-16 1}; do
      python3 benchmarks/decode_profile.py --rows "$rows" --context 131072 --cache-dtype fp8 --iters 7 \
        --out "/tmp/decode_profile_$rows" 2>&1 | tee "$out/profile_$rows.log"
    done ;;
  mfu)
    { timeout 200 python3 benchmarks/train_mfu.py --force mask_attention=splash --set remat_policy=none \
        --set remat_policy=full
      timeout 160 python3 benchmarks/train_mfu.py --no-trace --force mask_attention=splash \
        --set global_batch_size=2 remat_policy=none --set global_batch_size=2 remat_policy=full
      timeout 130 python3 benchmarks/train_mfu.py --no-trace --force mask_attention=xla --set remat_policy=none
    } 2>&1 | tee "$out/mfu.log" ;;
  probe)
    { timeout 120 python3 benchmarks/pool_gather.py
      timeout 150 python3 benchmarks/paged_decode_kernels.py --rows 16 --dtypes fp8 --kernels scoring --variants kernel \
        --pages-per-block 8 16 32 64 --f32-queries --iters 5
      timeout 100 python3 benchmarks/paged_decode_kernels.py --rows 16 --dtypes fp8 --kernels scoring --variants kernel \
        --pages-per-block 8 32 --iters 5
      for scan in true false; do
        timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 5 --top 12 \
          --no-pieces --set scan_layers=$scan --out "/tmp/decode_profile_$scan" --hlo-out "/tmp/hlo/scan_$scan"
      done; } 2>&1 | tee "$out/probe.log"
    tar czf "$out/hlo.tgz" -C /tmp hlo ;;
  step)
    { if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 \
          --iters 7 --no-trace --no-pieces)
      fi
      timeout 180 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 12 \
        --no-pieces --out /tmp/decode_profile_16 --hlo-out /tmp/hlo/after
      for rows in 1 4; do
        timeout 100 python3 benchmarks/decode_profile.py --rows $rows --context 131072 --cache-dtype fp8 --iters 7 \
          --no-trace --no-pieces
      done
      timeout 150 python3 benchmarks/paged_decode_kernels.py --rows 16 --dtypes fp8 --kernels scoring \
        --variants kernel xla --pages-per-block 8 16 --f32-queries --iters 5; } 2>&1 | tee "$out/step.log"
    tar czf "$out/hlo.tgz" -C /tmp hlo ;;
  rows)  # issue 54: k_pe as int32 rows, the latents gathered once, fp8 indexer queries (one MXU pass; the pieces time
        # the kernel with fp32 and fp8 queries), the k_pe slot gathered directly (take_slots: one 32-word slice gather)
    { timeout 230 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
        --out /tmp/decode_profile_16 --hlo-out /tmp/hlo/after
      if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 170 python3 benchmarks/decode_profile.py --rows 16 \
          --context 131072 --cache-dtype fp8 --iters 7 --no-trace)
      fi
      timeout 90 python3 benchmarks/decode_profile.py --rows 1 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
        --no-pieces --out /tmp/decode_profile_1
      timeout 70 python3 benchmarks/decode_profile.py --rows 4 --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces; } 2>&1 | tee "$out/rows.log"
    tar czf "$out/hlo.tgz" -C /tmp hlo ;;
  fixes)  # the 16-row step with the tpu row as it is, then with index_placement as before, then unscanned
    python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
      --out /tmp/decode_profile_after 2>&1 | tee "$out/after_16.log"
    python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --no-trace --no-pieces \
      --force index_placement=search 2>&1 | tee "$out/search_16.log"
    # do the whole-pool relayout copies come from the scanned stack's [L, N, n] pools? the same step unscanned
    python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 12 --no-pieces \
      --set scan_layers=false --out /tmp/decode_profile_unscanned 2>&1 | tee "$out/unscanned_16.log" ;;
  kl)  # the indexer KL target alone: kernels/kl_target.py's Pallas kernel beside the XLA head_summed_probs
    { timeout 150 python3 benchmarks/kl_target.py --iters 9
      timeout 150 python3 benchmarks/kl_target.py --batch 2 --iters 9; } 2>&1 | tee "$out/kl.log" ;;
  pages)  # the scoring kernel's per-page DMAs: one wait a block (BASE: before), then 256-slot pages (the v5e config's)
    { timeout 120 python3 benchmarks/scoring_pages.py
      if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 python3 benchmarks/decode_profile.py --rows 16 \
          --context 131072 --cache-dtype fp8 --iters 7 --no-trace --no-pieces)
      fi
      timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces
      timeout 240 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
        --set serve_page_size=256 --out /tmp/decode_profile_16; } 2>&1 | tee "$out/pages.log" ;;
  pages_rows)  # 1 and 4 rows at 256-slot pages
    for rows in 1 4; do
      timeout 120 python3 benchmarks/decode_profile.py --rows $rows --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces --set serve_page_size=256
    done 2>&1 | tee "$out/pages_rows.log" ;;
  ways)  # the tree of 2026-12-06 19:20-21:00 (copies out of the step, found offline by benchmarks/tpu_compile.py), BASE's
         # 16-row step before it, then the ways not yet in the tpu row: grouped placement, and the k-th value kernel too
    { if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 python3 benchmarks/decode_profile.py --rows 16 \
          --context 131072 --cache-dtype fp8 --iters 7 --no-trace --no-pieces --set serve_page_size=256)
      fi
      timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces --set serve_page_size=256
      timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces --set serve_page_size=256 --force index_placement=grouped
      timeout 200 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 --top 15 \
        --no-pieces --set serve_page_size=256 --force index_placement=grouped exact_selection=pallas \
        --out /tmp/decode_profile_ways; } 2>&1 | tee "$out/ways.log" ;;
  ways_rows)  # bf16 weights (the v5e config's), 1 and 4 rows, all with the ways that `ways` found faster (WAYS)
    { timeout 150 python3 benchmarks/decode_profile.py --rows 16 --context 131072 --cache-dtype fp8 --iters 7 \
        --no-trace --no-pieces --set serve_page_size=256 weight_dtype=bfloat16 --force ${WAYS:-}
      for rows in 1 4; do
        timeout 120 python3 benchmarks/decode_profile.py --rows $rows --context 131072 --cache-dtype fp8 --iters 7 \
          --no-trace --no-pieces --set serve_page_size=256 --force ${WAYS:-}
      done; } 2>&1 | tee "$out/ways_rows.log" ;;
  layers)  # a deep model's step (a scanned stack's pools read in place, docs/kernels.md), mixed lengths, layouts
    common="--context 131072 --cache-dtype fp8 --iters 7 --no-pieces --set serve_page_size=256 weight_dtype=bfloat16"
    { timeout 200 python3 benchmarks/decode_profile.py --rows 16 --layers 4 --top 12 --out /tmp/dp_layers $common
      timeout 120 python3 benchmarks/decode_profile.py --rows 16 --no-trace $common
      timeout 120 python3 benchmarks/decode_profile.py --rows 16 --short-context 4096 --no-trace $common
      timeout 300 python3 benchmarks/decode_profile.py --rows 8 --layers 8 --no-trace $common  # the scales' rows (O(L^2) as [L,N,4])
      timeout 150 python3 benchmarks/pool_gather.py; } 2>&1 | tee "$out/layers.log" ;;
  keys)  # key_order natural vs paired (the tpu row's), bf16 weights, 16 / 4 / 1 rows, one process each; the 16-row
    # paired step traced (docs/kernels.md, "the fp8 keys paired for the VPU")
    { for rows in 16 4 1; do
        for order in natural paired; do
          trace="--no-trace"; [ "$rows$order" = "16paired" ] && trace="--out /tmp/dp_keys"
          timeout 150 python3 benchmarks/decode_profile.py --rows $rows --context 131072 --cache-dtype fp8 --iters 7 \
            --no-pieces $trace --set serve_page_size=256 weight_dtype=bfloat16 --force key_order=$order
        done
      done; } 2>&1 | tee "$out/keys.log" ;;
  *) echo "tpu_decode_check.sh: part must be kernels, decode, profile, mfu, probe, step, rows, fixes, pages, pages_rows, ways, ways_rows, keys or kl, got '$part'" >&2; exit 2 ;;
esac
