"""Mosaic kernels are not partitioned by XLA ("Mosaic kernels cannot be automatically partitioned. Please wrap the
call in a shard_map"): a train step on several TPU chips compiles only if every pallas_call it traces runs inside
a jax.shard_map; so does a serving step. Checked here on the CPU by tracing the step with the TPU row's choices (backend.forced("tpu"):
Mosaic's kernels, not the interpreter) on a mesh of 4 virtual devices and walking its jaxpr. train_compile
compile_topology=v5p:2x2x1 compiles the same with the TPU compiler where libtpu is installed. Likewise the grouped
matmul, which XLA:TPU compiles only without a batch dimension (the pipeline's stage vmap gave it one)."""

import jax
import pytest

from MaxText import train
from MaxText.kernels import backend
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.kernels import jaxpr_eqns


def _pallas_calls(jaxpr):
  """(kernel name, whether inside a shard_map) of every pallas_call in `jaxpr` and its sub-jaxprs."""
  for eqn, inside in jaxpr_eqns(jaxpr):
    if eqn.primitive.name == "pallas_call":
      yield str(eqn.params.get("name") or eqn.params.get("debug") or "?")[:80], inside


def _step_jaxpr(**keys):
  """The train step's jaxpr on 4 virtual devices, traced with the TPU row's choices."""
  cfg = make_config(**{"num_devices": 4, "ici_data_parallelism": 1, "global_batch_size": 4, **keys})
  mesh = sharding.create_mesh(cfg)
  with backend.forced("tpu"), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    state, batch, step = train.abstract_train_step(cfg, mesh)
    return jax.make_jaxpr(step)(state, batch).jaxpr


def _step_kernels(**keys):
  return list(_pallas_calls(_step_jaxpr(**keys)))


@pytest.mark.slow  # ~12 s of CPU each (README.md, Tests)
@pytest.mark.parametrize("keys", [
    dict(ici_fsdp_parallelism=2, ici_expert_parallelism=2),  # the indexer's exact top-k: kth_value's kernel
    dict(ici_context_parallelism=2, ici_expert_parallelism=2),
    dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=2),  # the experts split over tensor: their grouped matmul's
    # custom_vjp must return the rows' cotangent summed over tensor (kernels/ragged_matmul.py _varying_alike)
    dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=2, indexer_training_stage="dense_warmup",
         max_target_length=256),  # splash (s a multiple of 128), the KL target
], ids=["fsdp_expert", "context_expert", "fsdp_tensor", "tensor_dense_warmup"])
def test_every_mosaic_kernel_of_a_multi_chip_train_step_runs_inside_a_shard_map(keys):
  calls = _step_kernels(**keys)
  assert calls, "the TPU row's step traced no Mosaic kernel: the check would pass vacuously"
  assert all(inside for _, inside in calls), [name for name, inside in calls if not inside]


@pytest.mark.slow
def test_every_mosaic_kernel_of_a_multi_chip_serving_step_runs_inside_a_shard_map():
  """The paged engine's step (decode and a prefill chunk) on data x expert: its kernels run on each device's own
  page shard (paged_pools.on_shards); kth_value inside that shard_map runs as it is (sharding.kernel_mesh)."""
  from MaxText import serve_compile
  from MaxText.inference import step_feed
  cfg = make_config(num_devices=4, ici_data_parallelism=2, ici_expert_parallelism=2, max_target_length=256,
                    serve_max_num_seqs=4, serve_page_size=128)
  mesh = sharding.create_mesh(cfg)
  with backend.forced("tpu"), jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    eng = serve_compile.build_engine(cfg)
    for t in (1, 8):
      buf = step_feed.abstract(4, t, eng.pages_per_seq, eng._row_sharding(2))
      traced = eng._step_jit.trace(t, False, False, eng.params, eng.buffers, eng.pools, eng.absorbed, buf)
      calls = list(_pallas_calls(traced.jaxpr.jaxpr))
      assert calls, f"no Mosaic kernel traced at t={t}: the check would pass vacuously"
      assert all(inside for _, inside in calls), [name for name, inside in calls if not inside]


def test_the_pipelined_train_steps_grouped_matmuls_have_no_batch_dimension():
  """XLA:TPU's grouped matmul takes no batch dimension ("Failed to create RaggedConvSpec ... number of batch
  dimensions should be 0"), and the pipeline vmaps the MoE stack over its stages: every ragged_dot_general of the
  pipelined step (forward and backward, the TPU row's grouped_matmul=ragged_dot) has none (kernels/ragged_matmul.py
  folds the stages into the groups). train_compile compile_topology=v5p:2x2x1 ici_pipeline_parallelism=2 compiles it."""
  dots = [e.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[1]
          for e, _ in jaxpr_eqns(_step_jaxpr(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, num_decoder_layers=5,
                                        global_batch_size=8))
          if e.primitive.name == "ragged_dot_general"]
  assert len(dots) >= 6, dots  # 3 products forward, 6 backward, per stage's layer: none would pass vacuously
  assert all(batch == ((), ()) for batch in dots), dots


def test_the_pipelined_stages_expert_weights_are_gathered_inside_the_moes_shard_map():
  """Under the pipeline too the routed experts' weights enter the MoE's shard_map split over fsdp, are all_gathered
  inside (per stage: the stage vmap's batch dimension in front) and their gradients leave by a reduce-scatter
  (kernels/moe_dispatch.py _zero_axes): gathered before it, XLA:TPU kept each layer's experts' whole f32 gradient
  ([32,7168,2048], 1.75 GiB) and the 671B's 11-layer 2-stage step took 30.84 GiB of temporaries against 20.19."""
  ops = {(e.primitive.name, len(e.invars[0].aval.shape))
         for e, inside in jaxpr_eqns(_step_jaxpr(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2,
                                                 num_decoder_layers=5, global_batch_size=8))
         if inside and e.primitive.name in ("all_gather", "reduce_scatter")}
  assert {("all_gather", 4), ("reduce_scatter", 4)} <= ops, ops  # [1, E_l, D/fsdp, I]: a stage's weights
