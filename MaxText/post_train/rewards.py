"""Rewards: plain Python functions on text, one float per completion.

    reward = load_reward(config)            # rl_reward: a built-in name, or module:function
    r = reward(texts, records, wheres)      # float32 [N]

A reward function is `fn(completion: str, record: dict) -> float`: the completion's text (what the
model generated after the prompt: in thinking mode its reasoning, `</think>`, then the reply; the
stop token not included) and the data record the prompt came from (every column of it).
Built-ins (BUILTINS): `exact_match`, 1.0 when the reply's content (chat_dsv32.parse_completion:
the reasoning and tool calls taken out, whitespace stripped) equals str(record[rl_reward_column]),
else 0.0. A function that raises, or returns something that is not a finite number, stops the run
with one line naming rl_reward, the record and the error (RewardError: exit 1).
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Sequence

import numpy as np

from MaxText.config.types import Config, ConfigError
from MaxText.data import chat_dsv32
from MaxText.post_train import prompts
from MaxText.runtime.cli import RunError

RewardFn = Callable[[str, dict], float]


class RewardError(RunError):
  """A reward function that raised or returned a non-number: the message names it and the record."""


def exact_match(column: str, thinking: bool) -> RewardFn:
  """1.0 when the reply's content, stripped, equals str(record[column]), else 0.0. The completion is parsed
  in the mode its prompt was rendered in: the record's own `thinking`, else `thinking` (chat_thinking)."""

  def fn(completion: str, record: dict) -> float:
    if column not in record:
      raise KeyError(f"the record has no '{column}' (rl_reward_column); its fields are {sorted(record)}")
    content = chat_dsv32.parse_completion(completion, thinking=prompts.thinking_of(record, thinking)).content
    return float(content.strip() == str(record[column]).strip())

  return fn


BUILTINS: dict[str, Callable[[Config], RewardFn]] = {
    "exact_match": lambda config: exact_match(config.rl_reward_column, config.chat_thinking),
}
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Reward:
  """A named reward function applied to a batch, with every failure one RewardError line."""

  def __init__(self, name: str, fn: RewardFn):
    self.name, self.fn = name, fn

  def __call__(self, completions: Sequence[str], records: Sequence[dict], wheres: Sequence[str]) -> np.ndarray:
    out = np.empty(len(completions), np.float32)
    for i, (text, record, where) in enumerate(zip(completions, records, wheres)):
      try:
        value = self.fn(text, record)
      except Exception as e:  # the user's code: whatever it raises is one line, not a traceback
        raise RewardError(f"rl_reward={self.name} raised {type(e).__name__}: {e} (record {where}, completion "
                          f"{text[:60]!r})") from None
      if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
          or not math.isfinite(value):
        raise RewardError(f"rl_reward={self.name} returned {value!r} for record {where}: a reward is a finite "
                          "number")
      out[i] = value
    return out


def load_reward(config: Config) -> Reward:
  """rl_reward as a Reward: a BUILTINS name, or module:function importable from the working directory
  (ConfigError naming rl_reward when it is neither, the module does not import or has no such function)."""
  name = config.rl_reward
  if name in BUILTINS:
    return Reward(name, BUILTINS[name](config))
  if not _FUNCTION.match(name):
    raise ConfigError(f"rl_reward={name!r}: a built-in ({', '.join(BUILTINS)}) or module:function "
                      "(e.g. my_rewards:score, a function (completion: str, record: dict) -> float)")
  module_name, fn_name = name.split(":")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:
    raise ConfigError(f"rl_reward={name}: cannot import module '{module_name}' ({type(e).__name__}: {e}); "
                      "run from the folder holding it or put it on PYTHONPATH") from None
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise ConfigError(f"rl_reward={name}: module '{module_name}' has no function '{fn_name}'")
  return Reward(name, fn)
