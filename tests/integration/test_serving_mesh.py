"""Decode on a mesh (MaxText/inference/serving.py, paged_cache.py): on 8 simulated devices, data x
expert, attention data-parallel over sequences (each device its own rows and its own shard of the
paged pools) and the experts over `expert` by the all-to-all dispatch, the greedy outputs of
several concurrent, staggered requests sharing a prefix equal the single-device engine's; every
row's pages lie in its device's shard; the compiled step reads no other device's pool (no
all-gather of a pool); a context-parallel prefill chunk gives the same outputs."""

import re

import jax
import pytest

from MaxText.checkpoint import model_state
from MaxText.inference import paged_pools
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import aot, sharding
from tests.conftest import make_config

BASE = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=8, serve_max_num_tokens=64, prefill_chunk_size=8,
            num_decoder_layers=3, first_num_dense_layers=1, moe_capacity_factor=-1.0, matmul_precision="highest",
            # 2 MoE layers: a scanned stack read by layer index on each device's page shard (paged_pools.layer_of)
            serve_num_pages=56,  # 448 slots: a size no weight has, to find the pool in the HLO
            serve_width_buckets=1, serve_context_buckets=1)  # few step shapes: few compiles (the server tests run the defaults)
SYSTEM = [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # one full page and a half, shared
PROMPTS = [SYSTEM + [30, 31], [1, 99, 7], SYSTEM + [40], [5] * 17, SYSTEM + [30, 32, 33], [1, 2], [7, 8, 9, 10]]
ARRIVALS = {0: [0, 1, 2], 2: [3], 3: [4, 5, 6]}
NEW = 6


def _serve(num_devices, **mesh):
  """Greedy outputs by prompt index on a mesh of num_devices, and the engine."""
  cfg = make_config(num_devices=num_devices, **{**BASE, **mesh})
  m = sharding.create_mesh(cfg)
  with jax.set_mesh(m), sharding.logical_rules(cfg, m):
    graphdef, params, buffers, _ = model_state.create(cfg, m)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    requests, step = {}, 0
    homes = set()
    while step < 200 and (step <= max(ARRIVALS) or not eng.idle):
      for i in ARRIVALS.get(step, []):
        requests[i] = eng.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW))
      for r in eng.scheduler.running:
        shards = {eng.allocator.shard_of(p) for p in r.pages}
        assert len(shards) == 1, "a sequence's pages span page shards"
        homes |= shards
      eng.step()
      step += 1
    assert eng.idle
    eng.allocator.check()
    return eng, {i: r.output for i, r in requests.items()}, homes


def _no_pool_crosses_devices(programs) -> None:
  """No collective in the compiled programs moves an array with the pools' 448-slot axis: each device
  reads and writes its own pages only."""
  for program in programs:
    moved = [line for line in program.as_text().splitlines()
             if re.search(r"\s(all-gather|all-reduce|all-to-all|collective-permute)(-start)?\(", line)
             and re.search(r"[\[,]448[,\]]", line)]
    assert not moved, f"a pool crossed devices: {moved[:2]}"


@pytest.fixture(scope="module")
def single():
  return _serve(1, ici_data_parallelism=1)[1]


def test_data_x_expert_mesh_equals_one_device(single):
  eng, got, homes = _serve(8, ici_data_parallelism=2, ici_expert_parallelism=4)
  assert eng.shards == 8 and len(homes) > 1  # rows really spread over the devices' page shards
  assert got == single
  pools = jax.tree.leaves(eng.pools)[0]  # [L, N, n]: the slot axis over data x expert
  assert pools.sharding.spec[1] == ("data", "expert")
  assert pools.addressable_shards[0].data.shape[1] == pools.shape[1] // 8
  _no_pool_crosses_devices(eng.compile_step(8, 1)[:2] + eng.compile_step(8, 8)[:2])  # decode, prefill: step, write
  assert aot.collective_counts(eng.compile_step(8, 1)[0].as_text()).get("all-to-all", 0) > 0  # expert dispatch


def test_speculative_decoding_on_a_data_x_expert_mesh_equals_one_device(single):
  # MTP drafts verified on the mesh: the MTP pool shards over pages as the stacks' pools; greedy = k=0 alone
  eng, got, homes = _serve(8, ici_data_parallelism=2, ici_expert_parallelism=4, mtp_num_layers=1,
                           serve_speculative_tokens=1)
  assert eng.shards == 8 and len(homes) > 1 and eng.stats()["spec_drafted"] > 0
  assert got == single
  mtp = jax.tree.leaves(eng.spec.mtp_pool)[0]  # [N, n]
  assert mtp.sharding.spec[0] == ("data", "expert") and mtp.addressable_shards[0].data.shape[0] == mtp.shape[0] // 8
  _no_pool_crosses_devices(eng.compile_step(8, 2)[:2])  # the speculative decode step (with the MTP pool), its write


def test_context_parallel_prefill_chunk_equals_one_device(single):
  eng, got, _ = _serve(8, ici_data_parallelism=2, ici_context_parallelism=2, ici_expert_parallelism=2)
  assert eng.shards == 4 and paged_pools.page_axes(eng.config, eng.mesh) == ("data", "expert")
  assert got == single
