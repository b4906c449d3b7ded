"""Reinforcement learning: python -m MaxText.rl configs/base.yml [key=value ...]

GRPO as DeepSeek-V3.2 trains with it (docs/rl.md), a loop above the serving engine and the trainer:
each step takes rl_prompts_per_step prompts (post_train/prompts.py: records of the data pipelines,
rendered in DeepSeek-V3.2's chat format), the in-process ServingEngine samples rl_num_generations
completions of each (decode_sampling_* keys; a prompt's G samples share its pages through the prefix
cache), the reward (rl_reward, post_train/rewards.py) scores them, and rl_num_iterations updates of
the GRPO loss (post_train/grpo.py) run through train.py's jitted train step (the same sharding,
optimizer, finite-state guard). The new weights reach the engine through load_weights (its compiled
programs stay). Per sampled token the engine records its logprob (pi_old), the experts each MoE
layer routed it to, and the size of the top-k/top-p kept set: the trainer's logprobs take the
recorded routing (rl_keep_routing) and renormalize over the kept set (rl_keep_sampling_mask).
rl_beta > 0 holds a frozen reference: the starting policy (load_parameters_path's, or the seeded init).

The run folder is train.py's: <base_output_directory>/<run_name>/ holds config.yml, checkpoints/ (the
train state every checkpoint_period steps and at the last; a checkpoint's step is the RL step) and
tensorboard/. The same command resumes from the newest checkpoint: step n's prompts and sampling
seeds are functions of (data, seed, n), so a resumed run continues the run it was. load_parameters_path
starts from an SFT run's checkpoints. eval_interval > 0: the held-out reward of greedy completions of
the eval records (eval_dataset_path / grain_eval_files / hf_eval_files) at step 0 and every
eval_interval steps. Metrics per step (console every log_period steps, tensorboard every step):
reward mean / std, kl, clip_fraction, masked_fraction, routing_agreement, rollout_s, train_s.
"""

from __future__ import annotations

import sys

if not __package__ and __name__ == "__main__":  # run as `python MaxText/rl.py`: import the package
  import _script_path  # noqa: F401

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from MaxText import train as trainer
from MaxText.checkpoint import model_state, orbax_state
from MaxText.checkpoint.run_folder import RunFolder
from MaxText.config import pyconfig
from MaxText.config.types import Config, ConfigError
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.post_train import grpo
from MaxText.post_train.policy_logprobs_standin import token_logprobs
from MaxText.post_train.prompts import PromptSource
from MaxText.post_train.rewards import load_reward
from MaxText.runtime import cli, compile_cache, distributed, sharding
from MaxText.runtime.metrics import MetricsLogger

_ROLLOUT = {"rollout": True} if "rollout" in SamplingParams.__dataclass_fields__ else {}  # STAND-IN: i42a adds it


def check_config(config: Config) -> None:
  """The cross-key rules of an RL run: one ConfigError line naming the key."""
  if config.decode_sampling_strategy == "greedy":
    raise ConfigError("decode_sampling_strategy=greedy: RL samples rl_num_generations different completions per "
                      "prompt: use decode_sampling_strategy=temperature or top_p")
  if not config.tokenizer_path:
    raise ConfigError("tokenizer_path is empty: RL renders prompts and scores completions as text")
  if config.chat_template_path:
    raise ConfigError("chat_template_path: RL renders prompts in DeepSeek-V3.2's format only (set it to \"\")")
  if config.rl_max_completion_tokens >= config.max_target_length:
    raise ConfigError(f"rl_max_completion_tokens={config.rl_max_completion_tokens} leaves no room for a prompt in "
                      f"max_target_length={config.max_target_length}")
  n = config.rl_prompts_per_step * config.rl_num_generations
  if n % config.gradient_accumulation_steps:
    raise ConfigError(f"gradient_accumulation_steps={config.gradient_accumulation_steps} does not divide the "
                      f"{n} sequences of a step (rl_prompts_per_step x rl_num_generations)")
  if config.weight_quantization != "none":
    raise ConfigError(f"weight_quantization={config.weight_quantization}: RL trains float weights (none)")


def sampling_params(config: Config, step: int, row: int) -> SamplingParams:
  """Row `row` of step `step`: the decode_sampling_* keys, a seed of (seed, step, row) (a resumed run
  samples what it would have), and the engine's per-token rollout records."""
  seed = int(np.random.default_rng([config.seed, step, row]).integers(2 ** 62))
  return SamplingParams(max_tokens=config.rl_max_completion_tokens, temperature=config.decode_sampling_temperature,
                        top_p=config.decode_sampling_nucleus_p if config.decode_sampling_strategy == "top_p" else 1.0,
                        seed=seed, **_ROLLOUT)


@dataclasses.dataclass
class Batch:
  """A step's rollouts as the loss reads them, host numpy [N,T] (N = B x G, T = max_target_length)."""
  arrays: dict  # tokens, positions, segment_ids, mask, advantages [N], logp_old?, kept?, routed_experts?
  rewards: np.ndarray  # [N]
  generated: int  # tokens the engine sampled


def completion(request, eos_id: int) -> list[int]:
  """The sampled tokens of a finished request: its output, then the stop token when one ended it."""
  return request.output + ([eos_id] if request.finish_reason == "stop" else [])


def assemble(config: Config, requests: list, rewards: np.ndarray, eos_id: int) -> Batch:
  """The requests (a prompt's G samples adjacent) as the loss's arrays. logp_old, kept and
  routed_experts come from each request's engine records (request.rollout) when it has them."""
  n, t = len(requests), config.max_target_length
  a = {"tokens": np.zeros((n, t), np.int32), "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
       "segment_ids": np.zeros((n, t), np.int32), "mask": np.zeros((n, t), np.float32),
       "advantages": np.asarray(grpo.group_advantages(jnp.asarray(rewards), config.rl_num_generations))}
  records = [getattr(r, "rollout", None) for r in requests]
  have = all(rec is not None for rec in records)
  if have:
    a["logp_old"] = np.zeros((n, t), np.float32)
    a["kept"] = np.full((n, t), config.vocab_size, np.int32)  # unfiltered where nothing was sampled
    routed = config.num_moe_layers > 0
    if routed:
      k = config.num_experts_per_tok  # a position without a record (the stop token's) takes experts 0..k-1
      a["routed_experts"] = np.broadcast_to(np.arange(k, dtype=np.int32),
                                            (n, t, config.num_moe_layers, k)).copy()
  generated = 0
  for i, r in enumerate(requests):
    done = completion(r, eos_id)
    seq = r.prompt + done
    p, m = len(r.prompt), len(seq)
    a["tokens"][i, :m] = seq
    a["segment_ids"][i, :m] = 1
    a["mask"][i, p:m] = 1.0
    generated += len(done)
    if have:  # the contract: logprobs / kept per generated token, experts per computed position
      a["logp_old"][i, p:m] = records[i].logprobs[:len(done)]
      a["kept"][i, p:m] = records[i].kept[:len(done)]
      if routed:
        experts = np.asarray(records[i].experts)[:m]  # [positions, L, k]
        a["routed_experts"][i, :len(experts)] = experts
  if not config.rl_keep_sampling_mask:
    a.pop("kept", None)
  if not config.rl_keep_routing:
    a.pop("routed_experts", None)
  return Batch(a, rewards, generated)


def policy_logprobs(config: Config, model, batch: dict) -> jax.Array:
  """log pi [N,T] of each token under `model` at the sampling temperature, with the batch's recorded
  routing and kept sets when it carries them (rl_keep_routing, rl_keep_sampling_mask)."""
  return token_logprobs(model, batch["tokens"], batch["positions"], batch["segment_ids"],
                        temperature=config.decode_sampling_temperature, kept=batch.get("kept"),
                        routed_experts=batch.get("routed_experts"))


def grpo_loss_fn(options: grpo.GrpoOptions):
  """train.make_train_step's loss_fn: the GRPO loss of a batch (its metrics, no expert loads: the RL
  step leaves the routing biases as the engine routed with them)."""

  def loss_fn(config, graphdef, params, buffers, mb):
    logp = policy_logprobs(config, model_state.merge(graphdef, params, buffers), mb)  # [N,T]
    loss, metrics = grpo.grpo_loss(logp, mb["logp_old"], mb.get("logp_ref"), mb["advantages"], mb["mask"], options)
    return loss, (dict(metrics, loss=loss), {})

  return loss_fn


def _batch_sharding(mesh, config: Config, arrays: dict) -> dict:
  """Each array's rows (axis 0) over the batch axes; the rest replicated."""
  rules = sharding.rules_of(config)
  return {k: NamedSharding(mesh, sharding.logical_to_spec(("activation_batch",) + (None,) * (v.ndim - 1), rules,
                                                          mesh, v.shape)) for k, v in arrays.items()}


class Evaluator:
  """The held-out reward: greedy completions of every eval record, scored by the reward."""

  def __init__(self, config: Config, tokenizer, reward):
    self.source, self.reward, self.config = PromptSource(config, tokenizer, eval=True), reward, config

  def __call__(self, engine: ServingEngine) -> float:
    ids = [self.source.ids(i) for i in range(len(self.source))]
    params = SamplingParams(max_tokens=self.config.rl_max_completion_tokens, temperature=0.0)
    requests = engine.generate(ids, params)
    texts = [engine_text(self.source.tokenizer, r) for r in requests]
    wheres, records = zip(*self.source.records)
    return float(self.reward(texts, list(records), list(wheres)).mean())


def engine_text(tokenizer, request) -> str:
  return tokenizer.decode(request.output)


def rl(config: Config) -> list[dict]:
  """Runs (or resumes) RL; returns each step's metrics (and eval_reward where evaluated) as floats."""
  check_config(config)
  tokenizer = load_tokenizer(config)
  reward = load_reward(config)
  source = PromptSource(config, tokenizer)  # a bad record or prompt fails before any compile
  evaluate = Evaluator(config, tokenizer, reward) if config.eval_interval else None
  options = grpo.GrpoOptions.from_config(config)
  g, n = config.rl_num_generations, config.rl_prompts_per_step * config.rl_num_generations
  run = RunFolder(config)
  latest = orbax_state.latest_step_on_disk(config) if config.enable_checkpointing else None
  if not run.open(latest):
    return []
  print(run.describe(), flush=True)
  mesh = sharding.create_mesh(config)
  history: list[dict] = []
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    # The optimizer's schedule counts updates (steps x iterations).
    step_config = config.model_copy(update={"steps": config.steps * config.rl_num_iterations})
    graphdef, state, state_sharding, tx = trainer._init_state(step_config, mesh)
    ref_params = jax.tree.map(jnp.copy, state["params"]) if config.rl_beta > 0 else None  # the starting policy
    manager = orbax_state.create_manager(config)
    start = 0
    restored = orbax_state.restore_newest_good(manager, orbax_state.abstract_like(state, state_sharding))
    if restored is not None:
      start, state, _ = restored
      print(f"resumed from checkpoint step {start} in {config.checkpoint_dir}", flush=True)
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < config.vocab_size else None
    engine = ServingEngine(config, graphdef, state["params"], state["buffers"], sample_vocab=vocab,
                           eos_id=source.eos_id, log=lambda line: print(line, flush=True))
    logprobs_jit = jax.jit(lambda p, b, batch: policy_logprobs(config, model_state.merge(graphdef, p, b), batch))
    step_fn = None
    logger = MetricsLogger(config, start_step=start) if distributed.is_main_process() else distributed.Silent()
    try:
      if evaluate is not None and start == 0:
        history.append(_log_eval(logger, 0, evaluate(engine)))
      for step in range(start + 1, config.steps + 1):
        engine.load_weights(state["params"], state["buffers"])  # the policy's weights, no recompile
        t0 = time.perf_counter()
        rows = source.step(step)
        prompts = [ids for _, _, ids in rows for _ in range(g)]
        requests = engine.generate(prompts, [sampling_params(config, step, i) for i in range(n)])
        texts = [engine_text(tokenizer, r) for r in requests]
        rewards = reward(texts, [rec for _, rec, _ in rows for _ in range(g)], [w for w, _, _ in rows for _ in range(g)])
        batch = assemble(config, requests, rewards, source.eos_id)
        rollout_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        arrays = dict(batch.arrays)
        shardings = _batch_sharding(mesh, config, {**arrays, "logp_old": arrays["tokens"], "logp_ref": arrays["tokens"]})
        dev = {k: jax.device_put(v, shardings[k]) for k, v in arrays.items()}
        if "logp_old" not in dev:  # STAND-IN until the engine records pi_old: the policy's own forward
          dev["logp_old"] = logprobs_jit(state["params"], state["buffers"], dev)
        if ref_params is not None:
          dev["logp_ref"] = logprobs_jit(ref_params, state["buffers"], dev)
        if step_fn is None:
          step_fn = trainer.jit_train_step(step_config, graphdef, tx, state_sharding,
                                           {k: shardings[k] for k in dev}, mesh, grpo_loss_fn(options))
        updates = []
        for _ in range(config.rl_num_iterations):
          state, metrics = step_fn(state, dev)
          updates.append(metrics)
        updates = [{k: float(v) for k, v in jax.device_get(m).items()} for m in updates]
        if not all(u.pop("finite") for u in updates):
          raise trainer.TrainingError(f"step {step}: the GRPO loss or the updated parameters are not finite "
                                      f"({updates[-1]}); this state is not saved: lower learning_rate")
        train_s = time.perf_counter() - t1
        real = float(arrays["segment_ids"].sum())
        m = dict(updates[0], step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                 completion_tokens=batch.generated / n, rollout_s=rollout_s, train_s=train_s,
                 rollout_tokens_per_s=batch.generated / rollout_s,
                 train_tokens_per_s=real * config.rl_num_iterations / train_s)
        m["loss"] = updates[-1]["loss"]
        _log(logger, config, step, m)
        if evaluate is not None and (step % config.eval_interval == 0 or step == config.steps):
          engine.load_weights(state["params"], state["buffers"])
          m.update(_log_eval(logger, step, evaluate(engine)))
        history.append(m)
        if manager is not None and (step % config.checkpoint_period == 0 or step == config.steps):
          orbax_state.save(manager, step, state, {"rl_step": step})
          print(f"checkpoint step {step}: {config.checkpoint_dir}/{step}", flush=True)
    finally:
      logger.close()
      orbax_state.finish(manager)
  return history


CONSOLE = ("reward_mean", "reward_std", "kl", "clip_fraction", "masked_fraction", "completion_tokens",
           "rollout_s", "train_s")


def _log(logger, config: Config, step: int, m: dict) -> None:
  if getattr(logger, "writer", None) is not None:
    for k, v in m.items():
      logger.writer.add_scalar(f"rl/{k}", v, step)
  if step % config.log_period == 0 or step in (1, config.steps):
    print(f"step {step}/{config.steps} | " + " | ".join(f"{k} {m[k]:.4g}" for k in CONSOLE), flush=True)


def _log_eval(logger, step: int, value: float) -> dict:
  if getattr(logger, "writer", None) is not None:
    logger.writer.add_scalar("rl/eval_reward", value, step)
  print(f"eval step {step} | held-out reward (greedy) {value:.4f}", flush=True)
  return {"step": step, "eval_reward": value}


def main(argv) -> None:
  config = pyconfig.initialize_or_exit(argv, __doc__, num_devices=distributed.initialize)
  cli.quiet_libraries()
  compile_cache.enable(config)
  cli.run(lambda: rl(config))


if __name__ == "__main__":
  distributed.run_main(main, sys.argv)
