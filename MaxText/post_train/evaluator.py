"""RL's held-out reward (eval_interval > 0): greedy completions of every eval record, scored by the reward.

    evaluate = Evaluator(config, tokenizer, reward)   # the eval records (eval_dataset_path, grain/hf eval files)
    value = evaluate(engine)                          # mean reward of the engine's greedy completions
"""

from __future__ import annotations

from MaxText.config.types import Config
from MaxText.inference.scheduler import SamplingParams
from MaxText.post_train.prompts import PromptSource


def completion_text(tokenizer, request) -> str:
  """A finished request's completion as the reward reads it: its output tokens decoded."""
  return tokenizer.decode(request.output)


class Evaluator:
  """The held-out reward: greedy completions of every eval record, scored by the reward."""

  def __init__(self, config: Config, tokenizer, reward):
    self.source, self.reward, self.config = PromptSource(config, tokenizer, eval=True), reward, config

  def __call__(self, engine) -> float:
    """engine: an inference.serving.ServingEngine holding the policy's weights -> the mean reward."""
    ids = [self.source.ids(i) for i in range(len(self.source))]
    params = SamplingParams(max_tokens=self.config.rl_max_completion_tokens, temperature=0.0)
    requests = engine.generate(ids, params)
    texts = [completion_text(self.source.tokenizer, r) for r in requests]
    wheres, records = zip(*self.source.records)
    return float(self.reward(texts, list(records), list(wheres)).mean())


__all__ = ["Evaluator", "completion_text"]
