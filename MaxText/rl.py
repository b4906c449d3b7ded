"""Reinforcement learning: python -m MaxText.rl configs/base.yml [key=value ...]

GRPO as DeepSeek-V3.2 trains with it (docs/rl.md), a loop above the serving engine and the trainer:
each step takes rl_prompts_per_step prompts (post_train/prompts.py: records of the data pipelines,
rendered in DeepSeek-V3.2's chat format), the in-process ServingEngine samples rl_num_generations
completions of each (decode_sampling_* keys; a prompt's G samples share its pages through the prefix
cache), the reward (rl_reward, post_train/rewards.py) scores them, and rl_num_iterations updates of
the GRPO loss (post_train/grpo.py) run through train.py's jitted train step (the same sharding,
optimizer, finite-state guard). The new weights reach the engine through load_weights (its compiled
programs stay). Per sampled token the engine records its logprob (pi_old), the experts each MoE
layer routed it to, and the top-k/top-p kept set: the trainer's logprobs take the
recorded routing (rl_keep_routing) and renormalize over the kept set (rl_keep_sampling_mask).
rl_beta > 0 holds a frozen reference: the starting policy (load_parameters_path's, or the seeded init;
post_train/reference.py).
lora_rank > 0 (docs/lora.md): only adapters train, over the frozen base of load_parameters_path (fp8_block
allowed); the engine serves base + the current adapters, swapped in after each update with the compiled
programs kept; the reference is the base with the adapters off (no second copy of the weights); checkpoints
hold the adapters and their optimizer state, as train.py's. lora_restore_path=<a LoRA SFT run> starts the policy
from that run's adapters (train.init_state; the reference stays the base with the adapters off).
This file is the loop; its pieces are tested alone under post_train/: rollout_batch.py (rollouts -> the
loss's arrays, the trainer's logprobs, the routing agreement, the loss_fn), evaluator.py (the held-out
reward), grpo.py (the loss), prompts.py, rewards.py.

The run folder is train.py's: <base_output_directory>/<run_name>/ holds config.yml, checkpoints/ (the
train state every checkpoint_period steps and at the last; a checkpoint's step is the RL step) and
tensorboard/. The same command resumes from the newest checkpoint: step n's prompts and sampling
seeds are functions of (data, seed, n), so a resumed run continues the run it was. load_parameters_path
starts from an SFT run's checkpoints. eval_interval > 0: the held-out reward of greedy completions of
the eval records (eval_dataset_path / grain_eval_files / hf_eval_files) at step 0 and every
eval_interval steps. Metrics per step (console every log_period steps, tensorboard every step):
reward mean / std, kl, clip_fraction, masked_fraction (the mean over the step's updates), routing_agreement, rollout_s, train_s.

Several processes (the distributed_* keys, or a detected cluster; docs/multihost.md, RL over several processes):
the same command on every process, as train.py. Every process runs this whole loop, the engine's host logic
included: the scheduler and page allocator are deterministic functions of the requests (the same prompts and
seeds everywhere) and of the sampled tokens (read by every process alike), so no process replays another's
decisions (the server's step channel would have process 0 decide and the others follow; here every process needs
the rollouts anyway, to build the batch). inference/step_channel.Lockstep proves the lockstep instead of trusting
it: each engine device call and each step's batch is checked against process 0's before it is made (a difference
is one error line, exit 1, before a divergent program starts). The reward runs on process 0 only and its values
reach the others (channel.from_main: user code runs once, and one that is not a pure function of the text cannot
split the processes). Each process places its own devices' rows of the batch (distributed.from_host_copy); the
update is train.py's jitted step over the global mesh; the new weights reach every process's engine by
engine.load_weights with the step's global arrays, called at the same point of the same program on every
process (no message); checkpoints are orbax's cooperative ones; console and tensorboard are process 0's. A lost
process ends the others at once (the channel's connections: exit 1); processes started with different configs
fail with one line, exit 2, before anything compiles.
"""

from __future__ import annotations

import sys

if not __package__ and __name__ == "__main__":  # run as `python MaxText/rl.py`: import the package
  import _script_path  # noqa: F401

import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from MaxText import train as trainer
from MaxText.checkpoint import model_state, orbax_state
from MaxText.checkpoint.run_folder import RunFolder
from MaxText.config.types import Config, ConfigError
from MaxText.data.chat_template import chat_format
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference import step_channel
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.post_train import grpo
from MaxText.post_train.evaluator import Evaluator, completion_text
from MaxText.post_train.prompts import PromptSource
from MaxText.post_train.reference import Reference
from MaxText.post_train.rewards import load_reward
from MaxText.post_train.rollout_batch import assemble, grpo_loss_fn, routing_agreement
from MaxText.runtime import cli, distributed, sharding
from MaxText.runtime.metrics import MetricsLogger, fmt_duration


def check_config(config: Config) -> None:
  """The cross-key rules of an RL run: one ConfigError line naming the key."""
  if config.decode_sampling_strategy == "greedy":
    raise ConfigError("decode_sampling_strategy=greedy: RL samples rl_num_generations different completions per "
                      "prompt: use decode_sampling_strategy=temperature or top_p")
  if not config.tokenizer_path:
    raise ConfigError("tokenizer_path is empty: RL renders prompts and scores completions as text")
  fmt = chat_format(config)  # the server's and SFT's decision
  if fmt.encoding != "deepseek_v32":
    raise ConfigError(f"chat_encoding={config.chat_encoding} renders with the jinja template ({fmt.source}): RL renders "
                      "prompts and reads replies in DeepSeek-V3.2's format: set chat_encoding=deepseek_v32")
  if config.rl_max_completion_tokens >= config.max_target_length:
    raise ConfigError(f"rl_max_completion_tokens={config.rl_max_completion_tokens} leaves no room for a prompt in "
                      f"max_target_length={config.max_target_length}")
  n = config.rl_prompts_per_step * config.rl_num_generations
  if n % config.gradient_accumulation_steps:
    raise ConfigError(f"gradient_accumulation_steps={config.gradient_accumulation_steps} does not divide the "
                      f"{n} sequences of a step (rl_prompts_per_step x rl_num_generations)")
  if config.weight_quantization != "none" and not config.lora_rank:
    raise ConfigError(f"weight_quantization={config.weight_quantization}: RL trains float weights (none), or LoRA "
                      "adapters over the frozen fp8 base (lora_rank=N)")
  if config.pipeline_stages > 1 and config.num_moe_layers:
    raise ConfigError(f"ici_pipeline_parallelism x dcn_pipeline_parallelism = {config.pipeline_stages} stages: RL reads "
                      "and forces each token's routed experts, which the pipeline does not carry; use 1 stage")


def sampling_params(config: Config, step: int, row: int) -> SamplingParams:
  """Row `row` of step `step`: the decode_sampling_* keys, a seed of (seed, step, row) (a resumed run
  samples what it would have), and the engine's per-token rollout records."""
  seed = int(np.random.default_rng([config.seed, step, row]).integers(2 ** 62))
  return SamplingParams(max_tokens=config.rl_max_completion_tokens, temperature=config.decode_sampling_temperature,
                        top_p=config.decode_sampling_nucleus_p if config.decode_sampling_strategy == "top_p" else 1.0,
                        seed=seed, rollout=True)


def policy_weights(state: dict) -> tuple[dict, dict]:
  """The policy's (params, buffers) as the engine merges them: the state's params and buffers; under LoRA
  (params = the adapters) the frozen base with the buffers. The same tree every step: a swap recompiles nothing."""
  return state["params"], trainer.model_buffers(state)


def shared_reward(channel, reward):
  """The reward every process uses: process 0's (user code runs once; channel.from_main gives its values,
  bit for bit, to the others)."""
  return lambda texts, records, wheres: np.asarray(channel.from_main(lambda: reward(texts, records, wheres)))


def _batch_sharding(mesh, config: Config, arrays: dict) -> dict:
  """Each array's rows (axis 0) over the batch axes; the rest replicated."""
  rules = sharding.rules_of(config)
  return {k: NamedSharding(mesh, sharding.logical_to_spec(("activation_batch",) + (None,) * (v.ndim - 1), rules,
                                                          mesh, v.shape)) for k, v in arrays.items()}


def rl(config: Config) -> list[dict]:
  """Runs (or resumes) RL; returns each step's metrics (and eval_reward where evaluated) as floats."""
  check_config(config)
  timeout = config.distributed_initialization_timeout
  distributed.check_same_config(config.model_dump(), timeout)  # several processes: one command, before any compile
  tokenizer = load_tokenizer(config)
  reward = load_reward(config)
  source = PromptSource(config, tokenizer)  # a bad record or prompt fails before any compile
  channel = step_channel.open_channel(timeout, lockstep=True)  # LOCAL on one process
  reward = shared_reward(channel, reward)
  evaluate = Evaluator(config, tokenizer, reward) if config.eval_interval else None
  options = grpo.GrpoOptions.from_config(config)
  g, n = config.rl_num_generations, config.rl_prompts_per_step * config.rl_num_generations
  run = RunFolder(config)
  latest = orbax_state.latest_step_on_disk(config) if config.enable_checkpointing else None
  if not run.open(latest):
    channel.close()
    return []
  print(run.describe(), flush=True)
  t_start = time.perf_counter()
  mesh = sharding.create_mesh(config)
  history: list[dict] = []
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    # The optimizer's schedule counts updates (steps x iterations).
    step_config = config.model_copy(update={"steps": config.steps * config.rl_num_iterations})
    graphdef, state, state_sharding, tx = trainer.init_state(step_config, mesh)
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < config.vocab_size else None
    reference = Reference(config, graphdef, state, vocab) if config.rl_beta > 0 else None  # the starting policy
    if reference is not None:
      print(reference.describe(), flush=True)
    manager = orbax_state.create_manager(config)
    start = 0
    restored = orbax_state.restore_newest_good(manager, orbax_state.abstract_like(state, state_sharding))
    if restored is not None:
      start, saved, _ = restored
      state = dict(state, **saved)  # under LoRA the frozen base is not in a checkpoint: it stays as loaded
      print(f"resumed from checkpoint step {start} in {config.checkpoint_dir}", flush=True)
    engine = ServingEngine(config, graphdef, *policy_weights(state), sample_vocab=vocab,
                           eos_id=source.eos_id, log=lambda line: print(line, flush=True))
    engine.channel = channel  # several processes: each device call checked against process 0's
    agreement_jit = jax.jit(lambda p, b, batch, rec: routing_agreement(model_state.merge(graphdef, p, b), batch, rec))
    step_fn = None
    logger = MetricsLogger(config, start_step=start) if distributed.is_main_process() else distributed.Silent()
    try:
      if evaluate is not None and start == 0:
        history.append(_log_eval(logger, 0, evaluate(engine)))
      for step in range(start + 1, config.steps + 1):
        # the policy's weights (LoRA: its adapters), no recompile; several processes: the step's global arrays, at
        # this same point of the same program on every process (nothing to send)
        engine.load_weights(*policy_weights(state))
        t0 = time.perf_counter()
        rows = source.step(step)
        prompts = [ids for _, _, ids in rows for _ in range(g)]
        requests = engine.generate(prompts, [sampling_params(config, step, i) for i in range(n)])
        texts = [completion_text(tokenizer, r) for r in requests]
        rewards = reward(texts, [rec for _, rec, _ in rows for _ in range(g)], [w for w, _, _ in rows for _ in range(g)])
        batch = assemble(config, requests, rewards)
        rollout_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        arrays = dict(batch.arrays)
        # several processes: what the host computed from the rollouts is the same on each (a check, nothing moves)
        channel.send("batch", *(arrays[k] for k in ("tokens", "segment_ids", "mask", "advantages")))
        recorded = {} if batch.routed_experts is None else {"recorded": batch.routed_experts}
        shardings = _batch_sharding(mesh, config, {**arrays, **recorded, "logp_ref": arrays["tokens"]})
        host = {**arrays, **recorded}
        dev = distributed.from_host_copy(host, {k: shardings[k] for k in host})
        recorded = dev.pop("recorded", None)
        agreement = None if recorded is None else \
            agreement_jit(*policy_weights(state), dev, recorded)  # before the update
        if reference is not None:
          dev["logp_ref"] = reference(state, dev)
        if step_fn is None:
          step_fn = trainer.jit_train_step(step_config, graphdef, tx, state_sharding,
                                           {k: shardings[k] for k in dev}, mesh, grpo_loss_fn(options, vocab))
        updates = []
        for _ in range(config.rl_num_iterations):
          state, metrics = step_fn(state, dev)
          updates.append(metrics)
        # every local device done before the host reads (distributed.settled) and the engine's next programs
        state, updates, agreement = distributed.settled((state, updates, agreement))
        updates = [{k: float(v) for k, v in jax.device_get(m).items()} for m in updates]
        if not all(u.pop("finite") for u in updates):
          raise trainer.TrainingError(f"step {step}: the GRPO loss or the updated parameters are not finite "
                                      f"({updates[-1]}); this state is not saved: lower learning_rate")
        train_s = time.perf_counter() - t1
        real = float(arrays["segment_ids"].sum())
        # the updates' metrics averaged (clip_fraction and masked_fraction are 0 in the first, on-policy one)
        m = dict({k: float(np.mean([u[k] for u in updates])) for k in updates[0]}, step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                 completion_tokens=batch.generated / n, rollout_s=rollout_s, train_s=train_s,
                 rollout_tokens_per_s=batch.generated / rollout_s,
                 train_tokens_per_s=real * config.rl_num_iterations / train_s)
        if agreement is not None:
          m["routing_agreement"] = float(agreement)
        _log(logger, config, step, m)
        if evaluate is not None and (step % config.eval_interval == 0 or step == config.steps):
          engine.load_weights(*policy_weights(state))
          m.update(_log_eval(logger, step, evaluate(engine)))
        history.append(m)
        if manager is not None and (step % config.checkpoint_period == 0 or step == config.steps):
          orbax_state.save(manager, step, state, {"rl_step": step})
          print(f"checkpoint step {step}: {config.checkpoint_dir}/{step}", flush=True)
    finally:
      logger.close()
      orbax_state.finish(manager)
  channel.close()  # the normal end only: after an error the others see this process end and exit 1
  if distributed.is_main_process():
    print(summary(config, history, start, time.perf_counter() - t_start, manager is not None), flush=True)
  return history


def summary(config: Config, history: list[dict], start: int, seconds: float, saved: bool) -> str:
  """The run's closing line, as train.py's: the steps run, time, the last step's reward and KL, the
  last held-out reward, where the weights are."""
  steps = [m for m in history if "reward_mean" in m]
  evals = [m["eval_reward"] for m in history if "eval_reward" in m]
  if not steps:
    return f"done: no RL step run (resumed at step {start} of {config.steps})"
  last = steps[-1]
  line = (f"done: RL steps {steps[0]['step']}-{last['step']} of {config.steps} in {fmt_duration(seconds)}; final "
          f"reward_mean {last['reward_mean']:.4f} | reward_std {last['reward_std']:.4f} | kl {last['kl']:.4g}")
  line += f"; held-out reward {evals[-1]:.4f}" if evals else ""
  weights = ("not saved (enable_checkpointing=false)" if not saved
             else f"LoRA adapters (rank {config.lora_rank}) in {config.checkpoint_dir}, over the base "
                  f"load_parameters_path={config.load_parameters_path or '(random init)'}" if config.lora_rank
             else f"load_parameters_path={config.checkpoint_dir}")
  return line + f"; weights: {weights}"


CONSOLE = ("reward_mean", "reward_std", "kl", "clip_fraction", "masked_fraction", "completion_tokens",
           "rollout_s", "train_s")


def _writer(logger):
  """The tensorboard writer: process 0's MetricsLogger's (None when off); the others' logger is Silent."""
  return logger.writer if isinstance(logger, MetricsLogger) else None


def _log(logger, config: Config, step: int, m: dict) -> None:
  if _writer(logger) is not None:
    for k, v in m.items():
      logger.writer.add_scalar(f"rl/{k}", v, step)
  if step % config.log_period == 0 or step in (1, config.steps):
    print(f"step {step}/{config.steps} | " + " | ".join(f"{k} {m[k]:.4g}" for k in CONSOLE), flush=True)


def _log_eval(logger, step: int, value: float) -> dict:
  if _writer(logger) is not None:
    logger.writer.add_scalar("rl/eval_reward", value, step)
  print(f"eval step {step} | held-out reward (greedy) {value:.4f}", flush=True)
  return {"step": step, "eval_reward": value}


def main(argv) -> None:
  cli.entry_point(argv, __doc__, rl)


if __name__ == "__main__":
  distributed.run_main(main, sys.argv)
