"""LoRA through the trainer: on an 8-device mesh (fsdp x context x expert) one QLoRA step equals the
single-device step and the adapters are sharded as their kernels; SFT with LoRA through train.py from a
base checkpoint (load_parameters_path) writes checkpoints holding the adapters and their optimizer state
only, and a resume from one of them reaches the same state bit for bit."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from MaxText import train
from MaxText.checkpoint import model_state, orbax_state
from MaxText.layers import lora
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT
from tests.support.lora import small_lora_config, train_steps

HF_JSON = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")
MESH = dict(num_devices=8, ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_expert_parallelism=2)


def test_qlora_step_on_an_fsdp_context_expert_mesh_equals_one_device_and_shards_adapters_as_kernels():
  kw = dict(weight_quantization="fp8_block", global_batch_size=4, matmul_precision="highest")
  _, one, m1 = train_steps(small_lora_config(**kw), 1)
  cfg = small_lora_config(**kw, **MESH)
  _, eight, m8 = train_steps(cfg, 1)
  assert float(m8["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(eight["params"]), jax.tree.leaves(one["params"])):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
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


def attn_b(params, name):
  return params["moe_layers"]["layers"]["attention"][name]["lora_b"]


CHATS = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                       {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
         for a in range(6) for b in range(3)]


def test_sft_with_lora_checkpoints_adapters_only_and_resumes_exactly(tmp_path):
  data = tmp_path / "chats.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
  keys = dict(base_output_directory=str(tmp_path), run_name="run", max_target_length=32, max_prefill_length=32,
              log_period=1, enable_tensorboard=False, dataset_type="file", dataset_path=str(data),
              tokenizer_type="hf", tokenizer_path=HF_JSON, use_sft=True, train_data_columns=["messages"],
              weight_quantization="fp8_block")
  base_cfg = small_lora_config(lora_rank=0, **keys)
  mesh = sharding.create_mesh(base_cfg)
  with jax.set_mesh(mesh):
    _, params, buffers, _ = model_state.create(base_cfg, mesh)
  model_state.save_parameters(str(tmp_path / "base"), params, buffers)
  cfg = small_lora_config(**keys, steps=4, enable_checkpointing=True, checkpoint_period=2,
                          async_checkpointing=False, load_parameters_path=str(tmp_path / "base"))
  first = train.train(cfg)
  ckpt = os.path.join(cfg.checkpoint_dir, "4")
  with open(os.path.join(ckpt, "meta", "metadata")) as f:
    want = json.load(f)["fingerprint"]
  stored = orbax_state._stored_tree(os.path.join(ckpt, "state"))
  assert set(stored) == {"params", "buffers", "opt_state", "step"} and not jax.tree.leaves(stored["buffers"])
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored["params"])]
  assert names and all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored["params"])), names
  shutil.rmtree(ckpt)  # as if killed after step 2's checkpoint: the same command resumes from it
  second = train.train(cfg)
  with open(os.path.join(ckpt, "meta", "metadata")) as f:
    assert json.load(f)["fingerprint"] == want  # every bit of adapters, moments, step
  assert second["loss"] == first["loss"] and np.isfinite(first["loss"])
