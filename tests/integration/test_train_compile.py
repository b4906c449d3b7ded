"""MaxText.train_compile: the JSON it prints is the memory and cost analysis of the very step
train.py compiles for the same config (on 8 virtual devices, a tiny model); over the HBM limit it
exits 1 in one line; a bad key exits 2 in one line."""

import json
import os
import subprocess
import sys

import jax
import pytest

from MaxText import train
from MaxText.data import input_pipeline
from MaxText.runtime import aot, sharding, virtual_devices
from tests.conftest import REPO_ROOT, make_config

KEYS = dict(ici_data_parallelism=2, ici_expert_parallelism=4, num_decoder_layers=2, first_num_dense_layers=1,
            mtp_num_layers=1, max_target_length=32, global_batch_size=8)
ARGV = ["configs/base.yml", "compile_num_devices=8"] + [f"{k}={v}" for k, v in KEYS.items()]


def _tool(*extra, cache=None):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT)
  if cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run([sys.executable, "-m", "MaxText.train_compile", *ARGV, *extra], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def printed(cache):
  out = _tool(cache=cache)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.strip().splitlines()


def test_json_equals_the_analysis_of_the_step_train_py_compiles(printed):
  got = json.loads(printed[-1])  # the LAST line is the JSON object
  assert any(line.strip().startswith("peak") for line in printed[:-1])  # the human table above it
  cfg = make_config(num_devices=8, **KEYS)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    # train()'s own construction: real (allocated) state, real batch, the jitted step it runs
    graphdef, state, state_sharding, tx = train.init_state(cfg, mesh)
    batch = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg)))
    batch_sharding = train.batch_shardings(cfg, mesh, batch)
    step_fn = train.jit_train_step(cfg, graphdef, tx, state_sharding, batch_sharding, mesh)
    # with the XLA:CPU options train_compile sets for its virtual devices (the pass a GPU/TPU compile never makes)
    compiled = step_fn.lower(state, jax.device_put(batch, batch_sharding)).compile(virtual_devices.CPU_OPTIONS)
  mem = compiled.memory_analysis()
  assert got["temp_bytes_per_device"] == mem.temp_size_in_bytes
  assert got["argument_bytes_per_device"] == mem.argument_size_in_bytes
  assert got["output_bytes_per_device"] == mem.output_size_in_bytes
  assert got["peak_bytes_per_device"] == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  assert got["flops_per_device"] == pytest.approx(compiled.cost_analysis()["flops"], rel=1e-9)
  assert got["flops_per_step"] == pytest.approx(8 * got["flops_per_device"], rel=1e-9)
  assert got["collectives"] == aot.collective_counts(compiled.as_text())
  assert got["collectives"].get("all-to-all", 0) > 0  # the expert-parallel MoE dispatch
  # the state's bytes per device, from the real arrays' shards
  shard_bytes = lambda tree: sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
  assert got["parameter_bytes_per_device"] == shard_bytes((state["params"], state["buffers"]))
  assert got["optimizer_bytes_per_device"] == shard_bytes(state["opt_state"])
  assert got["mesh"] == {"stage": 1, "data": 2, "fsdp": 1, "context": 1, "tensor": 1, "expert": 4}
  assert got["tokens_per_step"] == 8 * 32 and got["num_devices"] == 8 and got["compile_seconds"] > 0


def test_over_the_hbm_limit_exits_1_in_one_line(printed, cache):
  peak = json.loads(printed[-1])["peak_bytes_per_device"]
  out = _tool(f"compile_hbm_gib={peak / 2**30 / 2:.6f}", cache=cache)
  assert out.returncode == 1
  lines = out.stderr.strip().splitlines()
  assert lines[-1].startswith("error: needs ") and "GiB per device, the limit is" in lines[-1]
  assert "Traceback" not in out.stderr
  ok = _tool(f"compile_hbm_gib={peak / 2**30 * 2:.6f}", cache=cache)
  assert ok.returncode == 0, ok.stderr[-1000:]


def test_bad_key_exits_2_in_one_line():
  out = _tool("ici_expert_parallelizm=4")
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith("config error: unknown config key 'ici_expert_parallelizm'")
  out = _tool("num_experts=6", "n_routing_groups=2", "topk_routing_group=1")  # 6 experts over 4 devices
  assert out.returncode == 2 and "num_experts=6 is not divisible by ici_expert_parallelism=4" in out.stderr
  assert "Traceback" not in out.stderr
  out = _tool("compile_topology=nope:1x1")  # no TPU compiler for it (CI has no libtpu; nor does libtpu know 'nope')
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith("config error: compile_topology='nope:1x1': no TPU compiler")


def test_qlora_reports_the_frozen_fp8_base_the_adapters_and_optimizer_state_for_the_adapters_only():
  out = _tool("lora_rank=4", "weight_quantization=fp8_block", "weight_block_size=[16,16]")
  assert out.returncode == 0, out.stderr[-2000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert "frozen base" in out.stdout and "LoRA adapters" in out.stdout
  adapters, base = got["adapter_bytes_per_device"], got["base_bytes_per_device"]
  assert got["parameter_bytes_per_device"] == adapters + base and 0 < adapters < base  # tiny dims: r=4 is not small
  # AdamW's mu and nu mirror the fp32 adapters; the base has none (the rest: the replicated step counts)
  assert 2 * adapters <= got["optimizer_bytes_per_device"] <= 2 * adapters + 64
  cfg = make_config(num_devices=8, lora_rank=4, **KEYS)
  mesh = sharding.create_mesh(cfg)
  state, _, _ = train.abstract_train_step(cfg, mesh)
  assert got["trainable_parameters"] == sum(x.size for x in jax.tree.leaves(state["params"])) > 0


@pytest.mark.slow  # ~100 s and ~3 GB on this 2-core host
def test_the_671b_train_step_compiles_to_the_peak_docs_training_md_states():
  """docs/training.md, "Will it fit?": its first command (the 671B's 4K train step on 256 virtual devices) exits 0
  under its compile_hbm_gib and its peak is the table's "4K training, batch 256" row within 1%."""
  import re
  import shlex

  from tests.unit.test_docs import _commands, _fenced, _read
  section = _read("docs/training.md").split("## Will it fit?")[1].split("\n## ")[0]
  command = _commands(_fenced(section, "bash")[0])[0]
  row = next(ln for ln in section.splitlines() if ln.startswith("| 4K training, batch 256 |"))
  documented = float(re.search(r"\*\*([\d.]+)\*\*", row).group(1))
  argv = shlex.split(command)
  assert argv[:3] == [".venv/bin/python", "-m", "MaxText.train_compile"], command
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user runs it: not the tests' fast-compile flags
  out = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, env=dict(env, PYTHONPATH=REPO_ROOT),
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-2000:]
  peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes_per_device"] / 2**30
  assert peak == pytest.approx(documented, rel=0.01), f"compiled {peak:.2f} GiB, docs/training.md says {documented}"
