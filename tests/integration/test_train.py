"""End-to-end training: the loss falls (and its tensorboard events are readable), the two indexer
stages train what the paper trains, a file dataset trains, a non-finite loss stops the run without
checkpointing the bad state. (kill -9 and resume with grain data: tests/integration/test_multiprocess.py,
2 processes killed with -9 resume with the losses of 1 process, to the 2-vs-1 summation order; the
grain position a checkpoint saves, exactly: tests/unit/test_data_streams.py.)"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.config import pyconfig
from MaxText.data import input_pipeline
from MaxText.kernels import selection
from MaxText.layers import indexer as indexer_lib
from MaxText.runtime import sharding
from tests.conftest import REPO_ROOT, make_config

DATA = os.path.join(REPO_ROOT, "tests", "data")


def small(tmp_path, **kw):
  base = dict(base_output_directory=str(tmp_path), run_name="run", steps=30, log_period=1,
              enable_checkpointing=False, enable_tensorboard=False, warmup_steps=3, mtp_num_layers=1)
  base.update(kw)
  return make_config(**base)


def test_loss_falls_on_the_learnable_synthetic_task_and_tensorboard_events_are_readable(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  cfg = small(tmp_path, steps=80, enable_tensorboard=True)
  losses = []
  orig = train.MetricsLogger.log

  def capture(self, step, scalars, **k):
    losses.append(scalars["lm_loss"])
    return orig(self, step, scalars, **k)

  train.MetricsLogger.log = capture
  try:
    train.train(cfg)
  finally:
    train.MetricsLogger.log = orig
  assert len(losses) == 80
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), (losses[:5], losses[-5:])
  acc = EventAccumulator(cfg.tensorboard_dir)
  acc.Reload()
  tags = set(acc.Tags()["scalars"])
  for tag in ("loss", "lm_loss", "indexer_loss", "mtp_loss", "grad_norm", "learning_rate", "tokens_per_s", "mfu"):
    assert tag in tags, tags
  assert [e.step for e in acc.Scalars("loss")] == list(range(1, 81))


def _one_step(cfg):
  """Params before and after one train step (warmup_steps=0: the first step has the peak lr)."""
  assert cfg.warmup_steps == 0
  mesh = sharding.create_mesh(cfg)
  graphdef, params, buffers, _ = model_state.create(cfg, mesh)
  tx = train.make_optimizer(cfg, params)
  state = {"params": params, "buffers": buffers, "opt_state": tx.init(params), "step": jnp.int32(0)}
  batch = train.prepare_batch(cfg, next(input_pipeline.create_data_iterator(cfg)))
  before = jax.tree.map(np.asarray, params)
  new_state, metrics = jax.jit(train.make_train_step(cfg, graphdef, tx))(state, batch)
  return before, jax.tree.map(np.asarray, new_state["params"]), metrics, (graphdef, params, buffers, batch)


def _changed(before, after):
  out = {}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
    out[jax.tree_util.keystr(path)] = not np.array_equal(a, b)
  return out


def test_dense_warmup_trains_only_the_indexers(tmp_path):
  cfg = small(tmp_path, indexer_training_stage="dense_warmup", warmup_steps=0)
  before, after, metrics, _ = _one_step(cfg)
  changed = _changed(before, after)
  indexer = {k: v for k, v in changed.items() if "'indexer'" in k}
  main = {k: v for k, v in changed.items() if "'indexer'" not in k}
  assert indexer and all(indexer.values()), indexer
  assert not any(main.values()), [k for k, v in main.items() if v]
  assert float(metrics["indexer_loss"]) > 0


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse", "none"])
def test_the_optimizer_moves_exactly_what_the_indexer_stage_trains(tmp_path, stage):
  # A frozen part's gradient is zero in training anyway (the main model's in the warm-up, the
  # indexer's with stage none): only weight decay would show a broken freeze there. So: no decay,
  # and a non-zero gradient on every parameter.
  cfg = small(tmp_path, indexer_training_stage=stage, adam_weight_decay=0.0, warmup_steps=0)
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), model_state.abstract_model(cfg)[1].to_pure_dict())
  tx = train.make_optimizer(cfg, params)
  updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  moved = _changed(jax.tree.map(np.zeros_like, updates), updates)
  trains = {"dense_warmup": lambda k: "'indexer'" in k, "sparse": lambda k: True,
            "none": lambda k: "'indexer'" not in k}[stage]
  assert any("'indexer'" in k for k in moved) and any("'indexer'" not in k for k in moved)
  assert moved == {k: trains(k) for k in moved}, [k for k, v in moved.items() if v != trains(k)]


def test_sparse_stage_indexer_learns_only_from_its_kl_and_the_model_only_from_lm(tmp_path):
  cfg = small(tmp_path, indexer_training_stage="sparse", warmup_steps=0)
  _, _, _, (graphdef, params, buffers, batch) = _one_step(cfg)

  def part(name):
    def f(p):
      _, (m, _) = train.lm_loss_fn(cfg, graphdef, p, buffers, batch)
      return m[name]
    return jax.jit(jax.grad(f))(params)

  g_lm, g_idx = part("lm_loss"), part("indexer_loss")

  def norms(g, want_indexer):
    return [float(jnp.abs(x).max()) for p, x in jax.tree_util.tree_leaves_with_path(g)
            if ("'indexer'" in jax.tree_util.keystr(p)) == want_indexer]

  assert max(norms(g_lm, True)) == 0.0          # LM loss sends nothing into the indexer
  assert max(norms(g_idx, False)) == 0.0        # L_I sends nothing into the main model
  assert max(norms(g_idx, True)) > 0.0 and max(norms(g_lm, False)) > 0.0


def test_stage_none_leaves_the_indexer_untouched(tmp_path):
  before, after, _, _ = _one_step(small(tmp_path, warmup_steps=0, indexer_training_stage="none"))
  changed = _changed(before, after)
  assert not any(v for k, v in changed.items() if "'indexer'" in k)
  assert any(v for k, v in changed.items() if "'indexer'" not in k)


def test_non_finite_loss_stops_and_sets_aside_the_checkpoint_that_gave_it(tmp_path, monkeypatch):
  cfg = small(tmp_path, steps=6, enable_checkpointing=True, checkpoint_period=1, async_checkpointing=False)
  orig = train.make_train_step

  def poisoned(config, graphdef, tx, loss_fn=None):
    step = orig(config, graphdef, tx, loss_fn)

    def s(state, batch):  # step 3 (from the parameters of step 2) has a NaN loss
      new, m = step(state, batch)
      bad = state["step"] >= 2
      return new, dict(m, loss=jnp.where(bad, jnp.nan, m["loss"]), finite=jnp.where(bad, False, m["finite"]))
    return s

  monkeypatch.setattr(train, "make_train_step", poisoned)
  with pytest.raises(train.TrainingError, match="step 3: loss nan.*checkpoint step 2 gives this loss.*"
                                                "newest good checkpoint: step 1"):
    train.train(cfg)
  steps = sorted(int(d) for d in os.listdir(cfg.checkpoint_dir) if d.isdigit())
  assert steps == [1]
  assert os.listdir(os.path.join(cfg.run_dir, "checkpoints_unusable")) == ["2"]


def _losses(out: str) -> dict[int, str]:
  return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ \| loss (\S+)", out)}


def test_a_file_dataset_trains(tmp_path):
  cfg = small(tmp_path, steps=12, dataset_type="file", dataset_path=os.path.join(DATA, "corpus.txt"),
              tokenizer_path=os.path.join(DATA, "tokenizer.model"), tokenizer_type="sentencepiece")
  last = train.train(cfg)
  assert np.isfinite(last["loss"]) and last["lm_loss"] < np.log(cfg.vocab_size)


@pytest.mark.parametrize("flag", ["indexer_use_approx_top_k=true", "indexer_mask_exact_topk=false", None])
def test_the_seed_flags_select_as_documented_and_the_main_command_runs(tmp_path, monkeypatch, capsys, flag):
  argv = ["train.py", "base.yml", "steps=2", "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false",
          f"base_output_directory={tmp_path}", *([flag] if flag else [])]
  if flag == "indexer_use_approx_top_k=true":  # the README's command, through train.main (the others: its config)
    configs = []
    monkeypatch.setattr(train, "train", lambda config, run=train.train: configs.append(config) or run(config))
    train.main(argv)
    assert sorted(_losses(capsys.readouterr().out)) == [1, 2]
    cfg, = configs
  else:
    cfg = pyconfig.initialize(argv)
  # The selection the run's config makes, on causal scores with many ties (one decimal).
  k, s = cfg.indexer_topk, cfg.max_target_length
  rng = np.random.default_rng(0)
  scores = np.where(np.tri(s, dtype=bool), np.round(rng.standard_normal((2, s, s)), 1), -np.inf).astype(np.float32)
  mask = np.asarray(jax.jit(indexer_lib.Indexer(cfg, rngs=nnx.Rngs(0)).select)(jnp.asarray(scores)))
  exact = np.asarray(selection.generate_mask_reference(jax.lax.top_k(scores, k)[1], s)) & np.isfinite(scores)
  assert (exact.sum(-1) == np.minimum(np.arange(1, s + 1), k)).all()  # lax.top_k's set, ties lowest first
  if flag is None:
    np.testing.assert_array_equal(mask, exact)
  elif flag.startswith("indexer_use_approx_top_k"):  # min(k, valid) keys, not always lax.top_k's
    np.testing.assert_array_equal(mask.sum(-1), exact.sum(-1))
    assert (mask != exact).any()
  else:  # the raw cutoff: every key tied at the k-th score too
    kth = np.sort(scores, -1)[..., -k:-k + 1]  # [b,t,1]
    np.testing.assert_array_equal(mask, np.isfinite(scores) & (scores >= kth))
    assert (mask.sum(-1) > k).any()


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
  cfg1 = small(tmp_path, warmup_steps=0, global_batch_size=8)
  cfg2 = small(tmp_path, warmup_steps=0, global_batch_size=8, gradient_accumulation_steps=2)
  # Without the accumulation the metrics of one step are the mean over the 8 sequences; with it,
  # the mean of two 4-sequence means: equal when every micro-batch has the same token count.
  outs = []
  for cfg in (cfg1, cfg2):
    _, after, metrics, _ = _one_step(cfg)
    outs.append((after, metrics))
  (a1, m1), (a2, m2) = outs
  assert float(m1["lm_loss"]) == pytest.approx(float(m2["lm_loss"]), rel=1e-5)
  for x, y in zip(jax.tree.leaves(a1), jax.tree.leaves(a2)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-5)  # Adam step 1 is ~lr*sign(g): tiny g differ
