"""Pipeline parallelism on 8 simulated CPU devices: the pipelined train step equals one stage (loss, lm loss and
every gradient, rtol 2e-4 / atol 2e-6 as the other sharded-equals-single-device tests, fp32 and matmul
precision highest) for 2 and 4 stages with M = S and M = 2S microbatches, circular repeats, and composed with
fsdp x expert and context x expert (remat on); its compiled step moves activations between stages by
collective-permute; a run resumes under another stage count (the parameters keep one layout)."""

import math
import shutil

import pytest

from MaxText import train, train_compile
from MaxText.runtime import aot
from tests.conftest import make_config
from tests.support.sharded import assert_same, run_loss_and_grads, small_config

# 1 dense + 4 MoE layers + MTP, the balance loss on: every aux output the pipeline carries counts
MODEL = dict(num_decoder_layers=5, first_num_dense_layers=1, global_batch_size=8, ici_data_parallelism=1,
             load_balance_loss_weight=0.01)
MESHES = [dict(ici_pipeline_parallelism=2),
          dict(ici_pipeline_parallelism=4, num_pipeline_microbatches=8),
          dict(ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=1),  # 2 circular repeats
          dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, ici_expert_parallelism=2),
          dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, pipeline_fsdp_ag_once=True),
          dict(ici_pipeline_parallelism=2, ici_context_parallelism=2, ici_expert_parallelism=2, remat_policy="full")]


def _devices(keys):
  return math.prod(v for k, v in keys.items() if k.startswith("ici_"))


@pytest.fixture(scope="module")
def one_stage():
  return run_loss_and_grads(small_config(num_devices=1, **MODEL))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "-".join(f"{k.replace('_parallelism', '')}{v}"
                                                                 for k, v in m.items()))
def test_pipelined_stages_equal_one_stage(mesh, one_stage):
  got = run_loss_and_grads(small_config(num_devices=_devices(mesh), **MODEL, **mesh))
  assert_same(got, one_stage)
  assert got[3]["load_balance_loss"] == pytest.approx(one_stage[3]["load_balance_loss"], rel=1e-5)
  assert got[3]["indexer_loss"] == pytest.approx(one_stage[3]["indexer_loss"], rel=1e-4, abs=1e-6)


def test_the_compiled_step_passes_microbatches_on_by_collective_permute():
  cfg = small_config(num_devices=8, ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, **MODEL)
  compiled = train_compile.compile_train_step(cfg)[0]
  counts = aot.collective_counts(compiled.as_text())
  assert counts.get("collective-permute", 0) >= 1, counts


def test_a_run_resumes_under_another_stage_count(tmp_path, capsys):
  keys = dict(MODEL, mtp_num_layers=0, steps=2, checkpoint_period=2, log_period=1, base_output_directory=str(tmp_path),
              run_name="pp", enable_tensorboard=False, async_checkpointing=False, remat_policy="none")
  train.train(make_config(num_devices=1, **keys))
  shutil.copytree(tmp_path / "pp", tmp_path / "same")  # the run continued on one stage, for reference
  keys["steps"] = 3
  staged = train.train(make_config(num_devices=2, **keys, ici_pipeline_parallelism=2))
  assert "resumed from checkpoint step 2" in capsys.readouterr().out
  same = train.train(make_config(num_devices=1, **dict(keys, run_name="same")))
  assert staged["loss"] == pytest.approx(same["loss"], rel=1e-5)
  assert staged["grad_norm"] == pytest.approx(same["grad_norm"], rel=1e-4)


def test_outside_the_pipelined_stack_the_stages_split_the_batch():
  """The embedding, dense layers, head and MTP run on each stage's own rows (activation_batch takes `stage` where it
  divides; the 671B pipelined step's flops per device halved, docs/training.md); inside the pipeline (stage_local)
  a microbatch's rows split over the other batch axes alone and only activation_stage keeps `stage`."""
  import jax

  from MaxText.runtime import sharding
  cfg = small_config(num_devices=8, ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, **MODEL)
  mesh = sharding.create_mesh(cfg)
  spec = train.batch_shardings(cfg, mesh, {"inputs": jax.ShapeDtypeStruct((8, 64), "int32")})["inputs"].spec
  assert spec[0] == ("fsdp", "stage"), spec
  with sharding.logical_rules(cfg, mesh):
    with sharding.stage_local():
      rules = sharding.active_mesh()[1]
      assert rules["activation_batch"] == ("data", "fsdp", "expert") and rules["activation_stage"] == ("stage",)
      assert all("stage" not in v for k, v in rules.items() if k != "activation_stage")
    assert "stage" in sharding.active_mesh()[1]["activation_batch"]


@pytest.mark.parametrize("once", [False, True])
def test_the_stage_weights_pass_a_barrier_with_the_iteration_unless_gathered_once(once):
  """pipeline_fsdp_ag_once=false (the default): each layer's weights pass an optimization_barrier with the iteration
  counter inside the layer's remat (XLA:TPU otherwise hoisted their fsdp gathers out of the loop and kept every
  layer's gathered experts live; outside the remat the barrier's output was saved once per iteration and layer:
  docs/training.md); true: no barrier."""
  import jax
  from jax.extend import core as jcore

  from MaxText.runtime import sharding
  cfg = small_config(num_devices=4, ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, pipeline_fsdp_ag_once=once,
                     remat_policy="full", **MODEL)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    state, batch, step = train.abstract_train_step(cfg, mesh)
    jaxpr = jax.make_jaxpr(step)(state, batch).jaxpr
  # (other barriers of the step hold one or two small arrays; a layer's holds its weights and i)
  def barriers(jaxpr, in_remat=False):
    """(weights a barrier holds, whether inside a remat) of each barrier joining weights with an int32 scalar."""
    for e in jaxpr.eqns:
      if e.primitive.name == "optimization_barrier" and len(e.invars) > 10 and e.invars[-1].aval.shape == () \
         and e.invars[-1].aval.dtype == "int32":
        yield len(e.invars) - 1, in_remat
      for p in e.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          sub = getattr(sub, "jaxpr", sub)
          if isinstance(sub, jcore.Jaxpr):
            yield from barriers(sub, in_remat or e.primitive.name in ("remat2", "checkpoint"))

  found = set(barriers(jaxpr))
  assert bool(found) != once, found
  # the backward's recomputation of a layer (its remat) passes the barrier again from the stored weights: the
  # barrier's output is not a residual saved once per iteration
  assert once or any(in_remat for _, in_remat in found), found
