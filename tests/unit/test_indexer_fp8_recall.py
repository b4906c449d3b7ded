"""benchmarks/indexer_fp8_recall.py: the recall figure on planted cases and the fp8 variants' scores; the model's
cached scoring rounding its queries to fp8 as the config says."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import indexer_fp8_recall as bench
from MaxText.config import pyconfig
from MaxText.inference.cache_view import stack_views
from MaxText.inference.kv_cache import init_layer_cache
from MaxText.layers.models import Transformer


def test_recall_counts_the_shared_topk_on_a_planted_case():
  ref = jnp.asarray([[9.0, 8, 7, 6, 5, 4, 3, 2], [1, 2, 3, 4, 5, 6, 7, 8]])  # top-3: {0,1,2}, {7,6,5}
  same = ref * 2.0  # a monotone map: the same sets
  one_out = ref.at[0, 2].set(0.0)  # row 0 trades key 2 for key 3: 2 of 3 shared; row 1 intact
  assert bench.recall(same, ref, 3) == 1.0
  assert bench.recall(one_out, ref, 3) == pytest.approx((2 / 3 + 1) / 2)
  assert bench.recall(-ref, ref, 3) == 0.0  # the bottom 3 of 8 share nothing with the top 3


def test_topk_mask_takes_ties_lowest_position_first_and_skips_masked_keys():
  x = jnp.asarray([[1.0, 3, 3, 3, -jnp.inf, 5]])
  np.testing.assert_array_equal(bench.topk_mask(x, 3), [[False, True, True, False, False, True]])


def test_fp8_variants_score_past_a_query_position_minus_inf_and_rotation_keeps_fp32_scores():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((3, 4, 128)), jnp.float32)  # [n,H,d]
  k = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)  # [S,d]
  w = jnp.asarray(rng.uniform(size=(3, 4)), jnp.float32)
  pos = jnp.asarray([3, 9, 15])
  got = bench.fp8_variants(q, w, k, rotate=True, pos=pos)
  ref = bench.scores(q, None, w, k, None, pos)
  hm = jnp.asarray(bench.hadamard_matrix(128))
  np.testing.assert_allclose(bench.scores(q @ hm, None, w, k @ hm, None, pos), ref, rtol=1e-4, atol=1e-4)
  for s in got.values():
    assert np.all(np.isneginf(np.asarray(s)) == (np.arange(16)[None] > np.asarray(pos)[:, None]))
    live = np.isfinite(np.asarray(ref))
    scale = np.max(np.asarray(ref)[live])  # e4m3 keeps 3 mantissa bits: ~2-6% of the scores' range
    np.testing.assert_allclose(np.asarray(s)[live], np.asarray(ref)[live], rtol=0, atol=0.05 * scale)


def _tiny(**keys):
  cfg = pyconfig.initialize(["t", "base.yml", "scan_layers=false", "num_decoder_layers=2", "first_num_dense_layers=1",
                             "mtp_num_layers=0", "max_target_length=32",
                             *(f"{k}={v}" for k, v in keys.items())])
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # structure only: no init compiles
  rng = np.random.default_rng(0)
  for _, var in nnx.iter_graph(model):  # matrices N(0, 0.2); vectors (norm scales and biases) 1; buffers 0
    if isinstance(var, nnx.Variable):
      fill = rng.standard_normal(var.shape) * 0.2 if isinstance(var, nnx.Param) and len(var.shape) >= 2 else \
          np.full(var.shape, 1.0 if isinstance(var, nnx.Param) else 0.0)
      var.set_value(jnp.asarray(fill, var.dtype))
  return cfg, model


@pytest.mark.parametrize("flag", ["true", "false"])
def test_the_models_cached_scoring_rounds_its_queries_to_fp8_as_the_config_says(monkeypatch, flag):
  """MLA.attend_cached hands indexer_fp8_queries to CacheView.select_indexer: with an fp8 cache every layer's
  queries go through paged_decode.fp8_scored_queries (true, the default) or none does (false). Traced only."""
  from MaxText.inference import cache_view
  cfg, model = _tiny(kv_cache_dtype="fp8", indexer_fp8_queries=flag)
  assert pyconfig.initialize(["t", "base.yml"]).indexer_fp8_queries is True  # the default: the release's arithmetic
  seen = []
  real = cache_view.fp8_scored_queries
  monkeypatch.setattr(cache_view, "fp8_scored_queries", lambda q, w: seen.append(q.shape) or real(q, w))
  views = stack_views({"dense_layers": [init_layer_cache(cfg, 1)], "moe_layers": [init_layer_cache(cfg, 1)]}, None,
                      mode="sparse", index_head_chunk=cfg.indexer_head_chunk)
  tokens = jnp.ones((1, 8), jnp.int32)
  nnx.eval_shape(lambda m, t, v: m(t, cache=v), model, tokens, views)
  assert len(seen) == (cfg.num_decoder_layers if flag == "true" else 0)
