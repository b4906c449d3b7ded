r"""The RL demo: SFT teaches a tiny model additions from demonstrations in two styles; GRPO with an
exact-match reward raises its accuracy on problems it never trained RL on.

    PYTHONPATH=. .venv/bin/python demos/rl_demo.py --work /tmp/rl_demo [--sft_steps 300 --rl_steps 60 ...] [key=value ...]

1. Data under <work>/data: additions "a+b=?" with operands in [0, --high); the eval problems
   (eval.jsonl, --eval of them) are pairs (a, b) that no RL record asks (rl.jsonl: the others, as
   {"prompt", "answer"}). train.jsonl holds the SFT conversations (the user's question, the
   assistant's reply; no thinking): every pair (--sft_eval_pairs include) or the RL pairs only
   (exclude); a --long_share of the replies in a second annotator's style, "The sum of a and b is s.",
   which the verifier (exact match against "s") counts as wrong.
2. SFT: train.py use_sft=true (demos/sft_demo.py's command, its BPE tokenizer) for --sft_steps
   steps from the random init into <work>/sft: the model learns the sums and answers in either style.
3. RL in this process: MaxText.rl on rl.jsonl from <work>/sft/checkpoints (rl_reward=exact_match
   against "answer", sampling at --temperature), --rl_steps steps; eval_interval=--eval_every greedy
   accuracy (exact match) on eval.jsonl before the first update and every --eval_every steps.
   Extra key=value go to SFT and RL (default: mtp_num_layers=0 remat_policy=none), except the LoRA keys
   (lora_rank, lora_alpha, lora_module_path), which go to RL only: SFT trains the base, RL adapters over it.
4. <work>/rl_demo.png: reward mean and KL per step, held-out accuracy at each eval.

Prints a table and one JSON line: accuracy_before, accuracy_after, steps, rollout_tokens_per_s,
train_tokens_per_s (means over the steps after the first, which compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from benchmarks.serve_load import REPO
from demos.sft_demo import LORA_KEYS, demo_tokenizer, parse_args, run, train_command


def write_data(args, out: str) -> dict:
  """train.jsonl (SFT), rl.jsonl and eval.jsonl. The eval pairs are held out from RL (rl.jsonl never asks
  them); --sft_eval_pairs include (the default) puts them in the SFT conversations too. A --long_share of
  the SFT replies are in a second annotator's style ("The sum of a and b is s."), which exact match
  counts as wrong: the SFT'd model knows the sums but often answers in that style."""
  rng = random.Random(args.seed)
  pairs = [(a, b) for a in range(args.high) for b in range(args.high)]
  rng.shuffle(pairs)
  held, train = pairs[:args.eval], pairs[args.eval:]
  os.makedirs(out, exist_ok=True)
  long_replies = 0
  with open(os.path.join(out, "train.jsonl"), "w") as f:
    for a, b in (train + held if args.sft_eval_pairs == "include" else train):
      long = rng.random() < args.long_share
      long_replies += long
      reply = f"The sum of {a} and {b} is {a + b}." if long else str(a + b)
      f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}=?"},
                                       {"role": "assistant", "content": reply}]}) + "\n")
  for name, rows in (("rl.jsonl", train), ("eval.jsonl", held)):
    with open(os.path.join(out, name), "w") as f:
      f.writelines(json.dumps({"prompt": f"{a}+{b}=?", "answer": str(a + b)}) + "\n" for a, b in rows)
  return {"train_problems": len(train), "eval_problems": len(held), "sft_long_replies": long_replies}


def rl_argv(args, data: str, tokenizer: str, vocab_size: int, extra: list[str]) -> list[str]:
  return ["rl", "configs/base.yml", "dataset_type=file", f"dataset_path={data}/rl.jsonl",
          f"eval_dataset_path={data}/eval.jsonl", f"eval_interval={args.eval_every}", "tokenizer_type=hf",
          f"tokenizer_path={tokenizer}", f"vocab_size={vocab_size}", f"max_target_length={args.max_target_length}",
          f"max_prefill_length={args.max_target_length}", "chat_thinking=false", "rl_reward=exact_match",
          "rl_reward_column=answer", f"rl_max_completion_tokens={args.max_tokens}",
          f"rl_prompts_per_step={args.prompts}", f"rl_num_generations={args.generations}",
          f"rl_beta={args.beta}", f"steps={args.rl_steps}", f"learning_rate={args.rl_learning_rate}",
          f"warmup_steps={args.rl_warmup}", "decode_sampling_strategy=temperature", f"decode_sampling_temperature={args.temperature}",
          f"serve_max_num_seqs={args.prompts * args.generations}", f"checkpoint_period={args.rl_steps}",
          "async_checkpointing=false", f"base_output_directory={args.work}", "run_name=rl",
          f"load_parameters_path={os.path.join(args.work, 'sft', 'checkpoints')}", "log_period=1", *extra]


def plot(history: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [h for h in history if "reward_mean" in h]
  evals = [h for h in history if "eval_reward" in h]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
  ax1.plot([h["step"] for h in steps], [h["reward_mean"] for h in steps], label="reward (sampled, mean)")
  ax1.plot([h["step"] for h in evals], [h["eval_reward"] for h in evals], "o-", label="held-out accuracy (greedy)")
  ax1.set_xlabel("RL step")
  ax1.set_ylim(0, 1)
  ax1.legend()
  ax2.plot([h["step"] for h in steps], [h["kl"] for h in steps], color="C2")
  ax2.set_xlabel("RL step")
  ax2.set_ylabel("KL to the SFT model (per token)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--work", required=True)
  p.add_argument("--high", type=int, default=10, help="operands are below this")
  p.add_argument("--eval", type=int, default=30, help="held-out problems")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--long_share", type=float, default=0.6, help="SFT replies in the long style (exact match: wrong)")
  p.add_argument("--sft_eval_pairs", choices=["include", "exclude"], default="include",
                 help="include: the eval pairs are in the SFT data (held out from RL only); exclude: from both")
  p.add_argument("--sft_steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=8, help="SFT global_batch_size")
  p.add_argument("--learning_rate", type=float, default=3e-3, help="SFT learning rate")
  p.add_argument("--max_target_length", type=int, default=64)
  p.add_argument("--rl_steps", type=int, default=60)
  p.add_argument("--prompts", type=int, default=16, help="rl_prompts_per_step")
  p.add_argument("--generations", type=int, default=8, help="rl_num_generations")
  p.add_argument("--beta", type=float, default=0.02)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--rl_learning_rate", type=float, default=3e-4)
  p.add_argument("--rl_warmup", type=int, default=0, help="RL warmup_steps")
  p.add_argument("--max_tokens", type=int, default=16, help="rl_max_completion_tokens (a long-style reply is ~12)")
  p.add_argument("--eval_every", type=int, default=10)
  p.add_argument("--skip_sft", action="store_true", help="reuse <work>/sft")
  p.add_argument("--tokenizer", default="bpe", help="'bpe' (a BPE tokenizer trained on train.jsonl, sft_demo's) or "
                                                    "a tokenizer.json holding V3.2's markers")
  return p


DEFAULT_KEYS = ("mtp_num_layers=0", "remat_policy=none")


def split_keys(extra: list[str]) -> tuple[list[str], list[str]]:
  """The model keys key=value of the command line -> (those for SFT and RL: DEFAULT_KEYS when none, the LoRA
  keys for RL only). With lora_rank=N, SFT still trains every weight (the base), RL trains adapters over it."""
  lora = [x for x in extra if x.startswith(LORA_KEYS)]
  return [x for x in extra if not x.startswith(LORA_KEYS)] or list(DEFAULT_KEYS), lora


def main(argv=None) -> None:
  args, extra = parse_args(parser(), argv, [])
  extra, lora = split_keys(extra)
  data = os.path.join(args.work, "data")
  counts = write_data(args, data)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  t0 = time.perf_counter()
  tokenizer, vocab_size = demo_tokenizer(args, data)  # BPE on train.jsonl (sft_demo's): "12" is 2 tokens
  if not args.skip_sft:
    sft = argparse.Namespace(**{**vars(args), "steps": args.sft_steps})
    cmd = train_command(sft, data, tokenizer, vocab_size, extra)
    run(cmd, env, os.path.join(args.work, "sft.log"))
  sft_s = time.perf_counter() - t0
  print(f"SFT: {args.sft_steps} steps in {sft_s:.0f} s", file=sys.stderr, flush=True)

  os.chdir(REPO)
  from MaxText import rl
  from MaxText.config import pyconfig
  config = pyconfig.initialize(rl_argv(args, data, tokenizer, vocab_size, extra + lora))
  t1 = time.perf_counter()
  history = rl.rl(config)
  rl_s = time.perf_counter() - t1
  evals = [h for h in history if "eval_reward" in h]
  steps = [h for h in history if "reward_mean" in h][1:] or [h for h in history if "reward_mean" in h]
  mean = lambda k: sum(h[k] for h in steps) / max(1, len(steps))  # noqa: E731
  png = os.path.join(args.work, "rl_demo.png")
  plot(history, png)
  with open(os.path.join(args.work, "history.json"), "w") as f:
    json.dump(history, f, indent=1)
  print(f"\n| stage | steps | time | held-out accuracy ({counts['eval_problems']} problems, greedy) |\n|---|---|---|---|")
  print(f"| SFT (from the random init) | {args.sft_steps} | {sft_s / 60:.1f} min | {evals[0]['eval_reward']:.0%} |")
  how = f"GRPO, {args.prompts} x {args.generations} rollouts a step" + (f"; {' '.join(lora)}" if lora else "")
  print(f"| + RL ({how}) | {args.rl_steps} | {rl_s / 60:.1f} min "
        f"| {evals[-1]['eval_reward']:.0%} |")
  print(f"plot: {png}", file=sys.stderr)
  print(json.dumps({"accuracy_before": round(evals[0]["eval_reward"], 3),
                    "accuracy_after": round(evals[-1]["eval_reward"], 3), "steps": args.rl_steps,
                    "rollout_tokens_per_s": round(mean("rollout_tokens_per_s"), 1),
                    "train_tokens_per_s": round(mean("train_tokens_per_s"), 1),
                    "sft_steps": args.sft_steps, "sft_s": round(sft_s), "rl_s": round(rl_s),
                    "evals": [(h["step"], round(h["eval_reward"], 3)) for h in evals], "extra": extra + lora}))


if __name__ == "__main__":
  main()
