"""MTP speculative decoding in the serving engine (inference/step_spec.py, serve_speculative_tokens):
greedy outputs with 1 or 2 drafts a step equal those without (ragged, staggered, shared prefixes,
preempted, fp8); drafts that are right are all accepted and a stop token or max_tokens inside an
accepted run ends the request there; the MTP drafts from the right position (the model's own
uncached MTP logits); rejection sampling keeps the target's distribution; no page leaks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.checkpoint import model_state
from MaxText.config.types import ConfigError
from MaxText.inference.model_step import mtp_absorbed_weights
from MaxText.inference.sampling import verify_drafts
from MaxText.inference.scheduler import SamplingParams
from MaxText.inference.serving import ServingEngine
from MaxText.runtime import sharding
from tests.conftest import make_config
from tests.support.serving import BASE as SERVING
from tests.support.serving import NEW, PROMPTS

BASE = {**SERVING, "mtp_num_layers": 1}  # test_serving's tiny engine, with an MTP module to draft


@pytest.fixture(scope="module")
def model():
  cfg = make_config(**BASE)
  graphdef, params, buffers, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  plain = ServingEngine(cfg, graphdef, params, buffers, eos_id=-1).generate(PROMPTS, SamplingParams(max_tokens=NEW))
  return graphdef, params, buffers, [r.output for r in plain]


_ENGINES = {}


def _engine(model, **overrides) -> ServingEngine:
  """One engine per config for the module (reset: empty pools, its compiled programs kept)."""
  key = (id(model[1]), tuple(sorted(overrides.items())))
  if key not in _ENGINES:
    graphdef, p, b, _ = model
    _ENGINES[key] = ServingEngine(make_config(**{**BASE, **overrides}), graphdef, p, b, eos_id=-1)
  _ENGINES[key].reset()
  return _ENGINES[key]


def _serve(model, k, arrivals, oracle=None, params=None, **overrides):
  """arrivals {step: [prompt index, ...]} -> (engine, requests by prompt index). oracle(i, request):
  drafts to put in place of the MTP's after each step (a test's stand-in for a well-trained MTP)."""
  eng = _engine(model, serve_speculative_tokens=k, **overrides)
  requests, step = {}, 0
  while step < 500 and (step <= max(arrivals) or not eng.idle):
    for i in arrivals.get(step, []):
      requests[i] = eng.add_request(PROMPTS[i], params or SamplingParams(max_tokens=NEW))
    eng.step()
    if oracle is not None:
      for i, r in requests.items():
        if r.drafts:
          r.drafts = oracle(i, r)
    step += 1
  assert eng.idle, "requests stuck"
  eng.allocator.check()
  assert eng.allocator.used_pages == 0  # no page leaks: every page free or cached
  return eng, requests


def test_greedy_output_with_drafts_equals_without(model):
  # k = 2 drafts a step (k = 1: test_serving_mesh's speculative test, and the tests below)
  eng, got = _serve(model, 2, {0: [0, 1, 2], 2: [3], 3: [4, 5]})
  assert [got[i].output for i in range(len(PROMPTS))] == model[3]
  s = eng.stats()
  assert s["spec_drafted"] > 0 and 0 <= s["spec_accepted"] <= s["spec_drafted"]
  assert s["spec_acceptance"] == s["spec_accepted"] / s["spec_drafted"]


def test_preemption_in_a_tight_pool_with_the_fp8_cache_keeps_the_outputs(model):
  want = [r.output for r in _engine(model, kv_cache_dtype="fp8").generate(PROMPTS, SamplingParams(max_tokens=NEW))]
  eng, got = _serve(model, 1, {0: [0, 1, 2, 3, 4, 5]}, serve_num_pages=7, serve_prefix_caching=False,
                    kv_cache_dtype="fp8")
  assert sum(r.preemptions for r in eng.scheduler.finished) > 0
  assert [got[i].output for i in range(len(PROMPTS))] == want


def test_right_drafts_are_all_accepted_and_a_stop_inside_a_run_ends_there(model):
  want = model[3]
  truth = lambda i, r: want[i][len(r.output):len(r.output) + 2]  # noqa: E731  the true next tokens
  eng, got = _serve(model, 2, {0: [0, 1, 3], 1: [4]}, oracle=truth)
  assert [got[i].output for i in (0, 1, 3, 4)] == [want[i] for i in (0, 1, 3, 4)]
  s = eng.stats()
  assert s["spec_accepted"] == s["spec_drafted"] > 0 and s["spec_acceptance"] == 1.0
  assert eng.steps < 10  # ~3 tokens a step after the prefill, not one

  wrong = lambda tok: (tok + 1) % 512  # noqa: E731
  half = lambda i, r: ([want[i][len(r.output)], wrong(want[i][len(r.output) + 1])]  # noqa: E731
                       if len(r.output) <= NEW - 3 else [])
  eng, got = _serve(model, 2, {0: [1]}, oracle=half)  # the first draft right, the second wrong
  assert got[1].output == want[1] and eng.stats()["spec_accepted"] * 2 == eng.stats()["spec_drafted"]

  stop = want[1][2]  # a stop token that an accepted run reaches: the output ends before it
  eng, got = _serve(model, 2, {0: [1]}, oracle=truth, params=SamplingParams(max_tokens=NEW, stop_token_ids=(stop,)))
  assert got[1].output == want[1][:want[1].index(stop)] and got[1].finish_reason == "stop"
  eng, got = _serve(model, 2, {0: [1]}, oracle=truth, params=SamplingParams(max_tokens=4))
  assert got[1].output == want[1][:4] and got[1].finish_reason == "length"  # never past max_tokens


def test_the_mtp_drafts_from_the_last_token_as_the_models_own_mtp(model):
  """Each first draft is the argmax of the uncached model's MTP logits at position L-2 (h of
  token L-2 and the embedding of token L-1 predict token L): one position off either way differs."""
  graphdef, p, b, _ = model
  forward = jax.jit(lambda p, b, x: nnx.merge(graphdef, p, b)(x)[1]["mtp_logits"][0, 0])  # [S,V]
  eng = _engine(model, serve_speculative_tokens=1)
  requests = [eng.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW)) for i in (0, 1, 3)]
  drafted = []  # (request, sequence length, first draft)
  while not eng.idle:
    eng.step()
    drafted += [(r, len(r.tokens), r.drafts[0]) for r in requests if r.drafts]
  mtp = {}
  for r in requests:  # the model's own MTP over the whole final sequence (causal: each prefix as it was)
    logits = forward(p, b, jnp.asarray([r.tokens + [0] * (BASE["max_target_length"] - len(r.tokens))]))
    mtp[id(r)] = np.asarray(jnp.argmax(logits, axis=-1))  # [S]: position i predicts token i+2
  assert len(drafted) >= 10
  assert all(d == mtp[id(r)][n - 2] for r, n, d in drafted), [(n, d, mtp[id(r)][n - 3:n]) for r, n, d in drafted]
  assert sum(d != mtp[id(r)][n - 3] for r, n, d in drafted) >= len(drafted) // 2  # one position off differs


def test_rejection_sampling_keeps_the_target_distribution():
  """Drafts drawn from q, verified against p: the first emitted token is distributed as p[0], the
  second (after an accepted first) as p[1]; a greedy p accepts exactly its argmax."""
  v, n = 5, 60000
  p = jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.05, 0.1, 0.3, 0.5], [0.2] * 5])  # [k+1=3,V]
  q = jnp.asarray([[0.1, 0.5, 0.1, 0.2, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])  # [k=2,V]
  key = jax.random.key(0)
  drafts = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(q), shape=(n, 2)).astype(jnp.int32)
  keys = jax.random.split(jax.random.fold_in(key, 2), n * 3).reshape(n, 3)
  out, acc = verify_drafts(jnp.broadcast_to(p, (n, 3, v)), jnp.broadcast_to(q, (n, 2, v)), drafts,
                           jnp.full((n,), 2, jnp.int32), keys)
  out, acc = np.asarray(out), np.asarray(acc)
  assert np.abs(np.bincount(out[:, 0], minlength=v) / n - np.asarray(p[0])).max() < 0.01
  second = out[acc >= 1, 1]
  assert np.abs(np.bincount(second, minlength=v) / len(second) - np.asarray(p[1])).max() < 0.015
  assert np.all(out[acc == 2, :2] == np.asarray(drafts)[acc == 2])
  # the acceptance rate is sum_x min(p, q) per position (the first): the test sees the real rule
  assert abs((acc >= 1).mean() - float(jnp.minimum(p[0], q[0]).sum())) < 0.01
  one_hot = jax.nn.one_hot(jnp.asarray([[2, 4]]), v)  # greedy: p and q one-hot
  out, acc = verify_drafts(jax.nn.one_hot(jnp.asarray([[2, 3, 1]]), v), one_hot, jnp.asarray([[2, 4]]),
                           jnp.asarray([2]), keys[:1])
  assert int(acc[0]) == 1 and out[0, :2].tolist() == [2, 3]


def test_speculation_needs_an_mtp_module_and_a_sampled_request_keeps_its_seed(model):
  with pytest.raises(ConfigError, match="serve_speculative_tokens=1 needs mtp_num_layers >= 1"):
    make_config(**{**BASE, "mtp_num_layers": 0, "serve_speculative_tokens": 1})
  sampled = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=7)
  alone = _engine(model, serve_speculative_tokens=2).generate([PROMPTS[1]], sampled)[0].output
  crowd = _engine(model, serve_speculative_tokens=2).generate(
      [PROMPTS[0], PROMPTS[1], PROMPTS[3]], [SamplingParams(max_tokens=NEW), sampled,
                                             SamplingParams(max_tokens=NEW, temperature=0.7, seed=3)])
  assert crowd[1].output == alone and len(alone) == NEW
  assert crowd[0].output == model[3][0]  # the greedy neighbour is unaffected


def test_a_constrained_row_drafts_nothing_and_keeps_its_grammar_beside_a_drafting_one(model):
  """Drafting is off for a row with a grammar (step_spec.py): each of its tokens is drawn under the mask."""
  import os

  from MaxText.data.tokenizer import load_tokenizer
  from MaxText.inference.grammar import Grammars, GrammarSpec
  from tests.conftest import REPO_ROOT
  tok = load_tokenizer(make_config(tokenizer_type="hf", tokenizer_path=os.path.join(REPO_ROOT, "tests/data/tokenizer.json")))
  eng = _engine(model, serve_speculative_tokens=1)
  eng.grammars = Grammars.for_tokenizer(tok, 512)
  choice = SamplingParams(max_tokens=NEW, temperature=1.0, seed=3, grammar=GrammarSpec("choice", '["yes", "no"]'))
  free, constrained = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW)), eng.add_request(PROMPTS[1], choice)
  while not eng.idle:
    eng.step()
    assert constrained.drafts == []
  eng.grammars = None
  assert free.output == model[3][0] and eng.stats()["spec_drafted"] > 0  # the free row drafted, unchanged
  assert constrained.finish_reason == "stop" and tok.decode(constrained.output) in ("yes", "no")


def test_load_weights_serves_other_weights_without_recompiling(model):
  """ServingEngine.load_weights swaps in another set of the model's weights (the target's and the MTP
  layer's absorbed weights recomputed): the speculative engine then gives what a plain engine built
  on those weights gives, and back again; compiled programs are kept; another tree fails."""
  graphdef, p, b, want = model
  cfg = make_config(**{**BASE, "seed": 1})
  _, p2, b2, _ = model_state.create(cfg, sharding.create_mesh(cfg))
  other = [r.output for r in ServingEngine(cfg, graphdef, p2, b2, eos_id=-1).generate(
      PROMPTS[:3], SamplingParams(max_tokens=NEW))]
  assert other != want[:3]
  eng = _engine(model, serve_speculative_tokens=1)
  eng.load_weights(p2, b2)
  assert [r.output for r in eng.generate(PROMPTS[:3], SamplingParams(max_tokens=NEW))] == other
  compiled = eng.spec._jit._cache_size()
  mtp = jax.jit(lambda p, b: mtp_absorbed_weights(nnx.merge(graphdef, p, b)))(p2, b2)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(eng.spec.absorbed), jax.tree.leaves(mtp)))
  eng.load_weights(p, b)
  assert [r.output for r in eng.generate(PROMPTS[:3], SamplingParams(max_tokens=NEW))] == want[:3]
  assert eng.spec._jit._cache_size() == compiled  # the same steps again: nothing recompiled
  with pytest.raises(ValueError, match="another tree"):
    eng.load_weights(b, p)


def test_penalties_bias_and_min_tokens_apply_at_every_verified_position_as_without_drafts(model):
  """Greedy rows with repetition, frequency and presence penalties, logit_bias and min_tokens: with 2 drafts a
  step the outputs equal the unspeculated engine's, and drafts that are those outputs are all accepted
  (position j's history holds the drafts before it, its min_tokens count is made + j). Row 2's biased stop
  token is banned for its first 3 tokens and ends it right after, inside a verified run; row 3's two biased
  ids come one after the other only if the second position sees the first's draft penalized. A sampled row
  with min_p and a penalty runs too."""
  adjusted = [SamplingParams(max_tokens=NEW, repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=0.3),
              SamplingParams(max_tokens=NEW, logit_bias=((5, 3.0),), frequency_penalty=-0.5),
              SamplingParams(max_tokens=NEW, min_tokens=3, stop_token_ids=(300,), logit_bias=((300, 10.0),),
                             presence_penalty=0.5),
              SamplingParams(max_tokens=NEW, logit_bias=((20, 8.0), (21, 7.0)), presence_penalty=2.0,
                             repetition_penalty=5.0)]
  want = [r.output for r in _engine(model).generate(PROMPTS[:4], adjusted)]
  assert all(w != model[3][i] for i, w in enumerate(want)), (want, model[3][:4])  # the adjustments bite
  assert len(want[2]) == 3 and want[3][:2] == [20, 21], want
  truth = lambda i, r: want[i][len(r.output):len(r.output) + 2]  # noqa: E731
  for oracle in (None, truth):
    eng = _engine(model, serve_speculative_tokens=2)
    got = [eng.add_request(PROMPTS[i], adjusted[i]) for i in range(4)]
    while not eng.idle:
      eng.step()
      for i, r in enumerate(got):
        r.drafts = oracle(i, r) if oracle and r.drafts else r.drafts
    assert [r.output for r in got] == want
    if oracle is not None:
      s = eng.stats()
      assert s["spec_accepted"] == s["spec_drafted"] > 0
  sampled = SamplingParams(max_tokens=NEW, temperature=1.0, seed=4, min_p=0.3, repetition_penalty=1.3)
  out = _engine(model, serve_speculative_tokens=2).generate([PROMPTS[0]], sampled)[0].output
  assert len(out) == NEW and max(out) < 512
