"""benchmarks/indexer_fp8_recall.py: the recall figure on planted cases, the layer-by-layer capture that
the trained-cache mode reads (it must be the model's own forward), and the per-layer figures."""

import json
import os
import shutil

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


@pytest.fixture(scope="module")
def tiny():
  cfg, model = _tiny()
  tokens = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (1, 32)), jnp.int32)
  return cfg, model, tokens


def test_layer_inputs_run_the_models_own_forward_and_give_the_keys_a_cache_stores(tiny):
  cfg, model, tokens = tiny
  inputs, x = nnx.jit(bench.layer_inputs)(model, tokens)
  assert len(inputs) == cfg.num_decoder_layers  # the dense layer, then the MoE layer
  want, _ = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(model.logits(model.final_norm(x)), want, rtol=1e-5, atol=1e-5)
  # the inference prefill (MLA.attend_cached over an empty contiguous cache) stores these indexer keys
  views = stack_views({"dense_layers": [init_layer_cache(cfg, 1)], "moe_layers": [init_layer_cache(cfg, 1)]}, None,
                      mode="sparse", index_head_chunk=cfg.indexer_head_chunk)
  _, aux = nnx.jit(lambda m, t, v: m(t, cache=v))(model, tokens, views)
  stored = [e["idx_k"] for name in ("dense_layers", "moe_layers") for e in aux["cache_entries"][name]]  # [1,T,d]
  pos = jnp.arange(tokens.shape[1])[None]
  for layer, x_in, k in zip(bench.decoder_layers(model), inputs, stored):
    np.testing.assert_allclose(layer.attention.indexer.keys(x_in, pos), k, rtol=1e-5, atol=1e-5)


def test_layer_figures_on_a_tiny_model(tiny):
  cfg, model, tokens = tiny
  inputs, _ = nnx.jit(bench.layer_inputs)(model, tokens)
  qpos = jnp.asarray([16, 23, 31])
  figs = bench.layer_figures(bench.decoder_layers(model)[1].attention, inputs[1], qpos, (4, 8), False)
  assert sorted(figs) == [4, 8]
  for f in figs.values():
    assert {name for name, _ in bench.COLUMNS} <= set(f)
    for name, v in f.items():
      assert v.shape == (3,) and np.all(np.isfinite(v)), name
    for rot in ("none", "hadamard"):  # where fp8 keeps the fp32 set, the attention output is unchanged
      r, e = np.asarray(f[f"{rot}/fp8_keys_and_queries"]), np.asarray(f[f"{rot}/fp8_keys_and_queries/out_err"])
      assert np.all((r >= 0) & (r <= 1)) and np.all(e[r == 1] == 0)
    assert np.all(np.asarray(f["sparse_vs_dense_err"]) > 0)  # k < the keys a query sees: sparse != dense


def test_layer_figures_read_a_rotated_model_as_the_same_scores(tiny):
  """indexer_hadamard=true: the same parameters give the same figures (the rotation is undone first)."""
  cfg, model, tokens = tiny
  _, rotated = _tiny(indexer_hadamard="true")  # the same draws: the same parameters
  qpos = jnp.asarray([16, 31])
  def figures(m, rotate):  # the first layer's
    return bench.layer_figures(bench.decoder_layers(m)[0].attention, nnx.jit(bench.layer_inputs)(m, tokens)[0][0],
                               qpos, (8,), rotate)[8]
  plain, turned = figures(model, False), figures(rotated, True)
  for name in plain:
    np.testing.assert_allclose(turned[name], plain[name], atol=1e-3, err_msg=name)


def test_make_corpus_writes_whole_files_as_jsonl_documents(tmp_path):
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.md").write_text("# A\n\npara one\n\npara two\n")
  (tmp_path / "MaxText" / "sub").mkdir(parents=True)
  (tmp_path / "MaxText" / "sub" / "m.py").write_text("x = 1\n")
  (tmp_path / "benchmarks").mkdir()
  (tmp_path / "benchmarks" / "b.py").write_text("y = 2\n")
  out = tmp_path / "corpus"
  assert bench.make_corpus(str(out), root=str(tmp_path)) == {"train": 2, "eval": 1}
  train = [json.loads(line) for line in (out / "train" / "train.jsonl").read_text().splitlines()]
  assert [r["file"] for r in train] == ["docs/a.md", os.path.join("MaxText", "sub", "m.py")]
  assert train[0]["text"] == "# A\n\npara one\n\npara two\n"  # one document per file, blank lines kept
  assert json.loads((out / "eval" / "eval.jsonl").read_text())["text"] == "y = 2\n"


def test_run_mode_names_what_is_wrong_in_one_line(tmp_path):
  def error(*argv):
    with pytest.raises(SystemExit) as e:
      bench.main(["--run", str(tmp_path), *argv])
    return str(e.value.code)

  assert "has no config.yml" in error()
  shutil.copy(os.path.join(bench.REPO, "configs", "base.yml"), tmp_path / "config.yml")  # scanned layers
  assert "scan_layers=false" in error()
  assert "needs --context >= 128" in error("--set", "scan_layers=false", "--topk", "64")  # max_target_length 64


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
