"""The continuous-batching engine (MaxText/inference/serving.py) over paged caches: greedy outputs of
many concurrent requests (ragged, staggered, sharing prefixes, preempted, fp8 cache) equal each
prompt decoded alone by the contiguous engine; every page is free afterwards; a seed gives the same
tokens whatever shares the batch; a bad request fails alone."""

import numpy as np
import pytest

from MaxText.checkpoint import model_state
from MaxText.inference.engine import Engine
from MaxText.inference.scheduler import RequestError, SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from tests.conftest import make_config

# top-k 8 of up to 40 keys: the selection matters; pages of 8 tokens, chunks of 8
BASE = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=24, prefill_chunk_size=8)
SYSTEM = [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # a shared prompt prefix (one full page and a half)
PROMPTS = [SYSTEM + [30, 31], [1, 99, 7], SYSTEM + [40], [5] * 17, SYSTEM + [30, 32, 33], [1, 2]]
NEW = 6


@pytest.fixture(scope="module")
def model():
  cfg = make_config(**BASE)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  alone = [Engine(cfg, graphdef, params, buffers).generate([p], eos_id=None, max_new_tokens=NEW)[0].tokens
           for p in PROMPTS]
  return cfg, graphdef, params, buffers, alone


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


def test_fp8_cache_equals_the_contiguous_fp8_engine(model):
  cfg, graphdef, params, buffers, _ = model
  cfg8 = make_config(**{**BASE, "kv_cache_dtype": "fp8"})
  want = [Engine(cfg8, graphdef, params, buffers).generate([PROMPTS[i]], eos_id=None, max_new_tokens=NEW)[0].tokens
          for i in (0, 3)]
  _, got = _serve(model, {0: [0, 3]}, kv_cache_dtype="fp8")
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
