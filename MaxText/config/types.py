"""The config schema: one pydantic class per concern, composed into `Config`.

Types and constraints live here; defaults live only in configs/base.yml (a unit test
holds the two equal key for key). Cross-key rules that need more than one concern are
in `Config._check_combinations`; derived values (head dims, layer counts, paths) are
properties so they can never disagree with the keys they come from.
"""

from __future__ import annotations

import math
import os
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, field_validator, model_validator

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
# A list of names where a single name also means a one-name list (`train_data_columns=text`, as MaxText's users write)
Names = Annotated[tuple[str, ...], BeforeValidator(lambda v: (v,) if isinstance(v, str) else v)]


class _Section(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class RunInfo(_Section):
  run_name: str
  base_output_directory: str
  model_name: str
  seed: int
  jax_cache_dir: str


class ModelShape(_Section):
  vocab_size: PosInt
  emb_dim: PosInt
  mlp_dim: PosInt
  num_decoder_layers: PosInt
  first_num_dense_layers: NonNegInt
  normalization_layer_epsilon: Annotated[float, Field(gt=0)]
  dtype: Literal["float32", "bfloat16"]
  weight_dtype: Literal["float32", "bfloat16"]
  weight_quantization: Literal["none", "fp8_block"]
  weight_block_size: tuple[PosInt, PosInt]
  matmul_precision: Literal["default", "high", "highest"]
  param_init_std: Annotated[float, Field(gt=0)]
  scan_layers: bool
  remat_policy: Literal["none", "full", "minimal", "save_dot_except_mlp", "save_attention_out",
                        "save_attention_selection", "save_qkv_proj", "save_out_proj", "offload_qkv_proj",
                        "offload_out_proj"]


class MlaAttention(_Section):
  attention_type: Literal["mla", "mha"]
  num_query_heads: PosInt
  q_lora_rank: NonNegInt
  kv_lora_rank: PosInt
  qk_nope_head_dim: PosInt
  qk_rope_head_dim: PosInt
  v_head_dim: PosInt
  sparse_attention_impl: Literal["auto", "mask", "gather"]
  sparse_attention_gather_min_length: NonNegInt
  sparse_attention_query_block: PosInt
  sparse_attention_block_remat: bool


class Rope(_Section):
  rope_type: Literal["yarn", "default"]
  rope_max_timescale: Annotated[float, Field(gt=0)]
  rope_factor: Annotated[float, Field(ge=1)]
  original_max_position_embeddings: PosInt
  beta_fast: Annotated[float, Field(gt=0)]
  beta_slow: Annotated[float, Field(gt=0)]
  mscale: Annotated[float, Field(gt=0)]
  max_position_embeddings: PosInt


class AttentionIndexer(_Section):
  use_indexer: bool
  indexer_n_heads: PosInt
  indexer_head_dim: PosInt
  indexer_topk: PosInt
  indexer_use_approx_top_k: bool
  indexer_approx_top_k_recall: Annotated[float, Field(gt=0, le=1)]
  indexer_mask_exact_topk: bool
  indexer_hadamard: bool
  indexer_head_chunk: PosInt
  indexer_training_stage: Literal["none", "dense_warmup", "sparse"]
  indexer_loss_weight: Annotated[float, Field(ge=0)]


class DeepSeekMoE(_Section):
  num_experts: PosInt
  num_experts_per_tok: PosInt
  n_routing_groups: PosInt
  topk_routing_group: PosInt
  shared_experts: NonNegInt
  moe_mlp_dim: PosInt
  routed_scaling_factor: Annotated[float, Field(gt=0)]
  routed_score_func: Literal["sigmoid", "softmax"]
  norm_topk_prob: bool
  routed_bias: bool
  routed_bias_update_rate: Annotated[float, Field(ge=0)]
  load_balance_loss_weight: Annotated[float, Field(ge=0)]
  moe_capacity_factor: float
  moe_exchange: Literal["auto", "all_to_all", "ragged_all_to_all"]


class MultiTokenPrediction(_Section):
  mtp_num_layers: NonNegInt
  mtp_loss_scaling_factor: Annotated[float, Field(ge=0)]


class Training(_Section):
  steps: PosInt
  global_batch_size: PosInt
  max_target_length: PosInt
  gradient_accumulation_steps: PosInt
  learning_rate: Annotated[float, Field(gt=0)]
  warmup_steps: NonNegInt
  cosine_learning_rate_final_fraction: Annotated[float, Field(ge=0, le=1)]
  adam_b1: Annotated[float, Field(ge=0, lt=1)]
  adam_b2: Annotated[float, Field(ge=0, lt=1)]
  adam_eps: Annotated[float, Field(gt=0)]
  adam_weight_decay: Annotated[float, Field(ge=0)]
  opt_moments_dtype: Literal["float32", "bfloat16"]
  optimizer_memory_host_offload: bool
  gradient_clipping_threshold: Annotated[float, Field(ge=0)]
  z_loss_weight: Annotated[float, Field(ge=0)]
  log_period: PosInt


class Lora(_Section):
  lora_rank: NonNegInt
  lora_alpha: Annotated[float, Field(gt=0)]
  lora_module_path: Annotated[str, Field(min_length=1)]
  lora_restore_path: str  # a LoRA run's adapters to start from (checkpoint/lora_adapters.py restored)
  lora_check_base: bool  # false: adapters over a base other than the one their checkpoint records (a warning)

  @field_validator("lora_module_path")
  @classmethod
  def _regex(cls, v: str) -> str:
    try:
      re.compile(v)
    except re.error as e:
      raise ValueError(f"not a regular expression ({e})") from None
    return v


class Data(_Section):
  dataset_type: Literal["synthetic", "synthetic_retrieval", "file", "grain", "hf"]
  retrieval_pairs: PosInt
  retrieval_queries: PosInt
  retrieval_keys: PosInt
  retrieval_values: PosInt
  retrieval_pair_tokens: Literal[1, 2]
  dataset_path: str
  jsonl_text_field: str
  grain_train_files: str
  grain_file_type: Literal["arrayrecord", "parquet"]
  grain_worker_count: NonNegInt
  hf_path: str
  train_data_columns: Names
  tokenize_train_data: bool
  tokenizer_type: Literal["sentencepiece", "hf"]
  tokenizer_path: str
  add_bos: bool
  add_eos: bool
  pad_id: NonNegInt
  bos_id: NonNegInt
  eos_id: NonNegInt
  use_sft: bool
  sft_train_on_completion_only: bool


class Checkpointing(_Section):
  enable_checkpointing: bool
  checkpoint_period: PosInt
  max_checkpoints_to_keep: PosInt
  async_checkpointing: bool
  load_parameters_path: str


class Metrics(_Section):
  enable_tensorboard: bool


class EvalAndProfiler(_Section):
  eval_interval: NonNegInt
  eval_steps: PosInt
  eval_dataset_path: str
  grain_eval_files: str
  hf_eval_files: str
  profiler: Literal["", "xplane"]
  profiler_start_step: PosInt
  profiler_steps: PosInt


MeshAxis = Literal["stage", "data", "fsdp", "context", "tensor", "expert"]
# The mesh axis each size key sets (MaxText's names): `stage` is sized ici x dcn pipeline parallelism.
MESH_AXIS_KEYS = {"stage": "ici_pipeline_parallelism", "data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism",
                  "context": "ici_context_parallelism", "tensor": "ici_tensor_parallelism",
                  "expert": "ici_expert_parallelism"}


class Mesh(_Section):
  ici_pipeline_parallelism: PosInt
  dcn_pipeline_parallelism: PosInt
  num_layers_per_pipeline_stage: Annotated[int, Field(ge=-1)]
  num_pipeline_microbatches: Annotated[int, Field(ge=-1)]
  pipeline_fsdp_ag_once: bool
  ici_data_parallelism: Annotated[int, Field(ge=-1)]
  ici_fsdp_parallelism: Annotated[int, Field(ge=-1)]
  ici_context_parallelism: Annotated[int, Field(ge=-1)]
  ici_tensor_parallelism: Annotated[int, Field(ge=-1)]
  ici_expert_parallelism: Annotated[int, Field(ge=-1)]
  context_parallel_load_balance: bool
  mesh_axes: tuple[MeshAxis, ...]
  logical_axis_rules: tuple[tuple[str, tuple[MeshAxis, ...]], ...]


class Distributed(_Section):
  distributed_coordinator_address: str
  distributed_num_processes: Annotated[int, Field(ge=-1)]
  distributed_process_id: Annotated[int, Field(ge=-1)]
  distributed_initialization_timeout: PosInt

  @model_validator(mode="after")
  def _check_processes(self) -> "Distributed":
    n, i = self.distributed_num_processes, self.distributed_process_id
    if n == 0:
      raise ValueError("distributed_num_processes=0: use -1 (from the cluster) or the number of processes (>= 1)")
    if n > 0 and i >= n:
      raise ValueError(f"distributed_process_id={i} is not below distributed_num_processes={n} "
                       f"(ids run 0 .. {n - 1})")
    if self.distributed_coordinator_address:
      if n < 0 or i < 0:
        raise ValueError(f"distributed_coordinator_address={self.distributed_coordinator_address!r} needs "
                         "distributed_num_processes and distributed_process_id on every process")
      host, _, port = self.distributed_coordinator_address.rpartition(":")
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"distributed_coordinator_address={self.distributed_coordinator_address!r} is not "
                         "host:port (e.g. 10.0.0.1:1234)")
    return self


class Decode(_Section):
  prompt: str
  max_prefill_length: PosInt
  prefill_chunk_size: NonNegInt
  decode_sampling_strategy: Literal["greedy", "temperature", "top_p"]
  decode_sampling_temperature: Annotated[float, Field(gt=0)]
  decode_sampling_nucleus_p: Annotated[float, Field(gt=0, le=1)]
  kv_cache_dtype: Literal["float32", "bfloat16", "fp8"]
  indexer_fp8_queries: bool


class Serve(_Section):
  serve_page_size: PosInt
  serve_num_pages: NonNegInt
  serve_max_num_seqs: PosInt
  serve_max_num_tokens: PosInt
  serve_width_buckets: PosInt
  serve_context_buckets: PosInt
  serve_prefix_caching: bool
  serve_host: str
  serve_port: Annotated[int, Field(ge=0, le=65535)]
  serve_uds: str
  serve_warmup: Literal["first", "all"]
  serve_max_waiting: PosInt
  serve_shutdown_timeout: Annotated[float, Field(ge=0)]
  chat_template_path: str
  chat_encoding: Literal["auto", "deepseek_v32", "jinja"]
  chat_thinking: bool
  serve_max_index_score_bytes: PosInt
  serve_speculative_tokens: NonNegInt
  serve_max_logprobs: PosInt
  serve_api_key: SecretStr  # masked in repr, logs and to_yaml (server/gate.py reads it)
  serve_max_request_bytes: PosInt
  serve_request_timeout: Annotated[float, Field(ge=0)]
  serve_keep_alive: Annotated[float, Field(gt=0)]
  serve_lora_adapters: Names  # name=path entries (checkpoint/lora_adapters.py reads them)

  @field_validator("serve_lora_adapters")
  @classmethod
  def _adapter_entries(cls, v: tuple[str, ...]) -> tuple[str, ...]:
    names = []
    for entry in v:
      name, eq, path = entry.partition("=")
      if not (eq and name.strip() and path.strip()):
        raise ValueError(f"entry {entry!r} is not name=path (a served name, then a LoRA run's folder or checkpoint step)")
      if name in names:
        raise ValueError(f"the name {name!r} is given twice: each adapter needs its own name")
      names.append(name)
    return v


class ReinforcementLearning(_Section):
  rl_num_generations: Annotated[int, Field(ge=2)]
  rl_prompts_per_step: PosInt
  rl_num_iterations: PosInt
  rl_max_completion_tokens: PosInt
  rl_epsilon: Annotated[float, Field(gt=0, lt=1)]
  rl_beta: Annotated[float, Field(ge=0)]
  rl_offpolicy_delta: float
  rl_unbiased_kl: bool
  rl_keep_routing: bool
  rl_keep_sampling_mask: bool
  rl_reward: Annotated[str, Field(min_length=1)]
  rl_reward_column: str


class AheadOfTimeCompile(_Section):
  compile_num_devices: NonNegInt
  compile_topology: str
  compile_hbm_gib: Annotated[float, Field(ge=0)]


SECTIONS = (
    RunInfo, ModelShape, MlaAttention, Rope, AttentionIndexer, DeepSeekMoE, MultiTokenPrediction,
    Training, Lora, Data, Checkpointing, Metrics, EvalAndProfiler, Mesh, Distributed, Decode, Serve, ReinforcementLearning,
    AheadOfTimeCompile,
)


class ConfigError(ValueError):
  """A user's config mistake: the message names the key(s), the value and what is allowed."""


class Config(*SECTIONS):
  """The frozen, validated config every module receives. Read keys as attributes."""

  model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

  # ---- derived values
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def num_moe_layers(self) -> int:
    return self.num_decoder_layers - self.first_num_dense_layers

  @property
  def mesh_shape(self) -> dict[str, int]:
    return {a: self.pipeline_stages if a == "stage" else getattr(self, MESH_AXIS_KEYS[a]) for a in self.mesh_axes}

  @property
  def pipeline_stages(self) -> int:
    """Pipeline stages S: the `stage` mesh axis, ici_pipeline_parallelism x dcn_pipeline_parallelism."""
    return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

  @property
  def layers_per_pipeline_stage(self) -> int:
    """MoE layers a stage runs per pass (num_layers_per_pipeline_stage; -1: all of its share, no repeats)."""
    n = self.num_layers_per_pipeline_stage
    return self.num_moe_layers // self.pipeline_stages if n == -1 else n

  @property
  def pipeline_repeats(self) -> int:
    """Circular repeats R: num_moe_layers = S x layers_per_pipeline_stage x R (R = 1: GPipe)."""
    return self.num_moe_layers // (self.pipeline_stages * self.layers_per_pipeline_stage)

  @property
  def pipeline_microbatches(self) -> int:
    """Microbatches M the pipelined batch is cut into (num_pipeline_microbatches; -1: one a stage)."""
    return self.pipeline_stages if self.num_pipeline_microbatches == -1 else self.num_pipeline_microbatches

  @property
  def run_dir(self) -> str:
    return os.path.join(self.base_output_directory, self.run_name)

  @property
  def checkpoint_dir(self) -> str:
    return os.path.join(self.run_dir, "checkpoints")

  @property
  def tensorboard_dir(self) -> str:
    return os.path.join(self.run_dir, "tensorboard")

  @property
  def profile_dir(self) -> str:
    return os.path.join(self.run_dir, "profile")

  @property
  def served_adapters(self) -> list[tuple[str, str]]:
    """serve_lora_adapters as (name, path) pairs: entry k is the served adapter slot k (1-based; 0 is the base)."""
    return [(name, path) for name, _, path in (e.partition("=") for e in self.serve_lora_adapters)]

  @property
  def softmax_scale(self) -> float:
    """qk_head_dim**-0.5, times YaRN's mscale**2 (0.1 * mscale * ln(factor) + 1)**2 when factor > 1."""
    scale = self.qk_head_dim ** -0.5
    if self.rope_type == "yarn" and self.rope_factor > 1:
      m = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
      scale *= m * m
    return scale

  @model_validator(mode="after")
  def _check_combinations(self) -> "Config":
    def bad(msg):
      raise ValueError(msg)

    if self.first_num_dense_layers > self.num_decoder_layers:
      bad(f"first_num_dense_layers={self.first_num_dense_layers} exceeds num_decoder_layers={self.num_decoder_layers}")
    if self.qk_rope_head_dim % 2:
      bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE (pairs of dims rotate together)")
    if self.use_indexer:
      if self.attention_type != "mla":
        bad(f"use_indexer=true needs attention_type=mla (got attention_type={self.attention_type}): "
            "the indexer reads MLA's query latent")
      if self.q_lora_rank == 0:
        bad("use_indexer=true needs q_lora_rank > 0: the indexer's queries come from the MLA query latent")
      if self.indexer_head_dim % 2:
        bad(f"indexer_head_dim={self.indexer_head_dim} must be even for RoPE")
      if self.indexer_hadamard and self.indexer_head_dim & (self.indexer_head_dim - 1):
        bad(f"indexer_hadamard=true needs indexer_head_dim a power of 2 (got {self.indexer_head_dim})")
      if self.indexer_head_dim <= self.qk_rope_head_dim:
        bad(f"indexer_head_dim={self.indexer_head_dim} must exceed qk_rope_head_dim={self.qk_rope_head_dim}: "
            "the indexer rotates its first qk_rope_head_dim dims")
    elif self.indexer_training_stage == "dense_warmup":  # sparse (the default) means nothing without an indexer
      bad("indexer_training_stage=dense_warmup needs use_indexer=true: it trains only the indexers")
    if any(b & (b - 1) for b in self.weight_block_size):
      bad(f"weight_block_size={list(self.weight_block_size)}: each block size must be a power of 2 (DeepSeek's is "
          "[128, 128])")
    if self.num_experts_per_tok > self.num_experts:
      bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
    if self.num_experts % self.n_routing_groups:
      bad(f"num_experts={self.num_experts} is not divisible by n_routing_groups={self.n_routing_groups}")
    if self.topk_routing_group > self.n_routing_groups:
      bad(f"topk_routing_group={self.topk_routing_group} exceeds n_routing_groups={self.n_routing_groups}")
    if self.num_experts_per_tok > self.topk_routing_group * (self.num_experts // self.n_routing_groups):
      bad(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in the kept groups "
          f"(topk_routing_group={self.topk_routing_group} x {self.num_experts // self.n_routing_groups} per group)")
    if self.moe_capacity_factor != -1 and self.moe_capacity_factor < 1:
      bad(f"moe_capacity_factor={self.moe_capacity_factor}: use -1 (dropless) or a factor >= 1 (1 = exactly the "
          "mean load per expert owner; below 1 even a perfectly balanced load would drop)")
    if self.num_experts % self.ici_expert_parallelism:
      bad(f"num_experts={self.num_experts} is not divisible by ici_expert_parallelism={self.ici_expert_parallelism}: "
          "each expert-parallel device holds num_experts / ici_expert_parallelism experts")
    if self.global_batch_size % self.gradient_accumulation_steps:
      bad(f"global_batch_size={self.global_batch_size} is not divisible by "
          f"gradient_accumulation_steps={self.gradient_accumulation_steps}")
    if sorted(a for a in self.mesh_axes if a != "stage") != sorted(["data", "fsdp", "context", "tensor", "expert"]) \
        or list(self.mesh_axes).count("stage") > 1:
      bad(f"mesh_axes={list(self.mesh_axes)} must name each of data, fsdp, context, tensor, expert once (and stage "
          "at most once)")
    self._check_pipeline(bad)
    if self.eval_interval and self.dataset_type == "file" and not self.eval_dataset_path:
      bad(f"eval_interval={self.eval_interval} with dataset_type=file needs eval_dataset_path (held-out "
          ".txt/.jsonl file or folder); or set eval_interval=0")
    eval_files = {"grain": "grain_eval_files", "hf": "hf_eval_files"}.get(self.dataset_type)
    if self.eval_interval and eval_files and not getattr(self, eval_files):
      bad(f"eval_interval={self.eval_interval} with dataset_type={self.dataset_type} needs {eval_files} (held-out "
          "data); or set eval_interval=0")
    n_cols = len(self.train_data_columns)
    if n_cols not in ((1, 2) if self.use_sft else (1,)):
      bad(f"train_data_columns={list(self.train_data_columns)}: "
          + ("use_sft reads [messages] (a list of chat messages) or [prompt, completion]" if self.use_sft
             else "name one column (two, [prompt, completion], only with use_sft=true)"))
    if self.use_sft and self.dataset_type not in ("file", "grain", "hf"):
      bad(f"use_sft=true reads conversations from files: dataset_type=file, grain or hf, not {self.dataset_type}")
    if self.serve_speculative_tokens and self.mtp_num_layers < 1:
      bad(f"serve_speculative_tokens={self.serve_speculative_tokens} needs mtp_num_layers >= 1 (got "
          f"{self.mtp_num_layers}): the MTP module drafts the tokens; or set serve_speculative_tokens=0")
    if self.lora_restore_path and not self.lora_rank:
      bad(f"lora_restore_path={self.lora_restore_path} needs lora_rank > 0 (the rank its run trained at): adapters "
          "continue over a frozen base")
    if self.serve_lora_adapters and self.serve_speculative_tokens:
      bad(f"serve_lora_adapters with serve_speculative_tokens={self.serve_speculative_tokens}: the MTP drafter does not "
          "apply adapters yet; set serve_speculative_tokens=0 to serve adapters")
    if self.model_name in [e.partition("=")[0] for e in self.serve_lora_adapters]:
      bad(f"serve_lora_adapters names an adapter {self.model_name!r}, the base model's name (model_name): a request's "
          "model field could not pick between them; rename the adapter")
    if self.dataset_type == "grain" and not self.grain_train_files:
      bad("dataset_type=grain needs grain_train_files: a glob of ArrayRecord or Parquet shards")
    if self.dataset_type == "hf" and not self.hf_path:
      bad("dataset_type=hf needs hf_path: a local save_to_disk folder or a glob of .parquet/.json/.jsonl files")
    if self.dataset_type == "synthetic_retrieval":
      if self.retrieval_queries > self.retrieval_pairs or self.retrieval_pairs > self.retrieval_keys:
        bad(f"synthetic_retrieval needs retrieval_queries ({self.retrieval_queries}) <= retrieval_pairs "
            f"({self.retrieval_pairs}) <= retrieval_keys ({self.retrieval_keys}): queries ask distinct pairs, "
            "pairs have distinct keys")
      if 2 * (self.retrieval_pairs + self.retrieval_queries) > self.max_target_length:
        bad(f"synthetic_retrieval: {self.retrieval_pairs} pairs and {self.retrieval_queries} queries take "
            f"{2 * (self.retrieval_pairs + self.retrieval_queries)} tokens > max_target_length={self.max_target_length}")
    if self.max_prefill_length > self.max_target_length:
      bad(f"max_prefill_length={self.max_prefill_length} exceeds max_target_length={self.max_target_length}")
    return self

  def _check_pipeline(self, bad) -> None:
    """Pipeline parallelism (layers/pipeline.py): the MoE stack in S equal stages, each run M microbatches."""
    s, n, m = self.pipeline_stages, self.num_layers_per_pipeline_stage, self.pipeline_microbatches
    if s == 1:
      return
    keys = f"ici_pipeline_parallelism x dcn_pipeline_parallelism = {s} stages"
    if "stage" not in self.mesh_axes:
      bad(f"{keys} need the mesh axis stage in mesh_axes (got {list(self.mesh_axes)})")
    if not self.scan_layers:
      bad(f"{keys} need scan_layers=true: a stage runs its slice of the stacked MoE layers")
    per = n if n != -1 else max(self.num_moe_layers // s, 1)
    if n == 0 or self.num_moe_layers % (s * per):
      fits = [d for d in range(1, self.num_moe_layers + 1) if self.num_moe_layers % d == 0]
      bad(f"{keys} x num_layers_per_pipeline_stage={n} do not divide the {self.num_moe_layers} MoE layers "
          f"(num_decoder_layers - first_num_dense_layers; the dense layers, embedding, head and MTP run outside the "
          f"pipeline): S x layers per stage must divide it, S one of {fits}")
    if m < s:
      bad(f"num_pipeline_microbatches={m} is fewer than the {s} stages: every stage needs a microbatch in flight")
    if self.num_moe_layers // (s * per) > 1 and m != s:
      bad(f"num_layers_per_pipeline_stage={n} makes {self.num_moe_layers // (s * per)} circular repeats, which take "
          f"num_pipeline_microbatches = the {s} stages (the last stage feeds the first directly); got {m}")
    rows = self.global_batch_size // self.gradient_accumulation_steps
    if rows % m:
      bad(f"global_batch_size={self.global_batch_size} / gradient_accumulation_steps={self.gradient_accumulation_steps}"
          f" = {rows} rows do not split into num_pipeline_microbatches={m}")


def schema_keys() -> set[str]:
  return set(Config.model_fields)
