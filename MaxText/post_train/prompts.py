"""RL prompts: data records -> prompt token ids, rendered by the chat module SFT and the server use.

    source = PromptSource(config, tokenizer)               # every record of dataset_path (or the eval set)
    batch = source.step(7)                                  # [(where, record, prompt ids)] x rl_prompts_per_step

A record (a jsonl line for dataset_type=file; a row of train_data_columns for grain Parquet / hf; an
ArrayRecord record of UTF-8 JSON) holds `prompt` (a string: one user turn; or a list of messages) or
`messages` (OpenAI messages: the turns up to the last user / developer / tool message are the prompt,
a trailing assistant turn, an SFT set's answer, is left out), plus the columns the reward reads
(exact_match: rl_reward_column), optional `tools` and `thinking` (default chat_thinking, the mode SFT and chat
default to). The prompt is
chat_dsv32.render with the generation prompt (`<｜Assistant｜><think>` in thinking mode).

Order: record order is a permutation per epoch, seeded by (seed, epoch): step n's prompts are samples
(n-1)*B .. n*B-1 of that stream, so step n's prompts are a function of (data, seed, n) and a resumed run
continues with the prompts it would have had.
"""

from __future__ import annotations

import json

import numpy as np

from MaxText.checkpoint.run_folder import source_config
from MaxText.config.types import Config, ConfigError
from MaxText.data import chat_dsv32, documents, records
from MaxText.data.records import DataError
from MaxText.data.tokenizer import Tokenizer
from MaxText.runtime.metrics import warn


def read_records(config: Config, *, eval: bool = False) -> list[tuple[str, dict]]:
  """(where, record) of every record of the training (or eval) data."""
  if config.dataset_type == "file":
    path = config.eval_dataset_path if eval else config.dataset_path
    if not path:
      raise ConfigError(f"{'eval_dataset_path' if eval else 'dataset_path'} is empty: RL reads its prompts from a "
                        ".jsonl file or folder")
    return documents.read_jsonl_records(path)[0]
  if config.dataset_type not in ("grain", "hf"):
    raise ConfigError(f"dataset_type={config.dataset_type}: RL reads prompt records (dataset_type=file, grain or hf)")
  table = records.open_table(config, eval=eval)
  out = []
  for i in range(len(table)):
    value = table.raw(i)
    if not table.columns:  # ArrayRecord: a UTF-8 JSON object per record
      value = json.loads(value.decode("utf-8"))
    elif len(table.columns) == 1:
      value = {table.columns[0]: value}
    out.append((table.where(i), value))
  return out


def thinking_of(record: dict, default: bool) -> bool:
  """Whether the record's prompt is rendered in thinking mode: its own `thinking`, else `default`
  (chat_thinking). The one decision: the prompt is rendered and its completion parsed (rewards.py) by it."""
  return bool(record.get("thinking", default))


def prompt_messages(record: dict, where: str) -> list[dict]:
  """The record's prompt as messages (DataError naming `where` when it has none)."""
  if isinstance(record.get("prompt"), str):
    return [{"role": "user", "content": record["prompt"]}]
  messages = record.get("prompt") if record.get("prompt") is not None else record.get("messages")
  if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
    raise DataError(f"{where}: an RL record needs 'prompt' (a string or a list of messages) or 'messages' (a "
                    f"list of messages); its fields are {sorted(record)}")
  last = max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer", "tool")), default=-1)
  if last < 0:
    raise DataError(f"{where}: the prompt has no user, developer or tool message to answer")
  return list(messages[:last + 1])


def trained_thinking(config: Config) -> tuple[str, bool] | None:
  """(config.yml, chat_thinking) of the run whose checkpoints load_parameters_path names, when that run
  says (an SFT or RL run of this code; a converter output or an older run says nothing: None)."""
  found = source_config(config.load_parameters_path)
  if found is None or not isinstance(found[1].get("chat_thinking"), bool):
    return None
  return found[0], found[1]["chat_thinking"]


class PromptSource:
  """The records and their rendered prompts; `step(n)` gives step n's rl_prompts_per_step of them."""

  def __init__(self, config: Config, tokenizer: Tokenizer, *, eval: bool = False):
    self.config, self.tokenizer = config, tokenizer
    self.records = read_records(config, eval=eval)
    if not self.records:
      raise DataError(f"no records in the {'eval' if eval else 'training'} data")
    self._ids: dict[int, list[int]] = {}
    eos = tokenizer.encode(chat_dsv32.EOS)  # the format ends a reply with its EOS marker (the server stops there)
    self.eos_id = eos[0] if len(eos) == 1 else tokenizer.eos_id
    self._trained = None if eval else trained_thinking(config)  # (config.yml, its chat_thinking) or None

  def _check_mode(self, thinking: bool, where: str) -> None:
    """Warns once when a prompt's thinking mode is not the one the starting checkpoint's run trained."""
    if self._trained is None or thinking == self._trained[1]:
      return
    path, trained = self._trained
    self._trained = None
    warn(f"{where}: RL renders this prompt with thinking {'on' if thinking else 'off'} (chat_thinking="
         f"{str(self.config.chat_thinking).lower()}, or the record's \"thinking\"), but the starting checkpoint's run "
         f"trained chat_thinking={str(trained).lower()} ({path}): its completions may be near-empty or unparsed; set "
         f"chat_thinking={str(trained).lower()} to match")

  def __len__(self) -> int:
    return len(self.records)

  def ids(self, i: int) -> list[int]:
    """Record i's prompt token ids (rendered once, then kept)."""
    if i not in self._ids:
      where, record = self.records[i]
      cfg = self.config
      thinking = thinking_of(record, cfg.chat_thinking)
      self._check_mode(thinking, where)
      try:
        text = chat_dsv32.render(prompt_messages(record, where), thinking=thinking,
                                 bos=cfg.add_bos, tools=chat_dsv32.check_tools(record.get("tools")))
      except chat_dsv32.ChatFormatError as e:
        raise DataError(f"{where}: {e}") from None
      ids = self.tokenizer.encode(text)
      if len(ids) + cfg.rl_max_completion_tokens > cfg.max_target_length:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens; with rl_max_completion_tokens="
                        f"{cfg.rl_max_completion_tokens} that exceeds max_target_length={cfg.max_target_length}")
      self._ids[i] = ids
    return self._ids[i]

  def indices(self, step: int) -> list[int]:
    """Step `step`'s (1-based) record indices: samples (step-1)*B .. step*B-1 of the per-epoch permutations."""
    n, b = len(self.records), self.config.rl_prompts_per_step
    out = []
    for k in range((step - 1) * b, step * b):
      perm = np.random.default_rng([self.config.seed, k // n]).permutation(n)
      out.append(int(perm[k % n]))
    return out

  def step(self, step: int) -> list[tuple[str, dict, list[int]]]:
    return [(self.records[i][0], self.records[i][1], self.ids(i)) for i in self.indices(step)]
