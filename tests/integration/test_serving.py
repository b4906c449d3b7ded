"""The continuous-batching engine (MaxText/inference/serving.py) over paged caches: greedy outputs of
many concurrent requests (ragged, staggered, sharing prefixes, preempted, fp8 cache) equal each
prompt decoded alone (an engine of one sequence, no prefix cache: no batching, no shared pages);
every page is free afterwards; a seed gives the same tokens whatever shares the batch; a bad request
fails alone. (tests/integration/test_decode.py holds the engine's greedy tokens equal to the
teacher-forced model's argmax.)"""

import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.checkpoint import model_state
from MaxText.inference.scheduler import RequestError, SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.kernels import backend
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.serving import BASE, NEW, PROMPTS


def _alone(graphdef, params, buffers, prompts, **overrides):
  """Each prompt's greedy tokens decoded by itself: one sequence per step, nothing shared."""
  cfg = make_config(**{**BASE, **overrides, "serve_max_num_seqs": 1, "serve_prefix_caching": False})
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  assert eng.buckets() == [1]
  return [eng.generate([p], SamplingParams(max_tokens=NEW))[0].output for p in prompts]


@pytest.fixture(scope="module")
def model():
  cfg = make_config(**BASE)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  return cfg, graphdef, params, buffers, _alone(graphdef, params, buffers, PROMPTS)


def _serve(model, arrivals, **overrides):
  """arrivals {step: [prompt index, ...]} -> (engine, outputs by prompt index)."""
  cfg, graphdef, params, buffers, _ = model
  eng = ServingEngine(make_config(**{**BASE, **overrides}), graphdef, params, buffers, eos_id=-1)
  requests, step = {}, 0
  while step < 500 and (step <= max(arrivals) or not eng.idle):
    for i in arrivals.get(step, []):
      requests[i] = eng.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW))
    eng.step()
    step += 1
  assert eng.idle, "requests stuck"
  eng.allocator.check()
  assert eng.allocator.used_pages == 0  # no page leaks: every page free or cached
  return eng, {i: r.output for i, r in requests.items()}


def test_concurrent_staggered_requests_equal_each_prompt_alone(model):
  eng, got = _serve(model, {0: [0, 1, 2], 2: [3], 3: [4, 5]})
  for i, want in enumerate(model[4]):
    assert got[i] == want, i
  assert eng.allocator.hits > 0  # prompts 2 and 4 reused the system prompt's cached page
  assert all(r.finish_reason == "length" for r in eng.scheduler.finished)


def test_preemption_in_a_tight_pool_and_no_prefix_cache_keep_the_outputs(model):
  eng, got = _serve(model, {0: [0, 1, 2, 3, 4, 5]}, serve_num_pages=7, serve_prefix_caching=False)
  assert sum(r.preemptions for r in eng.scheduler.finished) > 0
  for i, want in enumerate(model[4]):
    assert got[i] == want, i


def test_fp8_cache_equals_each_prompt_alone_over_fp8(model):
  cfg, graphdef, params, buffers, _ = model
  want = _alone(graphdef, params, buffers, [PROMPTS[0], PROMPTS[3]], kv_cache_dtype="fp8")
  _, got = _serve(model, {0: [0, 3]}, kv_cache_dtype="fp8")
  assert [got[0], got[3]] == want
  with backend.forced(rope_storage="rows"):  # the tpu row's k_pe pool: int32 pairs, 8 slots (a page) a row
    eng, got = _serve(model, {0: [0, 3]}, kv_cache_dtype="fp8")
  assert eng.pools["dense_layers"].k_pe.dtype == jnp.int32
  assert [got[0], got[3]] == want


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch_and_a_bad_request_fails_alone(model):
  cfg, graphdef, params, buffers, _ = model
  sampled = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, top_k=20, seed=7)
  alone = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1).generate([PROMPTS[1]], sampled)[0].output
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  with pytest.raises(RequestError) as e:
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW, top_p=1.5))
  assert e.value.field == "top_p"
  with pytest.raises(RequestError) as e:
    eng.add_request([1] * 30, SamplingParams(max_tokens=20))  # past max_target_length
  assert e.value.field == "max_tokens"
  streamed = {0: [], 1: [], 2: []}
  crowd = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                       [SamplingParams(max_tokens=NEW), sampled, SamplingParams(max_tokens=NEW, temperature=0.8)],
                       on_token=lambda i, tok: streamed[i].append(tok))
  assert [streamed[i] for i in range(3)] == [r.output for r in crowd]  # every token reported as it is made
  assert crowd[1].output == alone and len(alone) == NEW
  assert crowd[0].output == model[4][0]  # the greedy neighbour is unaffected
  other_seed = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1).generate(
      [PROMPTS[1]], SamplingParams(**{**sampled.__dict__, "seed": 8}))[0].output
  assert other_seed != alone and np.all(np.asarray(other_seed) < cfg.vocab_size)


def test_logit_bias_and_penalties_steer_a_row_alone_and_new_values_compile_nothing(model):
  cfg, graphdef, params, buffers, alone = model
  eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
  biased = SamplingParams(max_tokens=NEW, logit_bias=((77, 100.0),))
  out = eng.generate([PROMPTS[0], PROMPTS[1]], [biased, SamplingParams(max_tokens=NEW)])
  assert out[0].output == [77] * NEW and out[1].output == alone[1]  # the greedy neighbour is unaffected
  programs = eng.step_programs()
  other = SamplingParams(max_tokens=NEW, logit_bias=((78, 100.0),), presence_penalty=1.5, repetition_penalty=1.2,
                         min_p=0.2, temperature=0.9, seed=3)
  assert eng.generate([PROMPTS[1]], other)[0].output == [78] * NEW
  assert eng.step_programs() == programs  # a request's values are data: no new program
  with pytest.raises(RequestError) as e:
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW, temperature=1.0, min_p=0.1, rollout=True))
  assert e.value.field == "rollout"
