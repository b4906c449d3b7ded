"""Sharded runs on 8 simulated CPU devices equal the single-device run: context parallelism
(cp = 2, 4, 8; with and without zig-zag load balancing; exact and approximate selection; both
mask modes), fsdp, context and tensor sharding on one mesh; and the per-device memory of
the indexer scores scales as t*s/cp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import train
from MaxText.checkpoint import model_state
from MaxText.layers.indexer import Indexer  # noqa: F401  (the module under test, via the model)
from MaxText.runtime import sharding
from tests.support.sharded import T, assert_same, run_loss_and_grads, small_config

_config, _run, _assert_same = small_config, run_loss_and_grads, assert_same


@pytest.fixture(scope="module")
def reference():
  cache = {}

  def get(**kw):
    key = tuple(sorted(kw.items()))
    if key not in cache:
      cache[key] = _run(_config(num_devices=1, ici_data_parallelism=1, **kw))
    return cache[key]
  return get


@pytest.mark.parametrize("cp,balance", [(8, True), (4, False)])  # 2-way: the fsdp x context x tensor test
def test_context_parallel_equals_single_device(cp, balance, reference):
  got = _run(_config(num_devices=cp, ici_data_parallelism=1, ici_context_parallelism=cp,
                     context_parallel_load_balance=balance))
  _assert_same(got, reference())


def _tied_index_scores(params):
  """Every indexer key kernel (wk) zeroed: each key's normalized index key is then 0 (LayerNorm
  bias 0), every valid key scores exactly 0, and each query's top-k is one big tie at the k-th
  score, broken by position: lowest ORIGINAL position first."""
  def edit(path, x):
    names = [getattr(k, "key", None) for k in path]
    return x * 0 if "indexer" in names and "wk" in names else x
  return jax.tree_util.tree_map_with_path(edit, params)


@pytest.mark.parametrize("cp,impl", [(8, "mask"), (8, "gather")])
def test_ties_break_by_original_position_under_load_balancing(cp, impl):
  # With k = 8 > T/(2cp) (zig-zag chunks of 2), the first 8 keys in zig-zag order are not
  # positions 0..7: breaking the tie by the permuted index would select other keys, and the
  # loss and gradients would differ from the single-device run. The sparse stage trains the
  # indexer through L_I over the selected set, so its gradients see the selection too.
  flags = dict(indexer_training_stage="sparse", sparse_attention_impl=impl, sparse_attention_query_block=8)
  want = _run(_config(num_devices=1, ici_data_parallelism=1, **flags), _tied_index_scores)
  got = _run(_config(num_devices=cp, ici_data_parallelism=1, ici_context_parallelism=cp,
                     context_parallel_load_balance=True, **flags), _tied_index_scores)
  _assert_same(got, want)


@pytest.mark.parametrize("flags", [dict(indexer_use_approx_top_k=True), dict(indexer_mask_exact_topk=False),
                                   dict(indexer_training_stage="sparse")])
def test_context_parallel_keeps_every_selection_mode(flags, reference):
  got = _run(_config(num_devices=4, ici_data_parallelism=1, ici_context_parallelism=4, **flags))
  _assert_same(got, reference(**flags))


def test_fsdp_context_and_tensor_sharding_together_equal_single_device(reference):
  # One mixed mesh shards parameters over fsdp and tensor and the sequence over context at once
  # (expert meshes: test_expert_parallel.py).
  mesh = dict(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
  got = _run(_config(num_devices=8, ici_data_parallelism=1, **mesh))
  _assert_same(got, reference())


def test_parameters_are_sharded_by_the_rules():
  cfg = _config(num_devices=8, ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_tensor_parallelism=2,
                ici_expert_parallelism=2)
  mesh = sharding.create_mesh(cfg)
  _, params, _, _ = model_state.create(cfg, mesh)
  wi = params["moe_layers"]["layers"]["mlp"]["wi_0"]  # [L,E,D,I]: layers, exp, embed, mlp
  assert wi.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
  wq_b = params["dense_layers"]["layers"]["attention"]["wq_b"]["kernel"]  # [L,q_lora,h*qk]
  assert wq_b.sharding.spec[-1] == "tensor"


def _indexer_scores_bytes(cp: int, t: int) -> int:
  """Per-device temp bytes of one indexer scoring + selection under context parallelism cp."""
  cfg = _config(num_devices=cp, ici_data_parallelism=1, ici_context_parallelism=cp, max_target_length=t,
                global_batch_size=1)
  from flax import nnx

  from MaxText.kernels.masks import attention_validity
  mesh = sharding.create_mesh(cfg)
  with mesh, sharding.logical_rules(cfg, mesh):
    idx = nnx.eval_shape(lambda: Indexer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(idx)

    def f(state, x, q_lat, pos):
      m = nnx.merge(graphdef, state)
      valid = attention_validity(pos, sharding.gather_sequence(pos, cfg, names=("activation_batch", None)))
      scores = m(x, q_lat, pos, valid)
      return m.select(scores)

    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
    args = (jax.ShapeDtypeStruct((1, t, cfg.emb_dim), jnp.float32, sharding=spec),
            jax.ShapeDtypeStruct((1, t, cfg.q_lora_rank), jnp.float32, sharding=spec),
            jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=spec))
    compiled = jax.jit(f).lower(state, *args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_indexer_score_memory_per_device_scales_as_t_s_over_cp():
  t = 1024
  sizes = {cp: _indexer_scores_bytes(cp, t) for cp in (1, 2, 4, 8)}
  scores_bytes = t * t * 4  # one fp32 [t, s] score matrix on one device
  assert sizes[1] >= scores_bytes
  for cp in (2, 4, 8):
    # Within 35% of an exact 1/cp share (small replicated buffers do not scale).
    assert sizes[cp] <= 1.35 * sizes[1] / cp, sizes


def test_the_training_loop_runs_context_parallel_with_the_same_losses(tmp_path):
  common = dict(steps=2, log_period=1, enable_checkpointing=False, enable_tensorboard=False,
                base_output_directory=str(tmp_path), warmup_steps=0)
  single = train.train(_config(num_devices=1, ici_data_parallelism=1, **common))
  sharded = train.train(_config(num_devices=8, ici_data_parallelism=1, ici_fsdp_parallelism=2,
                                ici_context_parallelism=4, **common))
  assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-5)
  assert sharded["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


def _serving_prefill(cp: int, chunk: int, prompts=None):
  """The serving engine on a cp-way context mesh: (greedy tokens of `prompts` served together, the
  pools after them) (None: nothing run), and the compiled prefill step's (per-device flops, temp
  bytes) for one row of `chunk` tokens."""
  from MaxText.inference.scheduler import SamplingParams
  from MaxText.inference.serving import ServingEngine
  cfg = _config(num_devices=cp, ici_data_parallelism=1, ici_context_parallelism=cp, mtp_num_layers=0,
                max_target_length=2 * chunk, max_prefill_length=2 * chunk, prefill_chunk_size=chunk,
                param_init_std=0.2, serve_page_size=8, serve_max_num_seqs=2, serve_max_num_tokens=2 * chunk)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    assert eng.chunk == chunk
    compiled = eng.compile_step(1, chunk)[0]  # one row of one chunk over the whole page table
    cost = (compiled.cost_analysis()["flops"], compiled.memory_analysis().temp_size_in_bytes)
    if prompts is None:
      return None, cost
    out = eng.generate(prompts, SamplingParams(max_tokens=4))
    return ([r.output for r in out], jax.tree.map(np.asarray, eng.pools)), cost


def test_serving_prefill_is_context_parallel():
  # Prefill chunks shard their queries over `context` (indexer scores [b, C/cp, S] per device; the
  # latent pools are replicated); a decode step (t = 1) runs replicated. Tokens and pools equal one
  # device's.
  prompts = [list(range(3, 3 + 2 * T - 5)), list(range(7, 7 + T // 2))]  # ragged, over two chunks
  (want, (flops1, temp1)) = _serving_prefill(1, T, prompts)
  cp = 4  # cp = 2 is covered by the forward equality tests above
  got, (flops, temp) = _serving_prefill(cp, T, prompts)
  assert got[0] == want[0]
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert flops < 1.5 * flops1 / cp, (cp, flops, flops1)  # each device works on its own C/cp queries
  # per-device memory of a long chunk (scores dominate) shrinks as 1/cp
  temps = {cp: _serving_prefill(cp, 256)[1][1] for cp in (1, 4)}
  assert temps[4] <= 1.35 * temps[1] / 4, temps


GATHER = dict(indexer_training_stage="sparse", sparse_attention_impl="gather", sparse_attention_query_block=8)
MIXED = dict(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)


def test_the_gather_path_on_fsdp_context_and_tensor_equals_single_device(reference):
  got = _run(_config(num_devices=8, ici_data_parallelism=1, **MIXED, **GATHER))
  _assert_same(got, reference(**GATHER))


def test_the_gather_paths_backward_sums_heads_and_queries_after_its_scatter_add():
  """Its keys' cotangent is all-reduced as [b,s,e] once a block, not as the gathered rows' [k,e] (a query, the CPU's
  loop) or [B*k,e] (a block, vmapped) where the head contraction makes it: those are topk / B*topk x larger."""
  import re

  from MaxText import train_compile
  cfg = _config(num_devices=8, ici_data_parallelism=1, **MIXED, **GATHER, indexer_topk=6)  # no shape like s = 32
  hlo = train_compile.compile_train_step(cfg)[0].as_text()
  e, k, blk = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.indexer_topk, cfg.sparse_attention_query_block
  gathered = {(k, e), (blk * k, e), (blk // 2 * k, e), (blk, k, e), (blk // 2, k, e)}  # a query's, a block's rows
  shapes = [tuple(int(v) for v in dims.split(",") if v) for line in hlo.splitlines()
            if re.search(r"\sall-reduce(-start)?\(", line)
            for dims in re.findall(r"\[([\d,]*)\]", line.split("=", 1)[1].split(" all-reduce")[0])]
  assert shapes and (2, T, e) in shapes, shapes  # dkv [b,s,e]: the one sum, after the scatter-add
  assert not [s for s in shapes if s[-2:] in gathered or s[-3:] in gathered], shapes
