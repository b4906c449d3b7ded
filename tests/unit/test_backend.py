"""The per-backend choices of the kernels (MaxText/kernels/backend.py): the table, forcing, and each
choice forced on the CPU against the CPU-tuned one: the same selected sets, equal values."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.kernels import backend, moe_dispatch, moe_experts
from MaxText.kernels import selection as sel
from MaxText.kernels import sparse_attention as sa
from MaxText.kernels import topk_indices as ti
from MaxText.layers.attention_mla import MLA
from MaxText.layers.models import Transformer
from MaxText.layers.moe import DeepSeekMoE
from tests.conftest import make_config

pytestmark = pytest.mark.device  # runs unchanged on one GPU or TPU (tools/device/device_check.sh)


def test_table_cpu_row_is_the_measured_one_and_other_backends_are_portable():
  assert backend.row("cpu") == backend.CPU
  for name in ("gpu", "some_new_backend"):
    assert backend.row(name) == backend.PORTABLE
  # the TPU's: what was measured there (the k-th value kernel, the binned approx selection, the decode kernels, the
  # grouped placement, splash, the one-hot page lookup, the few-row matmul layout, the strided fp8 words, the paired
  # fp8 keys), the rest portable
  assert backend.row("tpu") == dataclasses.replace(backend.PORTABLE, exact_selection="pallas", approx_selection="binned",
                                                   paged_scoring="pallas", index_placement="grouped",
                                                   rope_storage="rows", mask_attention="splash", page_lookup="onehot",
                                                   matmul_layout="few_rows_pinned", fp8_unpack="shifts",
                                                   key_order="paired")
  for name, (tuned, portable) in backend.OPTIONS.items():
    assert getattr(backend.CPU, name) == tuned and getattr(backend.PORTABLE, name) == portable
  if not os.environ.get("MAXTEXT_TEST_KERNEL_ROW"):  # tests/conftest.py forces no row
    assert backend.choices() == backend.row(jax.default_backend())


def test_forced_nests_restores_and_rejects_what_does_not_exist():
  here = backend.choices()
  with backend.forced("gpu") as gpu:
    assert gpu == backend.PORTABLE
    with backend.forced(exact_selection="binned", gather_min_length=64) as inner:
      assert inner == backend.Choices(**{**vars(backend.PORTABLE), "exact_selection": "binned",
                                         "gather_min_length": 64})
    assert backend.choices() == backend.PORTABLE
  assert backend.choices() == here
  for bad in (dict(exact_selection="sort"), dict(no_such_choice="x"), dict(gather_min_length=0)):
    with pytest.raises(ValueError, match="backend.forced"):
      with backend.forced(**bad):
        pass


# ---------------------------------------------------------------- selection


def _scores(shape, seed=0):
  """Random scores with ties at the k-th values, NaN, -inf (masked keys) and rows with few keys."""
  rng = np.random.default_rng(seed)
  x = np.round(rng.standard_normal(shape) * 4) / 4  # coarse: many ties
  x[rng.random(shape) < 0.03] = np.nan
  valid_len = rng.integers(0, shape[-1] + 1, size=shape[:-1])
  valid_len[..., 0] = shape[-1]
  return jnp.asarray(np.where(np.arange(shape[-1]) < valid_len[..., None], x, -np.inf), jnp.float32)


def _exact_paths(scores, k):
  threshold = sel.topk_threshold(scores, k)
  return dict(threshold=threshold, mask=sel.topk_mask(scores, k), raw=sel.topk_mask(scores, k, exact_topk=False),
              generated=sel.generate_mask(scores, threshold, exact_topk=True, k=k),
              indices=ti.topk_indices(scores, k))


def _approx_paths(scores, k):
  values, indices = sel.select_topk(scores, k, approx=True, recall_target=0.9)
  return dict(values=values, indices=indices, mask=sel.topk_mask(scores, k, approx=True, recall_target=0.9),
              raw=sel.topk_mask(scores, k, exact_topk=False, approx=True, recall_target=0.9),
              slots=ti.topk_indices(scores, k, approx=True, recall_target=0.9))


def _run_under(paths, scores, k, **choices):
  with backend.forced(**choices):  # a fresh jit: traced inside the block
    return jax.tree.map(np.asarray, jax.jit(paths, static_argnums=1)(scores, k))


def test_exact_selection_top_k_and_row_blocks_all_give_the_cpu_sets():
  scores, k = _scores((2, 40, 1024)), 64  # 80 rows: two cache blocks of 64 (one padded) under "cache"
  want = _run_under(_exact_paths, scores, k, exact_selection="binned", row_blocks="cache")
  finite = np.asarray(scores > -jnp.inf)  # NaN compares False
  np.testing.assert_array_equal(want["mask"].sum(-1), np.minimum(k, finite.sum(-1)))
  np.testing.assert_array_equal(want["generated"], want["mask"])
  for exact in ("binned", "top_k"):
    for rows in ("cache", "all"):
      got = _run_under(_exact_paths, scores, k, exact_selection=exact, row_blocks=rows)
      for name in want:
        np.testing.assert_array_equal(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]),
                                      err_msg=f"{name} under {exact}, {rows}")


def test_approx_selection_approx_max_k_keeps_the_invariants_and_binned_rows_agree():
  scores, k = _scores((2, 40, 1024), seed=1), 64
  finite = np.asarray(scores > -jnp.inf)
  exact = _run_under(_exact_paths, scores, k)["mask"]
  binned = _run_under(_approx_paths, scores, k, approx_selection="binned", row_blocks="cache")
  for choices in (dict(approx_selection="binned", row_blocks="all"), dict(approx_selection="approx_max_k"),
                  dict(approx_selection="approx_max_k", row_blocks="all")):
    got = _run_under(_approx_paths, scores, k, **choices)
    if choices["approx_selection"] == "binned":  # the same bins, in one block or several
      for name in binned:
        np.testing.assert_array_equal(jax.tree.leaves(got[name]), jax.tree.leaves(binned[name]), err_msg=name)
      continue
    values, indices = got["values"], got["indices"]
    assert all(len(np.unique(r)) == k for r in indices.reshape(-1, k))  # k distinct keys
    np.testing.assert_array_equal(values, np.take_along_axis(np.where(np.isnan(scores), -np.inf, scores),
                                                             indices, -1))
    index_mask = np.asarray(sel.generate_mask_reference(jnp.asarray(indices), scores.shape[-1])) & finite
    np.testing.assert_array_equal(got["mask"], index_mask)  # the mask is that index set
    assert (got["raw"] >= got["mask"]).all()
    idx, ok = got["slots"]
    np.testing.assert_array_equal(ok, values > -np.inf)
    assert (exact & got["mask"]).sum() / exact.sum() >= 0.9  # the recall target


# ---------------------------------------------------------------- sparse attention, MoE, the crossover


def _jaxpr_of_gather_path(query_loop):
  rng = np.random.default_rng(0)
  b, t, h, nope, r, c, v, hi, d = 1, 6, 2, 4, 2, 8, 4, 2, 4
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  queries = sa.SparseQueries(f(b, t, h, nope), f(b, t, h, r), f(b, t, hi, d), f(b, t, hi), pos, None)
  keys = sa.SparseKeys(f(b, t, c), f(b, t, r), f(b, t, d), pos, None)
  spec = sa.SparseSpec(num_heads=h, nope=nope, v=v, scale=0.3, topk=3, query_block=3, head_chunk=1,
                       query_loop=query_loop)
  fn = lambda q, k, w: sa.sparse_mla_attention(q, k, w, spec).out  # noqa: E731
  return str(jax.make_jaxpr(fn)(queries, keys, f(c, h * (nope + v))))


def test_query_loop_none_follows_the_table():
  with backend.forced(query_loop="loop"):
    assert _jaxpr_of_gather_path(None) == _jaxpr_of_gather_path(True)
  with backend.forced(query_loop="vmap"):
    assert _jaxpr_of_gather_path(None) == _jaxpr_of_gather_path(False)
  assert _jaxpr_of_gather_path(True) != _jaxpr_of_gather_path(False)
  # values and gradients of both: tests/unit/test_sparse_attention.py (query_loop True / False)


def test_grouped_matmul_and_exchange_follow_the_table_and_ragged_dot_equals_blocked():
  cfg = make_config(num_experts=8, num_experts_per_tok=2, shared_experts=1)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 12, cfg.emb_dim)), jnp.float32)
  outs = {}
  for impl in ("blocked", "ragged_dot"):
    with backend.forced(grouped_matmul=impl):
      assert moe_experts.dispatch_impl() == impl
      layer = DeepSeekMoE(cfg, rngs=nnx.Rngs(0))
    assert layer.dispatch == impl
    outs[impl] = np.asarray(jax.jit(lambda x, layer=layer: layer(x)[0])(x))
  np.testing.assert_allclose(outs["ragged_dot"], outs["blocked"], rtol=1e-5, atol=1e-6)
  for name, exchange in (("cpu", "all_to_all"), ("gpu", "ragged_all_to_all"), ("tpu", "ragged_all_to_all")):
    with backend.forced(name):
      assert moe_dispatch.exchange_impl("auto") == exchange
      assert moe_dispatch.exchange_impl("all_to_all") == "all_to_all"  # the config key wins
  # ragged_all_to_all itself (XLA:CPU lacks it): tests/integration/test_expert_parallel.py


def test_gather_min_length_zero_is_the_backends_and_a_key_wins():
  auto = MLA(make_config(sparse_attention_impl="auto", sparse_attention_gather_min_length=0), rngs=nnx.Rngs(0))
  with backend.forced(gather_min_length=32):
    assert not auto.use_gather(31) and auto.use_gather(32)
  assert auto.use_gather(backend.choice("gather_min_length"))
  assert not auto.use_gather(backend.choice("gather_min_length") - 1)
  keyed = MLA(make_config(sparse_attention_impl="auto", sparse_attention_gather_min_length=16), rngs=nnx.Rngs(0))
  with backend.forced(gather_min_length=32):
    assert keyed.use_gather(16) and not keyed.use_gather(15)


# ---------------------------------------------------------------- the whole model


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_whole_model_on_the_gpu_row_equals_the_cpu_row():
  """The tiny model on the gather path (exact selection, per-query loop or vmap, blocked matmul or
  ragged_dot): loss and gradients under the portable row (what a GPU or TPU runs) equal the CPU's."""
  cfg = make_config(sparse_attention_impl="gather", sparse_attention_query_block=8, num_decoder_layers=2,
                    mtp_num_layers=0, max_target_length=24, max_prefill_length=24, indexer_topk=8,
                    remat_policy="none", scan_layers=False)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)  # as train.py holds them
  tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, cfg.vocab_size)

  def loss(params, rest):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

  results = {}
  for name in ("cpu", "gpu"):
    with backend.forced(name):
      results[name] = jax.jit(jax.value_and_grad(loss))(params, rest)
  (l_cpu, g_cpu), (l_gpu, g_gpu) = results["cpu"], results["gpu"]
  np.testing.assert_allclose(float(l_gpu), float(l_cpu), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_cpu), jax.tree.leaves(g_gpu)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_parse_forced_reads_a_command_lines_pairs_and_refuses_bad_ones_in_one_line():
  assert backend.parse_forced(["index_placement=grouped", "gather_min_length=64"]) == dict(
      index_placement="grouped", gather_min_length=64)
  assert backend.parse_forced([]) == {}
  for bad, says in ((["index_placement"], "NAME=VALUE"), (["nope=1"], "no choice 'nope'"),
                    (["index_placement=gather"], "expected one of"), (["gather_min_length=0"], ">= 1")):
    with pytest.raises(ValueError, match=says) as e:
      backend.parse_forced(bad)
    assert "\n" not in str(e.value)


def _dots(jaxpr, inside: bool = False):
  """(primitive name, its precision param, operand dtype) of every dot in `jaxpr` and its sub-jaxprs; `inside`:
  only those inside a pallas_call (a Mosaic kernel's body), plus ragged_dot anywhere (a Mosaic kernel on a TPU)."""
  from jax.extend import core as jcore
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "ragged_dot_general") and (inside or name == "ragged_dot_general"):
      yield name, eqn.params.get("precision"), eqn.invars[0].aval.dtype
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jcore.Jaxpr):
          yield from _dots(sub, inside or name == "pallas_call")


@pytest.mark.parametrize("kernel", ["paged_scores_bf16", "paged_scores_fp8", "mla_decode_fp8", "sparse_mla_attend",
                                    "kl_target", "moe_ragged_dot"])
def test_every_dot_a_mosaic_kernel_makes_names_its_precision(kernel):
  """JAX_DEFAULT_MATMUL_PRECISION=highest (which a user may set, and the device check does) turned each bf16 dot
  with no precision of its own into an fp32-contract one that Mosaic refuses ("Bad lhs type": 12 of the device
  tests on a v5e). Every dot inside a pallas_call, and ragged_dot (a Mosaic grouped matmul on a TPU), names one:
  backend.dot_precision (HIGHEST for f32 operands, DEFAULT otherwise)."""
  from MaxText.kernels import kl_target, moe_experts
  from MaxText.kernels import paged_decode as pd
  from MaxText.kernels import sparse_mla_kernel as smk
  s = jax.ShapeDtypeStruct
  b, n, page = 2, 64, 8
  cases = {
      "paged_scores_bf16": (lambda q, w, k, t, pos: pd.paged_index_scores(q, None, w, k, None, t, pos, page,
                                                                          interpret=True),
                            (s((b, 4, 128), jnp.bfloat16), s((b, 4), jnp.float32), s((n, 128), jnp.bfloat16),
                             s((b, 8), jnp.int32), s((b,), jnp.int32))),
      "paged_scores_fp8": (lambda q, w, k, ks, t, pos: pd.paged_index_scores(q, None, w, k, ks, t, pos, page,
                                                                             interpret=True),
                           (s((b, 4, 128), jnp.float32), s((b, 4), jnp.float32), s((n, 128), jnp.uint8),
                            s((n, 1), jnp.float32), s((b, 8), jnp.int32), s((b,), jnp.int32))),
      "mla_decode_fp8": (lambda *a: pd.sparse_mla_decode(*a, 0.1, block=16, interpret=True),
                         (s((b, 4, 128), jnp.float32), s((b, 4, 64), jnp.float32), s((b, 32), jnp.int32),
                          s((b, 32), jnp.bool_), s((n, 128), jnp.uint8), s((n, 64), jnp.float32),
                          s((n, 1), jnp.float32))),
      "sparse_mla_attend": (jax.grad(lambda q, kv, idx, ok: jnp.sum(smk.sparse_mla_attend(
                                q, kv, idx, ok, 0.1, 128, interpret=True)[0].astype(jnp.float32)), argnums=(0, 1)),
                            (s((1, 4, 4, 192), jnp.bfloat16), s((1, 16, 192), jnp.bfloat16),
                             s((1, 4, 8), jnp.int32), s((1, 4, 8), jnp.bool_))),
      "kl_target": (lambda q, k: kl_target.head_summed_probs_kernel(q, k, None, 0.1, interpret=True),
                    (s((1, 128, 2, 64), jnp.bfloat16), s((1, 128, 2, 64), jnp.bfloat16))),
      "moe_ragged_dot": (lambda rows, w, sizes: moe_experts.grouped_matmul(
                             rows, w, moe_experts.DispatchPlan(*(None,) * 3, group_sizes=sizes, block_expert=None),
                             impl="ragged_dot"),
                         (s((16, 32), jnp.bfloat16), s((4, 32, 8), jnp.bfloat16), s((4,), jnp.int32))),
  }
  fn, args = cases[kernel]
  with jax.default_matmul_precision("highest"):
    dots = list(_dots(jax.make_jaxpr(fn)(*args).jaxpr))
  assert dots, f"{kernel}: no dot found inside its kernel"
  for name, precision, dtype in dots:
    assert precision is not None, f"{kernel}: a {name} over {dtype} takes the process default precision"
    want = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    assert tuple(precision) == (want, want) if isinstance(precision, tuple) else precision == want
