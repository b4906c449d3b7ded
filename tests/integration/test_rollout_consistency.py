"""RL's soundness property (issue 42 item 4): before any update, the trainer's log-prob of every token
the engine sampled for a rollout (post_train/policy_logprobs.token_logprobs, with keep routing and the
sampling mask) equals the engine's recorded one (inference/rollout.py) within 1e-4 in f32, on a data x
expert mesh (`_consistency(1)` is the one-device case; CI runs the mesh, which implies it): 2 prompts
x G = 2 and 4 samples sharing their prompts' pages through the prefix cache (the shared positions'
routing comes from the engine's host copy), rows unfiltered, top_p, top_k and both at temperature 1."""

import jax
import numpy as np
import pytest

from MaxText.checkpoint import model_state
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.post_train.policy_logprobs import rollout_arrays, token_logprobs
from MaxText.runtime import sharding
from tests.conftest import make_config

# sequences (<= 17 tokens) within indexer_topk: the engine's sparse attention is the trainer's dense one;
# one row a step (one device) or 1 per page shard (mesh, 8 rows): few step shapes, so few compiles
BASE = dict(max_target_length=24, max_prefill_length=16, indexer_topk=24, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=4, serve_max_num_seqs=1, serve_max_num_tokens=16, prefill_chunk_size=8,
            num_decoder_layers=3, first_num_dense_layers=1, moe_capacity_factor=-1.0, matmul_precision="highest",
            serve_width_buckets=1, serve_context_buckets=1, remat_policy="none")
PROMPTS = [[1, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 7, 8, 9, 10, 60, 61, 62, 63]]
GROUPS = [2, 4]  # samples per prompt
OPTIONS = [dict(), dict(top_p=0.7), dict(top_k=5), dict(top_p=0.9, top_k=8)]  # at temperature 1
NEW = 4


def rollouts(cfg, mesh):
  """Runs the engine: each prompt's first sample first (its pages get cached), the rest one step after its
  prefill -> (requests, their prompts, engine). Then every row's pi_old from token_logprobs."""
  graphdef, params, buffers, _ = model_state.create(cfg, mesh)
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  params_of = lambda g, i: SamplingParams(max_tokens=NEW, temperature=1.0, seed=100 * g + i, rollout=True,  # noqa: E731
                                          **OPTIONS[(g + i) % len(OPTIONS)])
  requests = [(g, eng.add_request(PROMPTS[g], params_of(g, 0))) for g in range(len(PROMPTS))]
  for _ in range(3):
    eng.step()
  requests += [(g, eng.add_request(PROMPTS[g], params_of(g, i))) for g in range(len(PROMPTS))
               for i in range(1, GROUPS[g])]
  while not eng.idle:
    eng.step()
  return [r for _, r in requests], eng, (graphdef, params, buffers)


def _consistency(num_devices, **mesh_keys):
  cfg = make_config(num_devices=num_devices, **{**BASE, **mesh_keys})
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    requests, eng, (graphdef, params, buffers) = rollouts(cfg, mesh)
    score = jax.jit(lambda p, *a: token_logprobs(model_state.merge(graphdef, p, buffers), *a[:3], temperature=1.0,
                                                 kept=a[3], kept_ids=a[4], routed_experts=a[5]))
    a = rollout_arrays(requests, cfg.max_target_length, cfg.vocab_size, cfg.num_moe_layers, cfg.num_experts_per_tok)
    args = [a[k] for k in ("tokens", "positions", "segment_ids", "kept", "kept_ids", "routed_experts")]
    logp = np.asarray(score(params, *args))  # [N,T]
    other = np.where(args[5] >= 0, (args[5] + 1) % cfg.num_experts, -1)  # other experts: the same program
    moved = np.asarray(score(params, *args[:5], other))  # [N,T]
  assert eng.allocator.hits > 0  # later samples shared their prompt's cached pages
  assert np.abs(moved - logp)[a["generated"]].max() > 1e-3  # the trainer's model takes the routing it is given
  np.testing.assert_array_equal(a["logp_old"][a["generated"]], np.concatenate([r.rollout.logprobs for r in requests]))
  for r in requests:
    ro, p = r.rollout, len(r.prompt)
    assert len(ro.tokens) == len(ro.logprobs) == len(ro.kept) == NEW and ro.tokens == r.output
    assert ro.routed_experts.shape == (p + NEW, cfg.num_moe_layers, cfg.num_experts_per_tok)
    assert (ro.routed_experts[:-1] >= 0).all() and (ro.routed_experts[-1] == -1).all()  # every fed position, shared pages too
    np.testing.assert_allclose(logp[requests.index(r), p:p + NEW], ro.logprobs, atol=1e-4, rtol=0)
  kept = np.concatenate([r.rollout.kept for r in requests])
  assert (kept < cfg.vocab_size).any() and (kept == cfg.vocab_size).any()  # filtered rows and unfiltered ones


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines_on_a_data_x_expert_mesh():
  _consistency(8, ici_data_parallelism=2, ici_expert_parallelism=4, serve_max_num_seqs=8)  # 1 row per page shard
