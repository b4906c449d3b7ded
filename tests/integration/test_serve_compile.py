"""MaxText.serve_compile on 8 virtual devices, a tiny model, compile only: the JSON keys agree with
each other and with the engine's pools (cache_tokens = pages x page size, requests = whole
max_target_length sequences per page shard, pool bytes per device = the pools' bytes / shards,
peak = the parts it names); compile_hbm_gib sizes the pools to fill what it leaves (one more page
per shard would not fit); weights and temporaries over the limit, or an explicit pool over it,
exit 1 in one line."""

import json
import os
import subprocess
import sys

import pytest

from MaxText.inference import paged_pools
from tests.conftest import REPO_ROOT, make_config

KEYS = dict(ici_data_parallelism=2, ici_expert_parallelism=4, num_decoder_layers=2, first_num_dense_layers=1,
            mtp_num_layers=0, max_target_length=64, serve_page_size=16, serve_max_num_seqs=8, prefill_chunk_size=16)
SHARDS, PAGES_PER_SEQ = 8, 4
ARGV = ["configs/base.yml", "compile_num_devices=8"] + [f"{k}={v}" for k, v in KEYS.items()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


def _tool(cache, *extra):
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run([sys.executable, "-m", "MaxText.serve_compile", *ARGV, *extra], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def explicit(cache):
  # the pages compile_hbm_gib's probe uses (one max_target_length request per shard): the same program, cached
  out = _tool(cache, f"serve_num_pages={SHARDS * PAGES_PER_SEQ * 3}")
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert any(line.strip().startswith("peak") for line in lines[:-1])  # the table above the JSON line
  return json.loads(lines[-1])


def test_the_json_keys_agree(explicit):
  r = explicit
  pages = SHARDS * PAGES_PER_SEQ * 3
  assert r["cache_pages"] == pages and r["page_shards"] == SHARDS and r["page_size"] == 16
  assert r["cache_tokens"] == pages * 16
  assert r["requests_at_max_target_length"] == r["cache_tokens"] // r["max_target_length"] == 24
  cfg = make_config(num_devices=8, **KEYS)
  assert r["cache_bytes_per_device"] == paged_pools.pool_bytes(cfg, pages, 16) // SHARDS  # pages sharded
  assert r["rows"] == 8 and r["tokens_per_row"] == 16
  assert r["draft_bytes_per_device"] == 0  # not speculating
  assert r["peak_bytes_per_device"] == (r["weight_bytes_per_device"] + r["cache_bytes_per_device"]
                                        + r["draft_bytes_per_device"] + r["row_input_bytes_per_device"] + r["step_output_bytes_per_device"]
                                        + max(r["temp_bytes_per_device"], r["write_temp_bytes_per_device"]))
  assert r["write_alias_bytes_per_device"] == r["cache_bytes_per_device"]  # the write updates the pools in place
  assert r["collectives"].get("all-to-all", 0) > 0  # the experts' dispatch over `expert`
  assert r["mesh"]["expert"] == 4 and r["num_devices"] == 8


def test_compile_hbm_gib_sizes_the_pools_and_exits_1_when_nothing_is_left(explicit, cache):
  page_bytes = explicit["cache_bytes_per_device"] // (explicit["cache_pages"] // SHARDS)  # one page per shard
  rest = explicit["peak_bytes_per_device"] - explicit["cache_bytes_per_device"]
  hbm = (rest + 50.5 * page_bytes) / 2**30  # room for 50 pages per shard and half a page
  out = _tool(cache, f"compile_hbm_gib={hbm:.9f}")
  assert out.returncode == 0, out.stderr[-2000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["cache_pages"] == 50 * SHARDS and r["cache_tokens"] == 50 * SHARDS * 16
  assert r["requests_at_max_target_length"] == 50 // PAGES_PER_SEQ * SHARDS  # 12 whole requests per shard
  assert r["peak_bytes_per_device"] <= hbm * 2**30 < r["peak_bytes_per_device"] + page_bytes

  out = _tool(cache, f"compile_hbm_gib={rest / 2 / 2**30:.9f}")  # less than weights + temporaries
  assert out.returncode == 1
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("error: weights (") and "no room for the cache pools in compile_hbm_gib=" in line
  assert "Traceback" not in out.stderr

  out = _tool(cache, f"serve_num_pages={SHARDS * PAGES_PER_SEQ * 3}", f"compile_hbm_gib={hbm / 2:.9f}")
  assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("error: needs ")


def test_rows_not_a_multiple_of_the_page_shards_exit_2_in_one_line(cache):
  out = _tool(cache, "serve_max_num_seqs=4")
  assert out.returncode == 2
  assert "config key 'serve_max_num_seqs' = 4: a multiple of the 8 page shards" in out.stderr.strip().splitlines()[-1]
  assert "Traceback" not in out.stderr


def test_a_tpu_topology_is_refused_in_one_line(cache):
  out = _tool(cache, "compile_topology=v5p:2x2x1")  # train_compile's key: the serving step compiles on CPU devices
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith("config error: compile_topology='v5p:2x2x1': only MaxText.train_compile")
