"""Does DeepSeek Sparse Attention learn? Dense vs the paper's recipe vs the shortcuts, and what
approximate top-k costs, on a long-range retrieval task (dataset_type=synthetic_retrieval).

    python benchmarks/dsa_study.py --quick             # every arm at a small scale (minutes, 2 CPU cores)
    python benchmarks/dsa_study.py                     # full mode: longer context, more steps (docs/dsa_study.md)
    python benchmarks/dsa_study.py --quick --arms dense sparse_random_indexer --out /tmp/s

Every arm (ARMS; the design in docs/dsa_study.md) trains the same model on the same data with MaxText/train.py,
one run folder per stage under --out. Prints per arm the eval answer accuracy and loss and the indexer's recall
of dense attention; the last line is one JSON object mapping each arm to its eval accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText import train  # noqa: E402
from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data import input_pipeline
from MaxText.layers.attention_mla import capture_selection
from MaxText.runtime import cli, sharding

ARMS = ["dense", "sparse_random_indexer", "warmup_then_sparse", "sparse_from_scratch",
        "approx_0.8", "approx_0.9", "approx_0.95", "approx_0.99", "raw_threshold"]
RECIPE_ARMS = {"warmup_then_sparse": [], "raw_threshold": ["indexer_mask_exact_topk=false"],
               **{f"approx_{r}": ["indexer_use_approx_top_k=true", f"indexer_approx_top_k_recall={r}"]
                  for r in ("0.8", "0.9", "0.95", "0.99")}}


@dataclasses.dataclass(frozen=True)
class Scale:
  seq: int            # max_target_length
  topk: int           # indexer_topk of the sparse arms
  steps: int          # optimizer steps of every arm
  warmup: int         # the recipe's dense_warmup steps (W)
  sparse: int         # the recipe's sparse steps (S); its dense part is steps - W - S
  batch: int          # global_batch_size
  eval_steps: int     # held-out batches
  task: tuple         # synthetic_retrieval keys
  model: tuple        # model keys


MODEL = ("num_decoder_layers=2", "first_num_dense_layers=2", "mtp_num_layers=0", "scan_layers=false",
         "param_init_std=0.2")
TASK = ("retrieval_pairs=8", "retrieval_queries=8", "retrieval_keys=8", "retrieval_values=8", "retrieval_pair_tokens=1",
        "vocab_size=128")
SCALES = {
    "quick": Scale(seq=128, topk=16, steps=700, warmup=100, sparse=200, batch=16, eval_steps=8, task=TASK, model=MODEL),
    "full": Scale(seq=512, topk=32, steps=1000, warmup=150, sparse=300, batch=16, eval_steps=16, task=TASK,
                  model=MODEL),
}


class Study:
  """Runs the stages of the arms under one output folder; each stage is one train() run."""

  def __init__(self, scale: Scale, out: str, extra: list[str]):
    self.scale, self.out, self.extra = scale, out, extra

  def argv(self, name: str, *keys: str) -> list[str]:
    s = self.scale
    return ["dsa_study", "base.yml", "dataset_type=synthetic_retrieval", f"max_target_length={s.seq}",
            f"max_prefill_length={s.seq // 2}", f"indexer_topk={s.topk}", f"global_batch_size={s.batch}",
            f"eval_steps={s.eval_steps}", *s.task, *s.model, f"base_output_directory={self.out}",
            f"run_name={name}", "enable_tensorboard=false", "async_checkpointing=false", "log_period=100",
            *self.extra, *keys]

  def stage(self, name: str, steps: int, *keys: str) -> dict:
    """One train() run of `steps` steps, evaluated at its end; returns its metrics."""
    config = pyconfig.initialize(self.argv(name, f"steps={steps}", f"eval_interval={steps}",
                                          f"checkpoint_period={steps}", *keys))
    t = time.perf_counter()
    metrics = train.train(config)
    metrics["seconds"] = time.perf_counter() - t
    return metrics

  def checkpoint(self, name: str, step: int | None = None) -> str:
    folder = os.path.join(self.out, name, "checkpoints")
    return folder if step is None else os.path.join(folder, str(step))

  def recall(self, name: str, *keys: str) -> dict[str, list[float]]:
    """The final model of run `name` on the held-out rows (its own selection, `keys`; sparse
    attention unless a key says dense_warmup), at the answer queries, per layer: "recall", the share
    of the dense attention mass (all keys, at that layer's input) on the indexer's selection, and
    "pair", the share of queries whose selection holds the position of the pair they ask for (the
    one key the answer needs)."""
    config = pyconfig.initialize(self.argv(name + "_recall", "indexer_training_stage=none", *keys))
    mesh = sharding.create_mesh(config)
    data = input_pipeline.create_eval_iterator(config, process_index=0, process_count=1)
    with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
      graphdef, params, buffers, _ = model_state.load_parameters(self.checkpoint(name), config, mesh,
                                                                 report=lambda _: None)

      @jax.jit
      def per_layer(params, buffers, batch, pair_at):  # pair_at [b,t] -> recall, pair hit: [L,b,t] each
        model = model_state.merge(graphdef, params, buffers)
        _, inter = capture_selection(model, batch["inputs"], batch["positions"], batch["segment_ids"])
        inter = inter.to_pure_dict() if hasattr(inter, "to_pure_dict") else inter
        layers = [inter["dense_layers"]["layers"][i]["attention"] for i in sorted(inter["dense_layers"]["layers"])]
        recall = jnp.stack([a["indexer_recall"][0] for a in layers])  # [L,b,t]
        hit = jnp.stack([jnp.take_along_axis(a["indexer_mask"][0], jnp.maximum(pair_at, 0)[..., None], axis=-1)[..., 0]
                         for a in layers])  # [L,b,t]: the pair's key selected
        return recall, hit.astype(jnp.float32)

      sums, weight = np.zeros((2, config.num_decoder_layers)), 0.0
      for i in range(config.eval_steps):
        host = data.source[i]
        pair_at = data.source.pair_positions(host["inputs"])  # [b,t], -1 off the queries
        out = per_layer(params, buffers, {k: jnp.asarray(v) for k, v in host.items()}, jnp.asarray(pair_at))
        w = host["weights"]  # [b,t]: the answer queries
        sums += [np.sum(np.asarray(o) * w, axis=(1, 2)) for o in out]
        weight += float(np.sum(w))
    return {"recall": (sums[0] / weight).tolist(), "pair": (sums[1] / weight).tolist()}


def run_arms(study: Study, arms: list[str]) -> dict[str, dict]:
  s = study.scale
  dense_part = s.steps - s.warmup - s.sparse
  results: dict[str, dict] = {}
  recipe = [a for a in arms if a in RECIPE_ARMS]

  def record(arm, metrics, stages, *keys):
    sel = study.recall(arm, *keys)
    results[arm] = {"accuracy": metrics["eval_accuracy"], "loss": metrics["eval_lm_loss"], "stages": stages,
                    "seconds": metrics["seconds"], "recall": float(np.mean(sel["recall"])),
                    "pair": float(np.max(sel["pair"])), "per_layer": sel}
    print(f"[dsa_study] {arm}: eval accuracy {metrics['eval_accuracy']:.3f}, loss {metrics['eval_lm_loss']:.3f}, "
          f"recall per layer {np.round(sel['recall'], 3).tolist()}, pair selected per layer "
          f"{np.round(sel['pair'], 3).tolist()} ({stages})", flush=True)

  if "dense" in arms or recipe:
    # the dense arm, checkpointed also where the recipe branches off (step N - W - S)
    m = study.stage("dense", s.steps, "indexer_training_stage=none", f"indexer_topk={s.seq}",
                    f"checkpoint_period={dense_part}",
                    f"max_checkpoints_to_keep={s.steps // dense_part + 1}")
    record("dense", m, f"dense {s.steps}", "indexer_training_stage=dense_warmup")  # its (untrained) indexer at top-k
  if "sparse_random_indexer" in arms:
    m = study.stage("sparse_random_indexer", s.steps, "indexer_training_stage=none")
    record("sparse_random_indexer", m, f"sparse, frozen random indexer {s.steps}")
  if "sparse_from_scratch" in arms:
    m = study.stage("sparse_from_scratch", s.steps, "indexer_training_stage=sparse")
    record("sparse_from_scratch", m, f"sparse stage {s.steps}")
  if recipe:
    warm = study.stage("dense_warmup", s.warmup, "indexer_training_stage=dense_warmup",
                       f"load_parameters_path={study.checkpoint('dense', dense_part)}")
    print(f"[dsa_study] dense_warmup: indexer loss {warm['indexer_loss']:.3f} after {s.warmup} steps", flush=True)
    for arm in recipe:
      m = study.stage(arm, s.sparse, "indexer_training_stage=sparse", *RECIPE_ARMS[arm],
                      f"load_parameters_path={study.checkpoint('dense_warmup')}")
      m["seconds"] += warm["seconds"]
      record(arm, m, f"dense {dense_part} + dense_warmup {s.warmup} + sparse {s.sparse}", *RECIPE_ARMS[arm])
  return results


def table(results: dict[str, dict]) -> str:
  lines = ["| arm | stages (steps) | eval accuracy | eval loss | recall of dense attention (mean of layers) "
           "| pair selected (best layer) | s |", "|---|---|---|---|---|---|---|"]
  for arm, r in ((arm, results[arm]) for arm in ARMS if arm in results):
    lines.append(f"| {arm} | {r['stages']} | {r['accuracy']:.3f} | {r['loss']:.3f} | {r['recall']:.3f} "
                 f"| {r['pair']:.3f} | {r['seconds']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="the small scale (minutes on 2 CPU cores)")
  p.add_argument("--arms", nargs="+", choices=ARMS, default=ARMS)
  p.add_argument("--out", default="", help="a new or empty folder for the run folders (default: a temporary one)")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every stage")
  args = p.parse_args(argv)
  if args.out and os.path.isdir(args.out) and os.listdir(args.out):
    sys.exit(f"dsa_study: --out {args.out} is not empty: its runs would resume instead of starting; give a new folder")
  out = args.out or tempfile.mkdtemp(prefix="dsa_study_")
  scale = SCALES["quick" if args.quick else "full"]
  cli.quiet_libraries()
  t0 = time.perf_counter()
  results = run_arms(Study(scale, out, args.set), args.arms)
  print(f"\n{'quick' if args.quick else 'full'} mode: {dataclasses.asdict(scale)}; runs in {out}; "
        f"{time.perf_counter() - t0:.0f} s on {jax.device_count()} {jax.devices()[0].platform} device(s)\n")
  print(table(results))
  print(json.dumps({arm: round(results[arm]["accuracy"], 4) for arm in ARMS if arm in results}))


if __name__ == "__main__":
  main()
