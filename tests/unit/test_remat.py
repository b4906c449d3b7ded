"""Remat policies by name (layers/decoder.py REMAT_POLICIES): every policy computes the same loss and gradients
as no remat (they change what the backward pass keeps, never the math); each names checkpoints the layers place;
an unknown name is one line naming the key."""

import functools
import pathlib
import re

import jax
import numpy as np
import pytest

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.config.types import ConfigError
from MaxText.data import input_pipeline
from MaxText.layers import decoder
from MaxText.runtime import sharding
from tests.conftest import make_config

POLICIES = list(decoder.REMAT_POLICIES)  # the offload_ ones run on the CPU too (its host memory kinds)


@functools.cache
def _loss_and_grads(policy: str):
  cfg = make_config(remat_policy=policy, mtp_num_layers=1)  # the MTP layer is rematerialized as the stacks
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    data = input_pipeline.create_data_iterator(cfg, process_index=0, process_count=1)
    batch = train.prepare_batch(cfg, next(data))
    data.close()
    grad = jax.jit(jax.grad(lambda p: train.lm_loss_fn(cfg, graphdef, p, buffers, batch), has_aux=True))
    grads, (metrics, _) = grad(params)
  return float(metrics["loss"]), grads


@pytest.mark.parametrize("policy", [p if p == "save_qkv_proj" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in POLICIES])  # one fast; the rest in the slow lane
def test_a_remat_policy_gives_the_loss_and_gradients_of_no_remat(policy):
  want_loss, want = _loss_and_grads("none")
  loss, got = _loss_and_grads(policy)
  assert loss == pytest.approx(want_loss, rel=1e-6)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_every_name_a_policy_saves_is_placed_by_a_layer():
  src = "".join(p.read_text() for p in pathlib.Path(decoder.__file__).parents[1].rglob("*.py"))
  for name in decoder.MLA_PROJ + decoder.LAYER_OUTS + ("moe_expert_hidden", "mlp_hidden"):
    assert re.search(rf'checkpoint_name\(.*"{name}"\)', src), name


def test_an_unknown_remat_policy_is_one_line_naming_the_key():
  with pytest.raises(ConfigError) as e:
    make_config(remat_policy="save_qkv")
  assert "remat_policy" in str(e.value) and "save_qkv_proj" in str(e.value) and "\n" not in str(e.value)
