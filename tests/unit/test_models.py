"""The whole Transformer: parameter counts of the official config, scan == loop, depth-independent compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import model_state
from MaxText.layers.attention_mla import capture_selection
from MaxText.layers.models import Transformer, cross_entropy, mtp_inputs, mtp_loss, token_accuracy
from tests.conftest import make_config

# From the official 671B shapes (see the closing note of the model issue for the sum):
# per dense layer 597,442,816, per MoE layer 11,521,245,440, embed = head = 926,679,040.
PARAMS_671B = 671_877_929_216           # main model incl. indexers, no MTP
MTP_LAYER = 11_624_027_392              # MTP: norms + eh_proj + one MoE layer (embed/head shared)
OFFICIAL_MTP_COPIES = 2 * 129280 * 7168  # the official checkpoint stores MTP's own embed + head copies


def test_671b_parameter_count_is_the_official_one():
  cfg = make_config(model_name="deepseek3.2-671b", mtp_num_layers=0)
  _, params, buffers = model_state.abstract_model(cfg)
  assert model_state.count_params(params) == PARAMS_671B
  assert model_state.count_params(buffers) == 58 * 256  # the routing correction biases


def test_671b_with_mtp_parameter_count():
  cfg = make_config(model_name="deepseek3.2-671b")
  _, params, _ = model_state.abstract_model(cfg)
  n = model_state.count_params(params)
  assert n == PARAMS_671B + MTP_LAYER
  assert round((n + OFFICIAL_MTP_COPIES) / 1e9, 1) == 685.4


# The forward pass compiled once per model (eager, op by op, took 100 s on a slow host).
_jit_forward = nnx.jit(lambda model, tokens: model(tokens))


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_scanned_and_unscanned_stacks_compute_the_same_function():
  cfg_s = make_config(scan_layers=True)
  cfg_l = make_config(scan_layers=False)
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 3, cfg_s.vocab_size)
  ms = Transformer(cfg_s, rngs=nnx.Rngs(0))
  ml = Transformer(cfg_l, rngs=nnx.Rngs(0))
  # Copy the stacked parameters into the per-layer modules.
  ps = nnx.state(ms, nnx.Param).to_pure_dict()
  pl = nnx.state(ml, nnx.Param).to_pure_dict()

  def unstack(stacked, per_layer):
    for i in per_layer:
      per_layer[i] = jax.tree.map(lambda a, i=i: a[i], stacked)
    return per_layer

  for stack in ("dense_layers", "moe_layers"):
    pl[stack]["layers"] = unstack(ps[stack]["layers"], pl[stack]["layers"])
  for k in ps:
    if k not in ("dense_layers", "moe_layers"):
      pl[k] = ps[k]
  nnx.update(ml, pl)
  ls, aux_s = _jit_forward(ms, tokens)
  ll, aux_l = _jit_forward(ml, tokens)
  np.testing.assert_allclose(ls, ll, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(aux_s["expert_load"], aux_l["expert_load"], rtol=1e-6)


def test_compiled_program_does_not_grow_with_depth():
  sizes = []
  for layers in (3, 9):
    cfg = make_config(num_decoder_layers=layers, first_num_dense_layers=1, mtp_num_layers=0)
    graphdef, params, buffers = model_state.abstract_model(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    f = lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0]
    hlo = jax.jit(f).lower(params.to_pure_dict(), buffers.to_pure_dict(), tokens).as_text()
    sizes.append(len(hlo))
  assert abs(sizes[1] - sizes[0]) / sizes[0] < 0.02, sizes


def test_cross_entropy_ignores_padding_and_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5))
  weights = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
  lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  want = (nll * weights).sum() / weights.sum()
  _, lm, _ = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
  np.testing.assert_allclose(lm, want, rtol=1e-6)
  # Changing a padded position's logits changes nothing.
  logits2 = logits.copy()
  logits2[0, 4] += 100.0
  np.testing.assert_allclose(cross_entropy(jnp.asarray(logits2), jnp.asarray(targets), jnp.asarray(weights))[1], lm)
  # accuracy: the weighted share of argmax hits; the padded position's (now certain) hit counts nothing
  hits = (logits.argmax(-1) == targets).astype(np.float64)
  acc = float(token_accuracy(jnp.asarray(logits2), jnp.asarray(targets), jnp.asarray(weights)))
  np.testing.assert_allclose(acc, (hits * weights).sum() / weights.sum(), rtol=1e-6)
  logits2[0, 0, targets[0, 0]] += 100.0  # a weighted position made a hit: +1/8
  assert float(token_accuracy(jnp.asarray(logits2), jnp.asarray(targets), jnp.asarray(weights))) == \
      pytest.approx(acc + (1 - hits[0, 0]) / 8)


def test_mtp_loss_targets_are_shifted_by_depth_and_stay_in_the_document():
  v = 6
  tokens = jnp.array([[0, 1, 2, 3, 4, 5]])
  targets = jnp.array([[1, 2, 3, 4, 5, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 2]])
  weights = jnp.ones((1, 6))
  m = mtp_inputs(tokens, targets, weights, seg, 2)
  np.testing.assert_array_equal(m["mtp_tokens"][1, 0, :4], [2, 3, 4, 5])
  np.testing.assert_array_equal(m["mtp_targets"][0, 0, :5], [2, 3, 4, 5, 0])
  # depth 1 at i predicts token i+2: valid for i=0 (doc 1 -> doc 1) and i=3 (doc 2), not across or past the end
  np.testing.assert_array_equal(m["mtp_weights"][0, 0], [1, 1, 0, 1, 1, 0])
  # Depth-1 logits that put all mass on the target: the loss is ~0 where valid.
  logits = 50.0 * jax.nn.one_hot(m["mtp_targets"][:1], v)  # [1,1,6,V]
  assert float(mtp_loss(logits, m["mtp_targets"][:1], m["mtp_weights"][:1])) < 1e-6
  broken = logits.at[0, 0, 2].set(0.0)  # crosses the document boundary: ignored
  assert float(mtp_loss(broken, m["mtp_targets"][:1], m["mtp_weights"][:1])) < 1e-6
  broken = logits.at[0, 0, 1].set(0.0)  # inside document 1: now it counts
  assert float(mtp_loss(broken, m["mtp_targets"][:1], m["mtp_weights"][:1])) > 0.1


def _layer_masks(model, tokens):
  (_, _), inter = capture_selection(model, tokens)
  inter = inter.to_pure_dict() if hasattr(inter, "to_pure_dict") else inter
  masks = []
  for stack in ("dense_layers", "moe_layers"):
    for i in sorted(inter.get(stack, {}).get("layers", {})):
      masks.append(np.asarray(inter[stack]["layers"][i]["attention"]["indexer_mask"][0]))
  return masks


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("exact", [True, False])
def test_every_layer_follows_indexer_mask_exact_topk(exact):
  """All indexer scores tie (weights_proj = 0): exact-k keeps the k lowest positions per query,
  the raw cutoff keeps every causal key; this must hold in each of the 4 layers."""
  k, t = 4, 12
  cfg = make_config(num_decoder_layers=4, first_num_dense_layers=1, scan_layers=False, mtp_num_layers=0,
                    indexer_topk=k, indexer_mask_exact_topk=exact)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  for layer in list(model.dense_layers.layers) + list(model.moe_layers.layers):
    w = layer.attention.indexer.weights_proj.kernel
    w[...] = jnp.zeros_like(w[...])
  masks = _layer_masks(model, jnp.ones((1, t), jnp.int32) * 5)
  assert len(masks) == 4
  causal = np.tril(np.ones((t, t), bool))
  first_k = causal & (np.arange(t)[None, :] < k)
  for i, m in enumerate(masks):
    np.testing.assert_array_equal(m[0], first_k if exact else causal, err_msg=f"layer {i}")


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
@pytest.mark.parametrize("approx", [True, False])
def test_every_layer_follows_indexer_use_approx_top_k(approx, monkeypatch):
  """Each layer's selection goes through the configured path: the approximate top-k (with the
  configured recall target) or the exact threshold, counted per layer while tracing."""
  from MaxText.layers import indexer as indexer_mod
  calls = []
  real_mask = indexer_mod.topk_mask

  def mask_spy(scores, k, *, exact_topk=True, approx=False, recall_target=0.95):
    calls.append(("approx", recall_target) if approx else ("threshold", exact_topk))
    return real_mask(scores, k, exact_topk=exact_topk, approx=approx, recall_target=recall_target)

  monkeypatch.setattr(indexer_mod, "topk_mask", mask_spy)
  # remat off: jax.checkpoint would trace identical layers once and hide the per-layer count.
  cfg = make_config(num_decoder_layers=4, first_num_dense_layers=1, scan_layers=False, mtp_num_layers=1,
                    remat_policy="none", indexer_use_approx_top_k=approx, indexer_approx_top_k_recall=0.9)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  _jit_forward(model, jnp.ones((1, 32), jnp.int32))  # traced once: each layer's selection once
  want = [("approx", 0.9)] if approx else [("threshold", True)]
  assert calls == want * 5  # 4 decoder layers + the MTP layer


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_bf16_params_and_activations_track_fp32():
  tokens = jax.random.randint(jax.random.key(3), (2, 32), 3, 512)
  cfg32 = make_config(mtp_num_layers=0)
  cfg16 = make_config(mtp_num_layers=0, dtype="bfloat16", weight_dtype="bfloat16")
  m32 = Transformer(cfg32, rngs=nnx.Rngs(0))
  m16 = Transformer(cfg16, rngs=nnx.Rngs(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(m16, nnx.Param)))
  # Same weights (rounded to bf16) in both, so only the arithmetic differs.
  p16 = nnx.state(m16, nnx.Param).to_pure_dict()
  nnx.update(m32, jax.tree.map(lambda a: a.astype(jnp.float32), p16))
  l32, l16 = _jit_forward(m32, tokens)[0], _jit_forward(m16, tokens)[0]
  assert l16.dtype == jnp.float32  # logits are upcast for the loss
  rel = float(jnp.linalg.norm(l16 - l32) / jnp.linalg.norm(l32))
  assert rel < 5e-2, rel


@pytest.mark.parametrize("keys,loss", [
    (dict(), "loss = lm + 0.1 x mtp + 1 x indexer;"),
    (dict(indexer_training_stage="dense_warmup"), "loss = 1 x indexer;"),  # the main model frozen
    (dict(indexer_training_stage="none", mtp_num_layers=0), "loss = lm;"),
])
def test_the_console_names_each_loss_and_how_loss_sums_them(keys, loss):
  from MaxText.train import loss_legend
  said = loss_legend(make_config(**keys))
  assert said.startswith(f"losses: {loss}") and "lm: next-token cross-entropy (the language model's progress)" in said
  assert ("indexer: KL(attention || indexer scores)" in said) == (keys.get("indexer_training_stage") != "none")
