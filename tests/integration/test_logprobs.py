"""The engine's logprobs (MaxText/inference/logprobs.py): a request's prompt logprobs and its sampled
tokens' logprobs equal the teacher-forced model's log-softmax on the same weights (f32, within 1e-4),
also when its prompt's prefix pages are cached by an earlier request, and on a mesh (data 2 x expert 4,
at the default matmul precision); the top N are the N largest; a step without a row asking runs the
plain program (no logprob program is even compiled); each of the step's variants (plain, logprobs, rollout,
both) is one compiled program of a shape, sampling the same tokens."""

import jax
import numpy as np
import pytest

from MaxText.checkpoint import model_state
from MaxText.inference import step_feed
from MaxText.inference.scheduler import RequestError, SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from tests.conftest import make_config

# as tests/integration/test_serving.py: top-k 8 of up to 40 keys (the selection matters), pages of 8
BASE = dict(max_target_length=40, max_prefill_length=24, indexer_topk=8, param_init_std=0.2, mtp_num_layers=0,
            serve_page_size=8, serve_max_num_seqs=4, serve_max_num_tokens=24, prefill_chunk_size=8)
SYSTEM = [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # one full page and a half


@pytest.fixture(scope="module")
def engine():
  cfg = make_config(**BASE, serve_width_buckets=1, serve_context_buckets=1)  # few step shapes: few compiles
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  fwd = jax.jit(lambda p, b, t: model_state.merge(graphdef, p, b)(t)[0])  # teacher-forced logits [1,T,V]
  return ServingEngine(cfg, graphdef, params, buffers, eos_id=-1), lambda seq: np.asarray(
      jax.nn.log_softmax(fwd(params, buffers, np.asarray([seq], np.int32))[0], axis=-1))  # [T,V]


def test_prompt_and_sampled_logprobs_equal_the_teacher_forced_log_softmax_through_the_prefix_cache(engine):
  """Sampled at temperature 2 and top_k 3: the logprobs are still the model's own (before temperature)."""
  eng, teacher = engine
  (first,) = eng.generate([SYSTEM + [30, 31]], SamplingParams(max_tokens=2))  # caches SYSTEM's first page
  assert first.logprobs == {} and eng.step_programs() == 3  # no row asked: plain programs only (start, prefill, decode)
  prompt, n = SYSTEM + [40, 41, 42], 5
  asks = SamplingParams(max_tokens=4, logprobs=n, prompt_logprobs=n, temperature=2.0, top_k=3, seed=3)
  r, other = eng.generate([prompt, SYSTEM + [50]], [asks, SamplingParams(max_tokens=4)])
  assert eng.allocator.hits > 0  # the second prompt shared the cached page: the first still recomputed it
  seq = prompt + r.output
  want = teacher(seq)  # [T,V]: row p - 1 predicts token p
  assert sorted(r.logprobs) == list(range(1, len(seq)))  # every prompt position from 1, every sampled token
  assert other.logprobs == {}
  for p, (lp, rank, top) in r.logprobs.items():
    np.testing.assert_allclose(lp, want[p - 1, seq[p]], atol=1e-4, err_msg=f"position {p}")
    above = lambda x: 1 + np.sum(want[p - 1] > want[p - 1, seq[p]] + x)  # noqa: E731 (ties within 1e-4 either way)
    assert above(1e-4) <= rank <= above(-1e-4), p
    ids, vals = zip(*top)
    np.testing.assert_allclose(vals, np.sort(want[p - 1])[::-1][:n], atol=1e-4, err_msg=f"top at {p}")
    assert set(ids) == set(np.argsort(-want[p - 1])[:n].tolist()), p


def test_each_step_variant_is_one_compiled_program_and_samples_the_same_tokens(engine):
  """The one step with its two static flags: at one shape, the plain program and three more (logprobs, rollout,
  both), none compiled again; each returns only what it was asked for; greedy padding rows draw the same."""
  eng, _ = engine
  t = eng.widths[-1]  # a prefill width: the row's last known token is not position 0
  feed = step_feed.empty(4, t, eng.pages_per_seq)  # 4 padding rows (no other test's shape): writes dropped
  feed["tokens"][:] = np.arange(4 * t).reshape(4, t) % 50 + 3
  feed["positions"][:] = np.arange(t)
  feed["last"][:] = [t - 1, 2, 5, 0]
  variants = [(False, False), (True, False), (False, True), (True, True)]
  eng.pools, plain, _ = eng.run(t, feed)
  before = eng.step_programs()
  for with_logprobs, with_rollout in variants * 2:
    eng.pools, sampled, (lps, records) = eng.run(t, feed, with_logprobs, with_rollout)
    assert (lps is not None) == with_logprobs and (records is not None) == with_rollout
    np.testing.assert_array_equal(sampled, plain)
  assert eng.step_programs() == before + 3


def test_logprobs_on_a_data_x_expert_mesh_equal_the_teacher_forced_log_softmax_also_from_cached_pages():
  """8 page shards, one MoE layer (its experts over the all-to-all), default precision: a request sharing a cached page
  (logprobs only: it reads the page where it lies) and one recomputing it (prompt_logprobs). Every step
  is a prefill of one width and max_tokens=1: one logprob step program and one write compile."""
  cfg = make_config(**{**BASE, "serve_max_num_seqs": 8}, num_devices=8, ici_data_parallelism=2, ici_expert_parallelism=4,
                    num_decoder_layers=1, first_num_dense_layers=0, serve_width_buckets=1, serve_context_buckets=1)
  mesh = sharding.create_mesh(cfg)
  with jax.set_mesh(mesh), sharding.logical_rules(cfg, mesh):
    graphdef, params, buffers, _ = model_state.create(cfg, mesh)
    eng = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1)
    one = SamplingParams(max_tokens=1, logprobs=3)
    eng.generate([SYSTEM + [30, 31]], one)  # caches SYSTEM's first page
    shared, recomputed = eng.generate([SYSTEM + [40, 41], SYSTEM + [50, 51, 52]],
                                      [one, SamplingParams(max_tokens=1, logprobs=3, prompt_logprobs=3)])
    assert eng.allocator.hits > 0
    fwd = jax.jit(lambda p, b, t: jax.nn.log_softmax(model_state.merge(graphdef, p, b)(t)[0][0], axis=-1))  # [T,V]
    for r, want_positions in ((shared, [len(shared.prompt)]), (recomputed, range(1, len(recomputed.prompt) + 1))):
      seq = r.prompt + r.output
      want = np.asarray(fwd(params, buffers, np.asarray([seq + [0] * (24 - len(seq))], np.int32)))  # causal: pad at the end
      assert sorted(r.logprobs) == list(want_positions)
      for p, (lp, _, top) in r.logprobs.items():
        np.testing.assert_allclose(lp, want[p - 1, seq[p]], atol=1e-4, err_msg=f"position {p}")
        np.testing.assert_allclose([v for _, v in top], np.sort(want[p - 1])[::-1][:3], atol=1e-4, err_msg=f"top {p}")


def test_logprobs_past_serve_max_logprobs_are_refused_naming_the_field(engine):
  eng, _ = engine
  with pytest.raises(RequestError, match="serve_max_logprobs") as e:
    eng.add_request([1, 2], SamplingParams(prompt_logprobs=21))
  assert e.value.field == "prompt_logprobs"
