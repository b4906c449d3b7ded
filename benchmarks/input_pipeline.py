"""Input pipeline throughput: tokens per second of each source with 0, 1 and 2 grain workers, beside
the tokens per second a train step of the tiny and of a mid-size model consumes.

    python benchmarks/input_pipeline.py [--docs 4000] [--batches 40] [--workers 0 1 2] [--seq 64] [--batch 8]
    python benchmarks/input_pipeline.py --skip-models          # the pipeline only

Sources: ArrayRecord, Parquet and a saved HF dataset, as text and as token ids, made here from the test corpus.
Prints tokens/s per source and workers (batches 2..N+1) and per model (median step), then one JSON line.
"""

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from MaxText.config import pyconfig  # noqa: E402
from MaxText.data import documents, input_pipeline  # noqa: E402
from MaxText.data.tokenizer import load_tokenizer  # noqa: E402

TOKENIZER = os.path.join(REPO, "tests", "data", "tokenizer.model")
MID = ["emb_dim=512", "mlp_dim=1536", "num_decoder_layers=4", "num_query_heads=8", "q_lora_rank=128",
       "kv_lora_rank=128", "qk_nope_head_dim=64", "qk_rope_head_dim=32", "v_head_dim=64", "moe_mlp_dim=256",
       "indexer_n_heads=8", "indexer_head_dim=64", "mtp_num_layers=0"]


def make_data(d: str, n_docs: int) -> dict[str, list[str]]:
  """The sources' config keys, each over the same n_docs documents."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter
  datasets.disable_progress_bars()
  paras, _ = documents.read_documents(os.path.join(REPO, "tests", "data", "corpus.txt"), "text")
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(paras, rng.integers(1, 4))) for _ in range(n_docs)]
  tok = load_tokenizer(tokenizer_type="sentencepiece", tokenizer_path=TOKENIZER, bos_id=1, eos_id=2, pad_id=0)
  ids = tok.encode_batch(texts)
  for name, records in (("ids", [np.asarray(x, "<i4").tobytes() for x in ids]), ("text", [t.encode() for t in texts])):
    for s in range(4):
      w = ArrayRecordWriter(f"{d}/{name}-{s}.arrayrecord", "group_size:1")
      for r in records[s::4]:
        w.write(r)
      w.close()
  pq.write_table(pa.table({"text": texts, "tokens": ids}), f"{d}/data.parquet", row_group_size=1000)
  datasets.Dataset.from_dict({"text": texts, "tokens": ids}).save_to_disk(f"{d}/hf")
  with open(f"{d}/corpus.txt", "w") as f:
    f.write("\n\n".join(t.replace("\n\n", "\n") for t in texts) + "\n")
  ids_keys = ["tokenize_train_data=false", "train_data_columns=[tokens]"]
  return {
      "file txt (text)": ["dataset_type=file", f"dataset_path={d}/corpus.txt"],
      "arrayrecord text": ["dataset_type=grain", f"grain_train_files={d}/text-*.arrayrecord"],
      "arrayrecord ids": ["dataset_type=grain", f"grain_train_files={d}/ids-*.arrayrecord", *ids_keys],
      "parquet text": ["dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={d}/data.parquet"],
      "parquet ids": ["dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={d}/data.parquet",
                      *ids_keys],
      "hf text": ["dataset_type=hf", f"hf_path={d}/hf"],
      "hf ids": ["dataset_type=hf", f"hf_path={d}/hf", *ids_keys],
  }


def pipeline_tokens_per_s(keys: list[str], workers: int, batches: int, seq: int, batch: int) -> float:
  cfg = pyconfig.initialize(["bench", "base.yml", f"tokenizer_path={TOKENIZER}", f"max_target_length={seq}",
                             f"max_prefill_length={min(seq, 32)}", f"global_batch_size={batch}",
                             f"grain_worker_count={workers}", *keys], num_devices=1)
  it = input_pipeline.create_data_iterator(cfg, process_index=0, process_count=1)
  next(it)  # worker start-up, the file dataset's whole-corpus tokenization
  t = time.perf_counter()
  for _ in range(batches):
    next(it)
  secs = time.perf_counter() - t
  it.close()
  return batches * batch * seq / secs


def model_tokens_per_s(extra: list[str], seq: int, batch: int, repeats: int = 3) -> float:
  import jax

  from MaxText import train
  from MaxText.runtime import sharding
  cfg = pyconfig.initialize(["bench", "base.yml", f"max_target_length={seq}", f"max_prefill_length={min(seq, 32)}",
                             f"global_batch_size={batch}", "ici_data_parallelism=1", *extra], num_devices=1)
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, state, _, tx = train.init_state(cfg, mesh)
    data = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg, process_index=0, process_count=1)))
    data = jax.device_put(data, train.batch_shardings(cfg, mesh, data))
    step = jax.jit(train.make_train_step(cfg, graphdef, tx)).lower(state, data).compile()
    ms = timing.median_ms(lambda: step(state, data), repeats, warmup=0)
  return batch * seq / ms * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--docs", type=int, default=4000, help="documents made for each source")
  ap.add_argument("--batches", type=int, default=40, help="batches timed per measurement")
  ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--seq", type=int, default=64, help="max_target_length (the tiny model's)")
  ap.add_argument("--batch", type=int, default=8, help="global_batch_size (the tiny model's)")
  ap.add_argument("--skip-models", action="store_true", help="no train step (the pipeline only)")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as d:
    sources = make_data(d, args.docs)
    results = {}
    print(f"{args.docs} documents per source; batch {args.batch} x {args.seq} tokens; {args.batches} batches "
          f"timed; {os.cpu_count()} CPUs")
    print(f"{'source':<18}" + "".join(f"{f'{w} workers tok/s':>18}" for w in args.workers))
    for name, keys in sources.items():
      counts = [0] if name.startswith("file") else args.workers  # the file dataset has no worker processes
      row = {w: pipeline_tokens_per_s(keys, w, args.batches, args.seq, args.batch) for w in counts}
      results[name] = row
      print(f"{name:<18}" + "".join(f"{row[w]:>18,.0f}" if w in row else f"{'-':>18}" for w in args.workers),
            flush=True)
  models = {}
  if not args.skip_models:
    models["tiny"] = model_tokens_per_s([], args.seq, args.batch)
    models["mid"] = model_tokens_per_s(MID, args.seq, args.batch)
    for name, tps in models.items():
      print(f"train step, {name} model: consumes {tps:,.0f} tokens/s", flush=True)
    with_workers = [v for row in results.values() for w, v in row.items() if w > 0]
    slowest = min(with_workers) if with_workers else float("nan")
    print(f"slowest source with workers / tiny model's consumption: {slowest / models['tiny']:.1f}x (target >= 10x)")
  print(json.dumps({"benchmark": "input_pipeline", "docs": args.docs, "batch": args.batch, "seq": args.seq,
                    "tokens_per_s": {k: {str(w): round(v) for w, v in row.items()} for k, row in results.items()},
                    "model_tokens_per_s": {k: round(v) for k, v in models.items()}}))


if __name__ == "__main__":
  main()
