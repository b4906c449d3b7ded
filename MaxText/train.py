"""Training: python MaxText/train.py configs/base.yml [key=value ...]

The loop jit-compiles one train step over the device mesh: AdamW (warmup + cosine, global-norm
clipping), gradient accumulation, LM cross-entropy ignoring padding (+ z-loss, + MTP, + the
optional MoE balance loss), the aux-loss-free routing-bias update after each step, and the
DeepSeek-V3.2 indexer recipe selected by `indexer_training_stage` (what each stage means:
layers/indexer.py STAGES; here it decides which parameters train and which losses count).

The run folder <base_output_directory>/<run_name>/ holds config.yml, checkpoints/ (orbax, every
checkpoint_period steps and at the last), tensorboard/ and profile/. The same command resumes from the
newest usable checkpoint (same model and data keys, else one line names the keys); a finished run says
so. load_parameters_path starts a NEW run (step 0, fresh optimizer) from the params + buffers of a
converter output, a run's checkpoints folder (newest step), one step folder or its state subfolder.
A state is checkpointed only while its parameters are finite, and a checkpoint whose parameters then
give a non-finite loss is set aside: the error names the newest good checkpoint to resume from.
eval_interval > 0: the loss on held-out data (eval_dataset_path, or a held-out synthetic stream).
profiler=xplane: a jax.profiler trace under <run>/profile.
lora_rank > 0: only LoRA adapters train, over the frozen base of load_parameters_path (fp8_block allowed);
checkpoints hold the adapters and their optimizer state, and record the base (a resume over another is refused);
lora_restore_path starts a new run from a LoRA run's adapters instead of B = 0 (docs/lora.md).
"""

from __future__ import annotations

import sys

if not __package__ and __name__ == "__main__":  # run as `python MaxText/train.py`: import the package, not from MaxText/
  # (grain's worker processes rerun this file as __mp_main__ with the parent's sys.path, already fixed)
  import _script_path  # noqa: F401

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from MaxText.checkpoint import lora_adapters, model_state, orbax_state
from MaxText.checkpoint.run_folder import RunFolder
from MaxText.config.types import Config, ConfigError
from MaxText.data import input_pipeline
from MaxText.layers import lora
from MaxText.layers.indexer import indexer_stage
from MaxText.layers.models import cross_entropy, mtp_inputs, mtp_loss, token_accuracy
from MaxText.layers.moe import update_routing_bias
from MaxText.runtime import cli, distributed, optimizers, sharding
from MaxText.runtime.cli import RunError
from MaxText.runtime.metrics import MetricsLogger, model_flops_per_token, peak_flops_per_device, warn
from MaxText.runtime.metrics_prefetch import DeferredMetrics
from MaxText.runtime.optimizers import create_optimizer, learning_rate_schedule
from MaxText.runtime.profiler import Profiler


class TrainingError(RunError):
  """A run that must stop (non-finite loss or parameters): the message says why and what was kept."""


def _path_names(path) -> list[str]:
  return [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]


def trainable_labels(config: Config, params) -> dict:
  """'train' / 'freeze' per parameter, from the indexer training stage: an indexer trains where its
  stage has an indexer loss (no loss: no update, no decay), the rest where the main model trains."""
  stage = indexer_stage(config)

  def label(path, _):
    trains = stage.indexer_loss if "indexer" in _path_names(path) else stage.trains_main_model
    return "train" if trains else "freeze"

  return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(config: Config, params) -> optax.GradientTransformation:
  """AdamW on the parameters the indexer training stage trains; the others frozen (trainable_labels).
  Under LoRA `params` are the adapters alone (model_parts). fp8 block-quantized weights are a serving and
  loading format, and the frozen base of LoRA: no gradient step can update them."""
  if config.weight_quantization != "none" and not config.lora_rank:
    raise ConfigError(f"weight_quantization={config.weight_quantization}: fp8 weights are for serving and loading "
                      "(decode, serve, convert/export); train on float weights: weight_quantization=none (for "
                      "DeepSeek-V3.2's fp8 release: python -m MaxText.convert_hf_checkpoint --hf-path DIR --output "
                      "OUT weight_quantization=none dequantizes it, then load_parameters_path=OUT; or train adapters over the frozen "
                      "fp8 base: lora_rank=N)")
  return create_optimizer(config, trainable_labels(config, params))


def model_parts(config: Config, params: dict, buffers: dict) -> dict:
  """The train state's model entries from the model's (params, buffers) pure dicts (arrays or abstract):
  {"params": what the optimizer trains, "buffers": what the step updates}; under LoRA the params are the
  adapters, the buffers none, and orbax_state.FROZEN holds the base (its params and routing biases), which
  the step passes through untouched and a checkpoint leaves out."""
  if not config.lora_rank:
    return {"params": params, "buffers": buffers}
  adapters, base = lora.split(params)
  return {"params": adapters, "buffers": {}, orbax_state.FROZEN: lora.join(base, buffers)}


def model_buffers(state: dict) -> dict:
  """What the loss merges beside state["params"]: the buffers, and under LoRA the frozen base with them."""
  frozen = state.get(orbax_state.FROZEN)
  return state["buffers"] if frozen is None else lora.join(state["buffers"], frozen)


def update_routing_biases(config: Config, buffers, aux) -> dict:
  """Aux-loss-free balancing: each MoE layer's bias moves against its measured expert load (a loss
  that reports no loads, the RL loss, leaves the biases)."""
  if not config.routed_bias or config.num_moe_layers + config.mtp_num_layers == 0 or not aux:
    return buffers

  def upd(path, bias):
    names = _path_names(path)
    if names[0] == "moe_layers":
      load = aux["expert_load"]  # [L_moe,E]: the stacked biases' [L_moe,E] (scan_layers)
      if not config.scan_layers:  # moe_layers/layers/<i>/...: layer i's own bias [E]
        load = load[int(names[2])]
    elif names[0] == "mtp":
      load = aux["mtp_expert_load"][int(names[1])]  # [E]
    else:
      return bias
    return update_routing_bias(bias, load, config.routed_bias_update_rate)

  return jax.tree_util.tree_map_with_path(upd, buffers)


def lm_loss_fn(config: Config, graphdef, params, buffers, mb):
  """The LM loss of a microbatch (make_train_step's default loss_fn): (loss, (metrics with "loss", expert loads))."""
  model = model_state.merge(graphdef, params, buffers)
  mtp_b = {k: jnp.swapaxes(mb[k], 0, 1) for k in ("mtp_tokens", "mtp_targets", "mtp_weights") if k in mb}  # [n,b,t]
  logits, aux = model(mb["inputs"], mb["positions"], mb["segment_ids"], mtp_b.get("mtp_tokens"))
  _, lm, z = cross_entropy(logits, mb["targets"], mb["weights"], config.z_loss_weight)
  mtp = mtp_loss(aux["mtp_logits"], mtp_b["mtp_targets"], mtp_b["mtp_weights"]) \
      if config.mtp_num_layers else jnp.float32(0)
  balance = aux.get("load_balance_loss", jnp.float32(0))
  indexer = aux["indexer_loss"]
  stage = indexer_stage(config)
  total = lm + z + config.mtp_loss_scaling_factor * mtp + balance if stage.trains_main_model else jnp.float32(0)
  if stage.indexer_loss:
    total = total + config.indexer_loss_weight * indexer
  metrics = {"loss": total, "lm_loss": lm, "accuracy": token_accuracy(logits, mb["targets"], mb["weights"]),
             "z_loss": z, "mtp_loss": mtp, "indexer_loss": indexer,
             "load_balance_loss": balance, "moe_dropped": aux.get("moe_dropped", jnp.float32(0))}
  loads = {k: aux[k] for k in ("expert_load", "mtp_expert_load") if aux.get(k) is not None}
  return total, (metrics, loads)


def loss_legend(config: Config) -> str:
  """The console line's losses named, as lm_loss_fn adds them: `loss` is what the step minimizes, each part with its
  weight; `lm` alone is the language model's progress (an indexer KL that grows can hide a falling lm in `loss`)."""
  stage = indexer_stage(config)
  parts = []
  if stage.trains_main_model:
    parts.append("lm")
    if config.z_loss_weight:
      parts.append(f"z_loss ({config.z_loss_weight:g} x log Z^2)")
    if config.mtp_num_layers:
      parts.append(f"{config.mtp_loss_scaling_factor:g} x mtp")
    if config.load_balance_loss_weight:
      parts.append("load balance")
  if stage.indexer_loss:
    parts.append(f"{config.indexer_loss_weight:g} x indexer")
  said = [f"loss = {' + '.join(parts)}", "lm: next-token cross-entropy (the language model's progress)"]
  if stage.indexer_loss:
    said.append("indexer: KL(attention || indexer scores) over the keys attended to (trains the indexer alone)")
  if config.mtp_num_layers:
    said.append("mtp: the MTP module's cross-entropy")
  return "losses: " + "; ".join(said)


def prepare_batch(config: Config, batch: dict) -> dict:
  """Host-side, in ORIGINAL order: adds MTP's shifted inputs/targets/weights ([b,n,t]), then with
  context parallelism + load balancing reorders every [..,t] array the same way (zig-zag)."""
  out = {k: np.asarray(v) for k, v in batch.items()}
  if config.mtp_num_layers:
    m = mtp_inputs(out["inputs"], out["targets"], out["weights"], out["segment_ids"], config.mtp_num_layers)
    out.update({k: np.swapaxes(np.asarray(v), 0, 1) for k, v in m.items()})  # [b,n,t]
  if config.ici_context_parallelism > 1 and config.context_parallel_load_balance:
    perm = sharding.load_balance_permutation(out["inputs"].shape[-1], config.ici_context_parallelism)
    out = {k: v[..., perm] for k, v in out.items()}
  return out


def batch_shardings(config: Config, mesh, batch: dict) -> dict:
  """Batch over the batch axes, the sequence (last axis) over `context`. `batch` may be one
  process's rows: the shardings are those of the global batch."""
  rules = sharding.rules_of(config)

  def one(x):
    names = ("activation_batch",) + (None,) * (x.ndim - 2) + ("activation_length",)
    return NamedSharding(mesh, sharding.logical_to_spec(names, rules, mesh, (config.global_batch_size,) + x.shape[1:]))

  return {k: one(v) for k, v in batch.items()}


def make_train_step(config: Config, graphdef, tx, loss_fn=None):
  """state {params, buffers, opt_state, step} x batch -> (new state, metrics). loss_fn(config, graphdef,
  params, buffers, batch) -> (loss, (metrics with "loss", expert loads)): default the LM loss (lm_loss_fn);
  the RL loop (MaxText/rl.py) passes its GRPO loss."""
  loss_fn = loss_fn or lm_loss_fn
  grad_fn = jax.value_and_grad(lambda p, b, mb: loss_fn(config, graphdef, p, b, mb), has_aux=True)
  accum = config.gradient_accumulation_steps
  schedule = learning_rate_schedule(config)

  def step(state, batch):
    params, buffers = state["params"], model_buffers(state)
    if accum == 1:
      (_, (metrics, loads)), grads = grad_fn(params, buffers, batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)  # [A,b/A,t]

      def one(mb):
        (_, aux), g = grad_fn(params, buffers, mb)
        return g, aux

      def body(carry, mb):
        return jax.tree.map(jnp.add, carry, one(mb)), None

      shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      (grads, (metrics, loads)), _ = jax.lax.scan(body, zeros, micro)
      grads, metrics, loads = jax.tree.map(lambda x: x / accum, (grads, metrics, loads))
    updates, opt_state = tx.update(grads, optimizers.on_device(config, state["opt_state"]), params)
    new_params = optax.apply_updates(params, updates)
    new_buffers = update_routing_biases(config, state["buffers"], loads)  # under LoRA none: the base is frozen
    # The state may be checkpointed only if finite: one global norm of the new parameters (a NaN or
    # inf anywhere makes it non-finite) and the loss. The host reads it with the other metrics.
    param_norm = optax.tree.norm(new_params)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(param_norm)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state["step"]),
                   param_norm=param_norm, finite=finite)
    new_state = dict(state, params=new_params, buffers=new_buffers, opt_state=opt_state, step=state["step"] + 1)
    return new_state, metrics

  return step


def jit_train_step(config: Config, graphdef, tx, state_sharding, batch_sharding, mesh, loss_fn=None):
  """The jitted train step: state and batch in with their shardings, state out with the same
  (donated), metrics replicated. train() runs it; train_compile compiles it from abstract inputs."""
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(make_train_step(config, graphdef, tx, loss_fn), in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=(0,))


def abstract_train_step(config: Config, mesh):
  """(abstract state, abstract batch, jitted step) exactly as train() builds them, with nothing
  allocated: ShapeDtypeStruct leaves carrying train()'s shardings. Call under the mesh and rules."""
  graphdef, params, buffers = model_state.abstract_on_mesh(config, mesh)
  parts = model_parts(config, params, buffers)
  tx = make_optimizer(config, parts["params"])
  opt_abstract = jax.eval_shape(tx.init, parts["params"])
  opt_state = orbax_state.abstract_like(opt_abstract,
                                        model_state.optimizer_shardings(opt_abstract, parts["params"], mesh,
                                                                        optimizers.state_memory_kind(config)))
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = dict(parts, opt_state=opt_state, step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
  b, t = config.global_batch_size, config.max_target_length
  host = {k: np.zeros((b, t), np.float32 if k == "weights" else np.int32) for k in input_pipeline.BATCH_KEYS}
  host = prepare_batch(config, host)
  batch_sharding = batch_shardings(config, mesh, host)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding[k]) for k, v in host.items()}
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  return state, batch, jit_train_step(config, graphdef, tx, state_sharding, batch_sharding, mesh)


def make_eval_step(config: Config, graphdef):
  """(params, buffers, batch) -> the loss metrics, no gradients."""
  def step(params, buffers, batch):
    _, (metrics, _) = lm_loss_fn(config, graphdef, params, buffers, batch)
    return metrics
  return step


def active_params(config: Config, total: int) -> int:
  """Parameters a token's forward touches (routed experts: only num_experts_per_tok of them), no embedding."""
  per_expert = 3 * config.emb_dim * config.moe_mlp_dim
  unused = (config.num_experts - config.num_experts_per_tok) * per_expert * (config.num_moe_layers + config.mtp_num_layers)
  return total - unused - config.vocab_size * config.emb_dim


def _non_finite(config: Config, manager, step: int, metrics: dict, pending: int | None) -> TrainingError:
  """The error for a step whose loss or new parameters are not finite. Its loss is that of the
  parameters it started from: if those were just checkpointed (`pending`), that checkpoint is
  poisoned and set aside, so the newest good one is what the message names."""
  said = (f"step {step}: loss {metrics['loss']} (lm_loss {metrics['lm_loss']}), grad_norm {metrics['grad_norm']}, "
          f"norm of the updated parameters {metrics['param_norm']}; this state is not saved")
  if manager is not None and pending is not None and not math.isfinite(metrics["loss"]):
    moved = orbax_state.set_aside(manager, pending)
    said += f"; checkpoint step {pending} gives this loss, set aside in {moved}"
  good = manager.latest_step() if manager is not None else None
  if good is None:
    return TrainingError(f"{said}; no good checkpoint to resume from: lower learning_rate "
                         f"(now {config.learning_rate:g}) and start again")
  return TrainingError(f"{said}; newest good checkpoint: step {good} ({config.checkpoint_dir}/{good}); run again "
                       f"to resume from it, with a lower learning_rate (now {config.learning_rate:g})")


def init_state(config: Config, mesh):
  """graphdef, the train state (params from load_parameters_path or random, a fresh optimizer at step
  0), its shardings, and the optimizer. Under LoRA the adapters are B = 0, or lora_restore_path's, over a base
  checked against the one the run's own checkpoints record (lora_adapters.restored)."""
  if config.load_parameters_path:
    graphdef, params, buffers, _ = model_state.load_parameters(config.load_parameters_path, config, mesh)
    print(f"parameters from load_parameters_path={config.load_parameters_path} (a new run: step 0, fresh "
          "optimizer)", flush=True)
  else:
    graphdef, params, buffers, _ = model_state.create(config, mesh)
  parts = model_parts(config, params, buffers)
  if config.lora_rank:
    parts["params"] = lora_adapters.restored(config, parts["params"], parts[orbax_state.FROZEN])
  tx = make_optimizer(config, parts["params"])
  opt_state = model_state.init_optimizer(tx, parts["params"], mesh, optimizers.state_memory_kind(config))
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = dict(parts, opt_state=opt_state, step=jax.device_put(jnp.int32(0), replicated))
  # Scalars the optimizer creates (its step count) land on one device: replicate them on the mesh.
  state = jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
                       else jax.device_put(x, replicated), state)
  # One sharding per leaf, used for in and out of the step: a layout that merely reads
  # differently (P() vs P(None, None)) would otherwise recompile the step once.
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  return graphdef, state, state_sharding, tx


class _Eval:
  """eval_steps held-out batches (the same each time), on the device once; their mean loss."""

  def __init__(self, config: Config, graphdef, data, batch_sharding, replicated):
    self.config = config
    self.batches = [distributed.global_batch(prepare_batch(config, data.source[i]), batch_sharding,
                                             config.global_batch_size) for i in range(config.eval_steps)]
    self.fn = jax.jit(make_eval_step(config, graphdef), out_shardings=replicated)

  def due(self, step: int) -> bool:
    return bool(self.config.eval_interval) and (step % self.config.eval_interval == 0 or step == self.config.steps)

  def __call__(self, state) -> dict[str, float]:
    runs = [jax.device_get(distributed.settled(self.fn(state["params"], model_buffers(state), b))) for b in self.batches]
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def train(config: Config) -> dict:
  """Runs (or resumes) training; returns the last step's metrics as floats, and the last eval's as
  eval_<name> ({} for a finished run)."""
  run = RunFolder(config)
  latest = orbax_state.latest_step_on_disk(config) if config.enable_checkpointing else None
  if not run.open(latest):
    return {}
  print(run.describe(), flush=True)
  mesh = sharding.create_mesh(config)
  rows = distributed.batch_rows(config, mesh)  # each process loads only the rows its devices hold
  # Data first: a bad dataset or tokenizer fails in seconds, before any compilation.
  data = input_pipeline.create_data_iterator(config, **rows)
  eval_data = input_pipeline.create_eval_iterator(config, tokenizer=data.tokenizer, **rows) \
      if config.eval_interval else None
  with jax.set_mesh(mesh), sharding.logical_rules(config, mesh):
    graphdef, state, state_sharding, tx = init_state(config, mesh)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    manager = orbax_state.create_manager(config)
    start_step = 0
    restored = orbax_state.restore_newest_good(manager, orbax_state.abstract_like(state, state_sharding))
    if restored is not None:
      start_step, saved, data_state = restored
      state = dict(state, **saved)  # under LoRA the frozen base is not in a checkpoint: it stays as loaded
      data.set_state(data_state)
      print(f"resumed from checkpoint step {start_step} in {config.checkpoint_dir}", flush=True)
    # A checkpoint whose own loss is not known yet: the next step computes it from its parameters.
    pending = start_step if restored is not None else None

    first = prepare_batch(config, next(data))
    batch_sharding = batch_shardings(config, mesh, first)
    step_fn = jit_train_step(config, graphdef, tx, state_sharding, batch_sharding, mesh)
    evaluate = _Eval(config, graphdef, eval_data, batch_sharding, replicated) if eval_data is not None else None

    n_params = model_state.count_params(state["params"])
    if config.lora_rank:
      n_base = model_state.count_params(model_buffers(state))
      print(f"LoRA rank {config.lora_rank}: {n_params:,} trained adapter parameters over a frozen base of "
            f"{n_base:,} (weight_quantization={config.weight_quantization})", flush=True)
      narrow = lora.skipped(nnx.merge(*model_state.abstract_model(config.model_copy(update={"lora_rank": 0}))), config)
      if narrow:
        print(f"LoRA: the default lora_module_path leaves out {len(narrow)} kernel(s) narrower than lora_rank="
              f"{config.lora_rank}: {', '.join(narrow)} (lora_rank <= their smaller side adapts them)", flush=True)
      n_params += n_base
    flops_per_token = model_flops_per_token(config, active_params(config, n_params))
    peak = peak_flops_per_device()[0] * mesh.size
    print(f"model {config.model_name}: {n_params:,} parameters; mesh {config.mesh_shape}; "
          + (f"indexer_training_stage={config.indexer_training_stage}" if config.use_indexer else
             "no indexer (use_indexer=false): dense attention"), flush=True)
    print(loss_legend(config), flush=True)
    logger = MetricsLogger(config, start_step=start_step) if distributed.is_main_process() else distributed.Silent()
    profiler = Profiler(config, start_step)
    tokens_per_step = config.global_batch_size * config.max_target_length
    last, last_eval = {}, {}

    def report(step, metrics, seconds):
      """Step `step`'s metrics, read: the NaN guard, then console and tensorboard."""
      nonlocal last, pending
      if not metrics.pop("finite"):
        raise _non_finite(config, manager, step, metrics, pending)
      pending = None
      metrics["tokens_per_s"] = tokens_per_step / seconds
      metrics["mfu"] = flops_per_token * metrics["tokens_per_s"] / peak
      logger.log(step, metrics)
      if metrics["moe_dropped"] > 0 and (step % config.log_period == 0 or step == start_step + 1):
        warn(f"step {step}: {metrics['moe_dropped']:.2%} of the expert assignments were past capacity and "
             f"dropped (moe_capacity_factor={config.moe_capacity_factor}; -1 = dropless)")
      last = metrics

    deferred = DeferredMetrics()  # step n's metrics are read once step n+1 is dispatched
    try:
      for step in range(start_step + 1, config.steps + 1):
        batch = first if step == start_step + 1 else prepare_batch(config, next(data))
        batch = distributed.global_batch(batch, batch_sharding, config.global_batch_size)
        profiler.before_step(step)
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batch)
        for done in deferred.push(step, metrics, t0):
          report(*done)
        profiler.after_step(step)
        eval_due = evaluate is not None and evaluate.due(step)
        save_due = manager is not None and (step % config.checkpoint_period == 0 or step == config.steps)
        if eval_due or save_due:
          for done in deferred.flush():  # this step's own metrics first: only a good state is saved
            report(*done)
          # step n done on EVERY local device (its metrics were read from one) before the eval, the data
          # state's gather and the checkpoint's checks launch their collectives (distributed.settled)
          distributed.settled(state)
        if eval_due:
          last_eval = evaluate(state)
          logger.log_eval(step, last_eval)
        if save_due:
          orbax_state.save(manager, step, state, data.get_state())
          pending = step
          print(f"checkpoint step {step}: {config.checkpoint_dir}/{step}", flush=True)
      for done in deferred.flush():
        report(*done)
    finally:
      profiler.stop()
      logger.close()
      data.close()  # grain worker processes, if any
      orbax_state.finish(manager)
  if last and distributed.is_main_process():
    weights = ("not saved (enable_checkpointing=false)" if manager is None
               else f"LoRA adapters (rank {config.lora_rank}) in {config.checkpoint_dir}, over the base "
                    f"load_parameters_path={config.load_parameters_path or '(random init)'}" if config.lora_rank
               else f"load_parameters_path={config.checkpoint_dir}")
    print(logger.summary(start_step + 1, config.steps, last, weights), flush=True)
  return dict(last, **{f"eval_{k}": v for k, v in last_eval.items()}) if last else last


def main(argv) -> None:
  cli.entry_point(argv, __doc__, train)


if __name__ == "__main__":
  distributed.run_main(main, sys.argv)
