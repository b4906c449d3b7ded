#!/bin/bash
# On the TPU: MaxText 0.2.5's sparse training (indexer_sparse_training=true, top-k 2048 < the sequence, its indexer
# trained: indexer_loss_scaling_factor=1.0) at configs/models/deepseek3.2-v5e.yml's shapes, one sequence of each length
# a step: the MaxText rows of long_context.py's table (docs/benchmarks.md, which says what MaxText computes there).
#   bash benchmarks/long_context_peer.sh 8192,16384,32768 "$OUT"     (checkout root; .peer and .device_bundle carried)
# .peer is /work/shared/peer copied into the checkout (git-ignored): common.sh (mt_env), mt_v5e_args.sh (the shapes;
# max_target_length replaced here), mt_launch.py, mt_parse.py. chunk(): mla_qk_head_chunk_size, the KL's heads at a time
# (~2 GiB of its f32 probabilities live at 8K and 16K, 4 GiB at 32K). Each length under BUDGET (common.sh), step times
# from step 3 on (mt_parse.py); out of memory at REMAT it tries remat full once.
T6=${T6:-$PWD/.peer}; source "$T6/common.sh"
LENGTHS=${1:-8192,16384,32768}; OUT=${2:-$OUT}; mkdir -p "$OUT"
REMAT=${REMAT:-full}
# long_context.py's rung, in MaxText's keys (replacing mt_v5e_args.sh's): one dense layer, a vocabulary of 8192
THIN=${THIN-"base_num_decoder_layers=1 first_num_dense_layers=1 vocab_size=8192"}
MT_ATTN=${MT_ATTN:-"attention=flash use_tokamax_splash=true"}
export STEPS=${STEPS:-8}
mt_env || exit 1
python3 -c 'import jax, jaxlib, importlib.metadata as m; print(jax.__version__, jaxlib.__version__, m.version("libtpu"), jax.devices())' > "$OUT/versions.txt" 2>&1
chunk() { case $1 in 8192) echo 8 ;; 16384) echo 2 ;; *) echo 1 ;; esac; }
mt_long() {  # NAME LENGTH REMAT: one MaxText run (mt_v5e_args.sh's shapes at LENGTH, sparse training), its summary
  source "$T6/mt_v5e_args.sh"
  local model="${MT_MODEL/max_target_length=2048/max_target_length=$2}" kv
  for kv in $THIN; do model=$(sed -E "s/(^| )${kv%%=*}=[^ ]*/\1$kv/" <<< "$model"); done
  local runargs="${MT_RUN/indexer_loss_scaling_factor=0.0/indexer_loss_scaling_factor=1.0}"
  mkdir -p /tmp/mtrun
  run "$1" "${MTLIM:-280}" env MT_PRINT_PARAMS=1 bash -c "cd /tmp/mtrun && python3 '$T6/mt_launch.py' \
    maxtext.trainers.pre_train.train /tmp/mtsite/maxtext/configs/base.yml run_name=$1 \
    base_output_directory=/tmp/mtrun/out $model $runargs per_device_batch_size=1 steps=$STEPS remat_policy=$3 \
    mla_qk_head_chunk_size=$(chunk "$2") $MT_ATTN"
  python3 "$T6/mt_parse.py" "$OUT/$1.log" | tee -a "$OUT/summary.txt"
}
for L in ${LENGTHS//,/ }; do
  mt_long "mt_sparse_${L}" "$L" "$REMAT"
  if grep -q "RESOURCE_EXHAUSTED\|Ran out of memory\|exceeds the memory" "$OUT/mt_sparse_${L}.log" && [ "$REMAT" != full ]; then
    mt_long "mt_sparse_${L}_full" "$L" full
  fi
done
echo "total $(( $(date +%s) - T0 )) s" >> "$OUT/summary.txt"; cat "$OUT/summary.txt"
