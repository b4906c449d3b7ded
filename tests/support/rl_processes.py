"""MaxText/rl.py as subprocesses (tests/integration/test_multiprocess_rl.py; launched by train_processes.launch):
a tiny GRPO run's keys, a reward such a run can import, and what the test reads back (tensorboard scalars per
step, the final checkpoint's parameters as numpy)."""

import json
import os

import numpy as np

STEPS = 3


def checksum(completion: str, record: dict) -> float:
  """`rl_reward=tests.support.rl_processes:checksum` (the repository on PYTHONPATH): a plain function of the
  text whose values differ within a group, so a random tiny model gets a gradient."""
  return float(sum(map(ord, completion)) % 3)


def rl_args(folder) -> list[str]:
  """A tiny GRPO run in `folder` (run r): 2 prompts x 4 samples a step (8 rows: one per device of a data=8
  mesh, a multiple of its 8 page shards), 2 layers, no indexer, a KL reference, a checkpoint at the last step,
  tensorboard on (the full-precision metrics), 4 prompts in folder/p.jsonl; the held-out reward of 2 others
  (folder/eval.jsonl) at steps 0 and STEPS."""
  os.makedirs(folder, exist_ok=True)
  for name, first, n in (("p.jsonl", 0, 4), ("eval.jsonl", 4, 2)):
    with open(os.path.join(folder, name), "w") as f:
      for i in range(first, first + n):
        f.write(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n")
  return ["configs/base.yml", "tokenizer_type=hf", "tokenizer_path=tests/data/tokenizer.json", "chat_thinking=false",
          "decode_sampling_strategy=temperature", "max_target_length=32", "max_prefill_length=32",
          "rl_max_completion_tokens=4", "dataset_type=file", f"dataset_path={folder}/p.jsonl", f"steps={STEPS}",
          f"eval_dataset_path={folder}/eval.jsonl", f"eval_interval={STEPS}",
          "rl_prompts_per_step=2", "rl_num_generations=4", "rl_beta=0.1", f"checkpoint_period={STEPS}",
          "async_checkpointing=false", f"base_output_directory={folder}", "run_name=r", "serve_max_num_seqs=8",
          "serve_width_buckets=1", "serve_context_buckets=1", "mtp_num_layers=0", "num_decoder_layers=2",
          "use_indexer=false", "enable_tensorboard=true", "learning_rate=1e-2", "warmup_steps=0",
          "rl_reward=tests.support.rl_processes:checksum"]


def scalars(folder) -> dict[str, dict[int, float]]:
  """{'reward_mean': {step: value}, ...}: the rl/* scalars process 0 wrote to tensorboard (float32, exact)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(os.path.join(folder, "r", "tensorboard"))
  acc.Reload()
  return {tag.removeprefix("rl/"): {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def final_params(folder) -> dict[str, np.ndarray]:
  """{'a/b/kernel': array}: the parameters of the checkpoint at step STEPS, read as numpy."""
  import jax
  import orbax.checkpoint as ocp
  path = os.path.join(folder, "r", "checkpoints", str(STEPS), "state")
  reader = ocp.PyTreeCheckpointer()
  meta = reader.metadata(path).item_metadata.tree
  tree = reader.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta))
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree["params"])}
