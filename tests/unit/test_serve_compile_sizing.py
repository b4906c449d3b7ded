"""serve_compile's accounting without compiling (an abstract engine: nothing allocated, nothing
compiled): speculating, the MTP layer's pool counts in the cache (so the pools are sized with it),
its absorbed weights in the weights and the drafts' distributions apart; and a weights-bound failure
names the keys that shard the weights."""

import jax
import pytest

from MaxText import serve_compile
from MaxText.config.types import ConfigError
from MaxText.inference import paged_pools
from MaxText.runtime import aot, sharding
from tests.conftest import make_config

KEYS = dict(max_target_length=64, serve_page_size=16, serve_max_num_seqs=4, serve_num_pages=8, mtp_num_layers=1)


def test_speculating_counts_the_mtp_pool_its_weights_and_the_drafts():
  cfg = make_config(**KEYS, serve_speculative_tokens=1)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    engine = serve_compile.build_engine(cfg)
  held = serve_compile.resident_bytes(engine)
  assert held["cache"] == paged_pools.pool_bytes(cfg, 8, 16)  # the stacks' layers + the MTP layer's
  target = aot.bytes_per_device((engine.params, engine.buffers, engine.absorbed))
  assert held["weights"] - target == aot.bytes_per_device(engine.spec.absorbed) > 0  # the MTP layer's absorbed
  assert held["draft"] == 4 * 1 * cfg.vocab_size * 4  # draft_q [S,k,V] fp32


def test_a_mesh_that_copies_the_weights_on_every_device_is_told_which_keys_shard_them():
  default = make_config(num_devices=8, ici_data_parallelism=-1)  # the default mesh: every device on data
  hint = serve_compile.weights_hint(default)
  assert "data=8" in hint and "ici_expert_parallelism=8 ici_data_parallelism=1" in hint and "ici_fsdp_parallelism" in hint
  assert serve_compile.weights_hint(make_config(num_devices=8, ici_data_parallelism=1, ici_expert_parallelism=8)) == ""


def test_requests_that_fit_count_whole_sequences_per_page_shard():
  assert serve_compile.requests_that_fit(96, 8, 4) == 24  # 12 pages a shard: 3 sequences in each of 8 shards
  assert serve_compile.requests_that_fit(88, 8, 4) == 16  # 11 pages a shard: 2 each (88 // 4 = 22 pooled)
  assert serve_compile.requests_that_fit(12, 2, 4) == 2  # 6 + 6 pages: a sequence does not span two shards


def _probe(page_bytes: int, shards: int = 8, pages_per_shard: int = 4) -> dict:
  """A report of a small pool: 1 GiB of weights, 0.5 GiB of step temporaries, nothing else."""
  return {"page_shards": shards, "cache_pages": shards * pages_per_shard,
          "cache_bytes_per_device": page_bytes * pages_per_shard, "weight_bytes_per_device": 2**30,
          "draft_bytes_per_device": 0, "row_input_bytes_per_device": 0, "step_output_bytes_per_device": 0,
          "temp_bytes_per_device": 2**29, "write_temp_bytes_per_device": 0}


def test_the_hbm_left_after_weights_and_temporaries_sets_the_requests_at_a_page_boundary():
  page = 2**20
  probe = _probe(page)
  exact = (2**30 + 2**29 + 12 * page) / 2**30  # room for 12 pages a shard: 3 sequences of 4 pages each
  pages = serve_compile.pages_within(probe, exact)
  assert pages == 96 and serve_compile.requests_that_fit(pages, 8, 4) == 24
  pages = serve_compile.pages_within(probe, exact - 1 / 2**30)  # one byte less: 11 pages a shard, 2 sequences
  assert pages == 88 and serve_compile.requests_that_fit(pages, 8, 4) == 16


def test_a_multi_host_plan_names_the_mesh_axes_whose_collectives_cross_hosts():
  two_nodes = make_config(num_devices=16, num_experts=16, global_batch_size=16, ici_expert_parallelism=16, distributed_num_processes=2)
  assert serve_compile.hosts(two_nodes) == {"processes": 2, "devices_per_process": 8, "cross_process_axes": ["expert"]}
  data_outer = make_config(num_devices=16, global_batch_size=16, ici_data_parallelism=2, ici_expert_parallelism=8, distributed_num_processes=2)
  assert serve_compile.hosts(data_outer)["cross_process_axes"] == ["data"]  # each node holds all the experts
  one = make_config(num_devices=8, ici_expert_parallelism=8)  # distributed_num_processes=-1: one process
  assert serve_compile.hosts(one) == {"processes": 1, "devices_per_process": 8, "cross_process_axes": []}
  with pytest.raises(ConfigError, match="distributed_num_processes=3 does not divide the 16 devices"):
    serve_compile.hosts(make_config(num_devices=16, num_experts=16, global_batch_size=16, ici_expert_parallelism=16, distributed_num_processes=3))


def test_resizing_after_an_overshoot_takes_the_growth_of_the_step_temporaries_too():
  page = 2**20
  probe = _probe(page)  # 4 pages a shard, step temporaries 0.5 GiB
  last = {**probe, "cache_pages": 8 * 104, "cache_bytes_per_device": 104 * page,
          "temp_bytes_per_device": 2**29 + 100 * 2**18}  # 100 pages more: the step's grew a quarter page a page
  hbm = (2**30 + 2**29 + 4 * 2**18 + 4 * page + 80 * (page + 2**18)) / 2**30  # fits 84 pages a shard, not 85
  pages = serve_compile.pages_within(probe, hbm, last=last)
  assert pages == 84 * 8
  grown = 2**29 + (pages // 8 - 4) * 2**18  # the step's temporaries at that pool (linear in pages)
  assert 2**30 + pages // 8 * page + grown <= hbm * 2**30 < 2**30 + (pages // 8 + 1) * (page + 2**18) + grown
