"""MaxText/inference/logprobs.py on its own (no model; tests/integration/test_logprobs.py holds the values to
the model's): record puts the logits at row position j on the token at position start + j + 1 (the prompt's
next token, or the one just drawn), a prompt position under prompt_logprobs' N and the drawn token under
logprobs' N, nothing past the sequence; step_logprobs' rank counts the strictly more likely ids."""

import types

import jax.numpy as jnp
import numpy as np

from MaxText.inference import logprobs
from MaxText.inference.scheduler import SamplingParams, Scheduled

PROMPT = [5, 6, 7, 8, 9]


def _request(**params):
  return types.SimpleNamespace(prompt=PROMPT, tokens=list(PROMPT), params=SamplingParams(**params), logprobs={})


def _step(b, t, n=3):
  """Host arrays as the logprob step returns them, each value naming its (row, position): tok [b,t] = -(10 i + j)."""
  i, j = np.meshgrid(np.arange(b), np.arange(t), indexing="ij")
  tok = -(10.0 * i + j)
  vals = tok[..., None] - np.arange(n)  # [b,t,n]
  ids = (100 * i + 10 * j)[..., None] + np.arange(n)  # [b,t,n]
  return tok, (j + 1).astype(np.int32), vals, ids


def test_each_logprob_lands_on_the_token_its_position_predicts():
  whole = _request(prompt_logprobs=2, logprobs=1)
  part = _request(prompt_logprobs=0)
  gen_only = _request(logprobs=3)
  rows = [Scheduled(whole, 0, 5), Scheduled(part, 1, 3), Scheduled(gen_only, 0, 5)]
  logprobs.record(rows, [2, 0, 1], *_step(3, 5))
  # whole: positions 1..4 are prompt tokens (top 2), position 5 the token just drawn (top 1); batch row 2
  assert sorted(whole.logprobs) == [1, 2, 3, 4, 5]
  for pos in range(1, 6):
    j = pos - 1  # the row position whose logits predict it
    e = whole.logprobs[pos]
    assert e.logprob == -(20 + j) and e.rank == j + 1, pos
    assert e.top == [(200 + 10 * j + m, -(20 + j) - m) for m in range(2 if pos < 5 else 1)], pos
  # part: a chunk over positions 1..3 (batch row 0) predicts 2..4; its top is empty (N = 0)
  assert {p: (e.logprob, e.top) for p, e in part.logprobs.items()} == {2: (-0.0, []), 3: (-1.0, []), 4: (-2.0, [])}
  # gen_only: no prompt_logprobs, so only the drawn token's position (batch row 1)
  assert list(gen_only.logprobs) == [5] and gen_only.logprobs[5].logprob == -14.0 and len(gen_only.logprobs[5].top) == 3


def test_step_logprobs_rank_and_top_are_the_log_softmax_s():
  logits = jnp.asarray([[[2.0, 1.0, 2.0, 0.0]]])  # [1,1,4]: a tie at the top
  lsm = np.asarray(logits[0, 0]) - np.log(np.exp(np.asarray(logits[0, 0])).sum())
  for nxt, rank in ((0, 1), (2, 1), (1, 3), (3, 4)):  # rank: 1 + the ids strictly more likely
    tok, got_rank, vals, ids = logprobs.step_logprobs(logits, jnp.asarray([[nxt]]), 2)
    assert int(got_rank[0, 0]) == rank and np.isclose(float(tok[0, 0]), lsm[nxt])
  np.testing.assert_allclose(np.asarray(vals[0, 0]), [lsm[0], lsm[2]], rtol=1e-6)
  assert np.asarray(ids[0, 0]).tolist() == [0, 2]  # largest first, ties lowest id first
