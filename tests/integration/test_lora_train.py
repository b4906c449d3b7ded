"""LoRA through the trainer: on an 8-device mesh (fsdp x context x expert) one QLoRA step equals the
single-device step and the adapters are sharded as their kernels; SFT with LoRA through train.py from a
base checkpoint (load_parameters_path) writes checkpoints holding the adapters and their optimizer state
only, and a run killed with -9 after a checkpoint resumes to the uninterrupted run's bits; in the sparse stage the
indexer's KL does not grow over a LoRA run (its q and k adapters, in the default modules, follow the attention)."""

import json
import os

import jax
import pytest
from jax.sharding import PartitionSpec

from MaxText.checkpoint import hf_export, model_state, orbax_state
from MaxText.layers import lora
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT
from tests.support import train_processes as procs
from tests.support.lora import assert_same_step, small_lora_args, small_lora_config, train_steps

HF_JSON = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
MESH = dict(num_devices=8, ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_expert_parallelism=2)


def test_qlora_step_on_an_fsdp_context_expert_mesh_equals_one_device_and_shards_adapters_as_kernels():
  experts = f"{small_lora_config().lora_module_path}|.*/mlp/(wi_0|wi_1|wo)"  # the defaults + the routed experts
  kw = dict(weight_quantization="fp8_block", global_batch_size=4, matmul_precision="highest", lora_module_path=experts)
  _, one, m1 = train_steps(small_lora_config(**kw), 1)
  cfg = small_lora_config(**kw, **MESH)
  _, eight, m8 = train_steps(cfg, 1)
  assert float(m8["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
  assert_same_step(eight, one, cfg)  # the gradients, and the params where Adam's first step is well conditioned
  mesh = sharding.create_mesh(cfg)
  graphdef, params, buffers = model_state.abstract_on_mesh(cfg, mesh)
  attn = params["moe_layers"]["layers"]["attention"]["wq_a"]
  zero3 = ("fsdp", "context", "expert")
  # kernel [L, embed, q_lora]: embed over every axis that would hold copies; A [L, embed, r] likewise, rank replicated
  assert attn["kernel"].sharding.spec == PartitionSpec(None, zero3, None)
  assert attn["lora_a"].sharding.spec == PartitionSpec(None, zero3, None)
  # B [L, r, out]: the rank takes the ZeRO-3 axes that divide it (r=4: fsdp x context), out what is left
  assert attn_b(params, "wq_b").sharding.spec == PartitionSpec(None, ("fsdp", "context"), None)  # out: q_heads
  assert attn_b(params, "wo").sharding.spec == PartitionSpec(None, ("fsdp", "context"), "expert")  # out: embed
  mlp = params["moe_layers"]["layers"]["mlp"]
  # routed experts: wi_0 [L, E, D, I], A [L, E, D, r], B [L, E, r, I] split over `expert` on E as the experts are
  assert mlp["wi_0"].sharding.spec == PartitionSpec(None, "expert", ("fsdp", "context"), None)
  assert mlp["wi_0_lora"]["lora_a"].sharding.spec == PartitionSpec(None, "expert", ("fsdp", "context"), None)
  assert mlp["wi_0_lora"]["lora_b"].sharding.spec == PartitionSpec(None, "expert", ("fsdp", "context"), None)


def attn_b(params, name):
  return params["moe_layers"]["layers"]["attention"][name]["lora_b"]


CHATS = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                       {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
         for a in range(6) for b in range(3)]


STEPS = 12


def test_sft_with_lora_killed_after_a_checkpoint_resumes_to_the_uninterrupted_runs_bits(tmp_path):
  """train.py with LoRA over an fp8 base (SFT data), as a subprocess: an uninterrupted run, and one killed with -9
  once a checkpoint is complete then started again with the same command. The rerun resumes from the newest
  checkpoint (adapters + their AdamW moments + step + data position, never the base) and ends on the
  uninterrupted run's bits: the same state fingerprint, the same adapters byte for byte, the same losses."""
  data = tmp_path / "chats.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
  keys = dict(max_target_length=32, max_prefill_length=32, log_period=1, enable_tensorboard=False,
              dataset_type="file", dataset_path=str(data), tokenizer_type="hf", tokenizer_path=HF_JSON, use_sft=True,
              train_data_columns="[messages]", weight_quantization="fp8_block")
  base_cfg = small_lora_config(lora_rank=0, **{**keys, "train_data_columns": ["messages"]})
  mesh = sharding.create_mesh(base_cfg)
  with jax.set_mesh(mesh):
    _, params, buffers, _ = model_state.create(base_cfg, mesh)
  model_state.save_parameters(str(tmp_path / "base"), params, buffers)
  args = small_lora_args(**keys, steps=STEPS, checkpoint_period=2, async_checkpointing=False,
                         load_parameters_path=tmp_path / "base", base_output_directory=tmp_path)
  run = lambda name: procs.launch("train.py", [*args, f"run_name={name}"], processes=1, devices=1,  # noqa: E731
                                  cache=os.environ["JAX_COMPILATION_CACHE_DIR"])
  (_, whole, _), = procs.ok(procs.finish(run("whole")))
  _, latest = procs.kill_after_checkpoint(run("killed"), tmp_path / "killed" / "checkpoints", 2, STEPS)
  (_, rerun, _), = procs.ok(procs.finish(run("killed")))
  assert f"resumed from checkpoint step {latest}" in rerun

  final = [tmp_path / name / "checkpoints" / str(STEPS) for name in ("whole", "killed")]
  stored = orbax_state._stored_tree(str(final[0] / "state"))
  assert set(stored) == {"params", "buffers", "opt_state", "step"} and not jax.tree.leaves(stored["buffers"])
  adapters = [hf_export.restore_raw(str(f / "state"))["params"] for f in final]
  leaves = jax.tree_util.tree_leaves_with_path(adapters[0])
  assert leaves and all(lora.is_adapter(p) for p, _ in leaves)  # never the base
  for (path, a), b in zip(leaves, jax.tree.leaves(adapters[1])):
    assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
  fingerprints = [json.load(open(f / "meta" / "metadata"))["fingerprint"] for f in final]
  assert fingerprints[0] == fingerprints[1]  # every bit of adapters, moments, step
  want, got = procs.losses(whole), procs.losses(rerun)
  assert sorted(got) == list(range(latest + 1, STEPS + 1)) and got == {s: want[s] for s in got}


def test_the_indexers_kl_does_not_grow_over_a_lora_run_in_the_sparse_stage(tmp_path):
  """The paper's recipe under LoRA: the indexer learns toward the attention it selects for, so as the adapters move
  the attention, the indexer's own adapters (the default modules' indexer wq_b and wk; weights_proj [64, 4] is narrower than rank 16: left out, trained by its KL alone) move
  it after. A base trained in full (100 steps: its indexer's KL 0.0003 on its batch, 0.017 on the next one), then
  rank-16 adapters on another batch (200 steps, the LM loss 6.57 -> 4.91): the KL ends at 0.016 with the indexer's
  adapters and at 0.27 without them (the default before: the indexer then picks keys for the old attention)."""
  common = dict(indexer_topk=8, enable_checkpointing=False)
  _, base, _ = train_steps(small_lora_config(lora_rank=0, learning_rate=3e-3, **common), 100)
  model_state.save_parameters(str(tmp_path / "base"), base["params"], base["buffers"])
  without_indexer = small_lora_config().lora_module_path.replace("|.*/indexer/(wq_b|wk|weights_proj)", "")
  kl = {}
  for name, regex in (("default", small_lora_config().lora_module_path), ("without the indexer", without_indexer)):
    history = []
    cfg = small_lora_config(lora_rank=16, lora_module_path=regex, load_parameters_path=str(tmp_path / "base"), seed=1,
                            **common)  # seed 1: another batch than the base's
    train_steps(cfg, 200, history)
    assert history[-1]["lm_loss"] < history[0]["lm_loss"] - 1.5, name  # the attention moved
    kl[name] = (history[0]["indexer_loss"], history[-1]["indexer_loss"])
  first, last = kl["default"]
  assert 0 < first and last <= 1.5 * first, kl
  assert kl["without the indexer"][1] > 5 * kl["without the indexer"][0], kl  # what the default's indexer adapters prevent
