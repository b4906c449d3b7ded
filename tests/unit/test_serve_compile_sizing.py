"""serve_compile's accounting without compiling (an abstract engine: nothing allocated, nothing
compiled): speculating, the MTP layer's pool counts in the cache (so the pools are sized with it),
its absorbed weights in the weights and the drafts' distributions apart; and a weights-bound failure
names the keys that shard the weights."""

import jax

from MaxText import serve_compile
from MaxText.inference import paged_cache
from MaxText.runtime import aot, sharding
from tests.conftest import make_config

KEYS = dict(max_target_length=64, serve_page_size=16, serve_max_num_seqs=4, serve_num_pages=8, mtp_num_layers=1)


def test_speculating_counts_the_mtp_pool_its_weights_and_the_drafts():
  cfg = make_config(**KEYS, serve_speculative_tokens=1)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    engine = serve_compile.build_engine(cfg)
  held = serve_compile.resident_bytes(engine)
  assert held["cache"] == paged_cache.pool_bytes(cfg, 8, 16)  # the stacks' layers + the MTP layer's
  target = aot.bytes_per_device((engine.params, engine.buffers, engine.absorbed))
  assert held["weights"] - target == aot.bytes_per_device(engine.spec.absorbed) > 0  # the MTP layer's absorbed
  assert held["draft"] == 4 * 1 * cfg.vocab_size * 4  # draft_q [S,k,V] fp32


def test_a_mesh_that_copies_the_weights_on_every_device_is_told_which_keys_shard_them():
  default = make_config(num_devices=8, ici_data_parallelism=-1)  # the default mesh: every device on data
  hint = serve_compile.weights_hint(default)
  assert "data=8" in hint and "ici_expert_parallelism=8 ici_data_parallelism=1" in hint and "ici_fsdp_parallelism" in hint
  assert serve_compile.weights_hint(make_config(num_devices=8, ici_data_parallelism=1, ici_expert_parallelism=8)) == ""
