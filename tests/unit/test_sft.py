"""MaxText/data/sft.py and the weights it carries through packing: conversations -> ids and loss weights."""

import json
import os

import numpy as np
import pytest

from MaxText.data import chat_dsv32 as fmt
from MaxText.data import input_pipeline as ip
from MaxText.data.packing import pack_row
from MaxText.data.records import DataError
from MaxText.data.sft import ConversationEncoder
from MaxText.data.tokenizer import load_tokenizer
from tests.conftest import make_config

HF_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tokenizer.json")
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": "x"}'}}
DSML_CALL = (f'\n\n<{fmt.DSML}function_calls>\n<{fmt.DSML}invoke name="add">\n'
             f'<{fmt.DSML}parameter name="a" string="false">2</{fmt.DSML}parameter>\n'
             f'<{fmt.DSML}parameter name="b" string="true">x</{fmt.DSML}parameter>\n'
             f'</{fmt.DSML}invoke>\n</{fmt.DSML}function_calls>')
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

# (record, the assistant's spans as text, written out from the format by hand); thinking on and off
CASES = {
    "system_user_assistant": (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}]},
        ["Hello!" + fmt.EOS]),
    "developer": (
        {"messages": [{"role": "developer", "content": "Say ok"}, {"role": "assistant", "content": "ok"}]},
        ["ok" + fmt.EOS]),
    "thinking_multi_turn": (  # the earlier turn's reasoning is dropped by the format: only its content is trained
        {"messages": [{"role": "user", "content": "1+1?"},
                      {"role": "assistant", "reasoning_content": "one and one", "content": "2"},
                      {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "reasoning_content": "two and two", "content": "4"}]},
        ["2" + fmt.EOS, "two and two" + fmt.THINK_END + "4" + fmt.EOS]),
    "thinking_off": (
        {"thinking": False, "messages": [{"role": "user", "content": "2+2?"},
                                         {"role": "assistant", "reasoning_content": "ignored", "content": "4"}]},
        ["4" + fmt.EOS]),
    "tools_thinking": (
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "reasoning_content": "call it", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "2x"},
            {"role": "assistant", "reasoning_content": "done", "content": "2x"}]},
        ["call it" + fmt.THINK_END + DSML_CALL + fmt.EOS, "done" + fmt.THINK_END + "2x" + fmt.EOS]),
    "tools_no_thinking": (
        {"tools": TOOLS, "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": "Sure.", "tool_calls": [CALL]},
            {"role": "tool", "content": "2x"},
            {"role": "assistant", "content": "2x"}]},
        ["Sure." + DSML_CALL + fmt.EOS, "2x" + fmt.EOS]),
    "prompt_completion": ({"prompt": "Hi", "completion": "Hello!"}, ["Hello!" + fmt.EOS]),
}


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(tokenizer_type="hf", tokenizer_path=HF_JSON, bos_id=1, eos_id=2, pad_id=0)


def encoder(tok, columns=("messages",), completion_only=True, max_tokens=10_000):
  return ConversationEncoder(tok, columns, completion_only, add_bos=True, max_tokens=max_tokens)


def runs(ids, mask):
  """The weighted tokens as contiguous runs: [ids of run 0, ids of run 1, ...]."""
  out, cur = [], []
  for i, m in zip(ids, mask):
    if m:
      cur.append(int(i))
    elif cur:
      out, cur = out + [cur], []
  return out + [cur] if cur else out


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_are_exactly_the_assistants_tokens(tok, case):
  record, spans = CASES[case]
  columns = ("prompt", "completion") if "prompt" in record else ("messages",)
  ids, mask = encoder(tok, columns)(record, "x.jsonl:1")
  assert set(np.unique(mask)) <= {0.0, 1.0}
  assert runs(ids, mask) == [tok.encode(s) for s in spans]  # exactly the assistant's spans, nothing else
  thinking = record.get("thinking", any("reasoning_content" in m for m in record.get("messages", [])))
  messages = record.get("messages") or [{"role": "user", "content": record.get("prompt")},
                                        {"role": "assistant", "content": record.get("completion")}]
  whole = fmt.render(messages, thinking=thinking, tools=record.get("tools"))
  assert ids.tolist() == tok.encode(whole)  # piece by piece == the whole text, tokenized at once
  starts = np.flatnonzero(np.diff(mask) > 0) + 1  # [runs] each assistant turn's first token
  gen_prompt = tok.encode(fmt.THINK_START) + tok.encode(fmt.THINK_END)
  assert all(ids[i - 1] in gen_prompt for i in starts)  # the <think> / </think> before a turn is the prompt's


def test_completion_only_false_weighs_every_token(tok):
  record, _ = CASES["tools_thinking"]
  ids, mask = encoder(tok, completion_only=False)(record, "x.jsonl:1")
  assert mask.tolist() == [1.0] * len(ids)


def test_a_long_conversation_is_cut_after_its_last_assistant_turn_that_fits(tok):
  record = CASES["thinking_multi_turn"][0]
  full_ids, full_mask = encoder(tok)(record, "x")
  two_turns = [i for i in range(len(full_ids)) if full_ids[i] == tok.encode(fmt.EOS)[0]]  # [2] each turn's EOS
  enc = encoder(tok, max_tokens=two_turns[1])  # one token short of the whole
  ids, mask = enc(record, "x")
  assert ids.tolist() == full_ids[:two_turns[0] + 1].tolist() and mask.tolist() == full_mask[:len(ids)].tolist()
  assert enc(CASES["developer"][0], "x") is None and (enc.cut, enc.dropped) == (1, 1)  # 29 tokens, none fits


def test_a_turn_ending_exactly_at_max_target_length_plus_1_tokens_fits(tok):
  """max_target_length + 1 tokens fill a row (its inputs and its last target): a conversation or a turn
  ending exactly there is kept whole; one token more and it is cut (or dropped)."""
  record = CASES["thinking_multi_turn"][0]
  full_ids, _ = encoder(tok)(record, "x")
  first = [i for i in range(len(full_ids)) if full_ids[i] == tok.encode(fmt.EOS)[0]][0] + 1  # the first turn's end
  cfg = lambda n: make_config(dataset_type="file", use_sft=True, train_data_columns=["messages"],  # noqa: E731
                              tokenizer_type="hf", tokenizer_path=HF_JSON, max_target_length=n, max_prefill_length=n)
  whole = ConversationEncoder.from_config(cfg(len(full_ids) - 1), tok)  # max_tokens = len(full_ids) exactly
  assert whole.max_tokens == len(full_ids) and whole(record, "x")[0].tolist() == full_ids.tolist() and whole.cut == 0
  at_turn = encoder(tok, max_tokens=first)  # the first turn ends exactly at the limit: cut there, not dropped
  assert at_turn(record, "x")[0].tolist() == full_ids[:first].tolist() and (at_turn.cut, at_turn.dropped) == (1, 0)
  short = encoder(tok, max_tokens=first - 1)
  assert short(record, "x") is None and (short.cut, short.dropped) == (0, 1)


def _pack_reference(docs, L):
  """Hand-written packing of (ids, mask) docs into one row: weight = same doc and the target's mask."""
  toks = [t for ids, _ in docs for t in ids]
  masks = [m for _, ms in docs for m in ms]
  seg = [k + 1 for k, (ids, _) in enumerate(docs) for _ in ids]
  return np.array([float(seg[i] == seg[i + 1]) * masks[i + 1] for i in range(L)], np.float32), toks


def test_both_packers_carry_each_tokens_weight():
  rng = np.random.default_rng(0)
  docs = [(rng.integers(3, 50, n).astype(np.int32), rng.integers(0, 2, n).astype(np.float32)) for n in (5, 7, 9)]
  L = 20  # the three docs hold 21 = L + 1 tokens: one row, no padding
  want, toks = _pack_reference(docs, L)
  row, _ = pack_row(lambda j: docs[j], (0, 0), 1, L)  # the lanes' packer (grain, hf)
  assert row["inputs"].tolist() == toks[:L] and row["weights"].tolist() == want.tolist()
  corpus = ip.PackedCorpus([d[0] for d in docs], masks=[d[1] for d in docs], seq_len=L, pad_id=0, seed=0,
                           shuffle=False)  # the file dataset's packer
  assert corpus.row(0)["weights"].tolist() == want.tolist()


def test_both_packers_keep_each_conversation_whole_in_one_row():
  docs = [(np.arange(10 * k + 3, 10 * k + 3 + n, dtype=np.int32), np.ones(n, np.float32))
          for k, n in enumerate((5, 7, 9, 4, 6))]
  L = 12  # rows of 13 tokens: [5 7 +1 pad], [9 4], [6 +7 pad]: a conversation that does not fit starts the next row
  want = [[0, 1, None], [2, 3], [4] + [None] * 7]
  corpus = ip.PackedCorpus([d[0] for d in docs], masks=[d[1] for d in docs], seq_len=L, pad_id=0, seed=0,
                           shuffle=False, whole=True)
  full = (np.arange(L + 1, dtype=np.int32), np.ones(L + 1, np.float32))  # the lane's next: a row of its own
  cursor, lanes = (0, 0), []
  for _ in range(3):
    row, cursor = pack_row(lambda j: docs[j] if j < len(docs) else full, cursor, 1, L, whole=True)
    lanes.append(row)
  assert cursor == (5, 0)
  assert corpus.rows_per_epoch == 3 and corpus.row(3)["inputs"].tolist() == corpus.row(0)["inputs"].tolist()
  for r, parts in enumerate(want):
    toks = [t for k in parts for t in (docs[k][0].tolist() if k is not None else [0])]
    seg = [s + 1 if k is not None else 0 for s, k in enumerate(parts) for _ in (docs[k][0] if k is not None else [0])]
    weights = [float(seg[i] == seg[i + 1] != 0) for i in range(L)]
    for row in (corpus.row(r), lanes[r]):
      assert row["inputs"].tolist() == toks[:L] and row["targets"].tolist() == toks[1:]
      assert row["segment_ids"].tolist() == seg[:L] and row["weights"].tolist() == weights


def test_the_masked_loss_is_the_hand_computed_masked_mean():
  from MaxText.layers.models import cross_entropy
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
  weights = np.array([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], np.float32)
  x = logits.astype(np.float64)
  nll = [[np.log(np.exp(x[b, t]).sum()) - x[b, t, targets[b, t]] for t in range(5)] for b in range(2)]
  want = sum(nll[b][t] for b in range(2) for t in range(5) if weights[b, t]) / weights.sum()  # 4 tokens
  assert float(cross_entropy(logits, targets, weights)[1]) == pytest.approx(want, rel=1e-5)


def sft_config(path, **kw):
  kw = {"max_target_length": 32, "max_prefill_length": 32, "global_batch_size": 2, **kw}
  return make_config(dataset_type="file", dataset_path=str(path), tokenizer_type="hf", tokenizer_path=HF_JSON,
                     use_sft=True, train_data_columns=["messages"], **kw)


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


@pytest.mark.parametrize("record,says", [
    ({"messages": []}, "no messages"),
    ({"text": "plain"}, "has no 'messages'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "messages[1].role='robot'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
     "messages[1] is an assistant turn with neither content nor tool_calls"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_line(tmp_path, record, says):
  good = CASES["system_user_assistant"][0]
  path = write_jsonl(tmp_path / "chats.jsonl", [good, record])
  with pytest.raises(DataError) as e:  # a ConfigError: runtime.cli exits 2
    ip.create_data_iterator(sft_config(path), process_index=0, process_count=1)
  assert str(e.value).startswith(f"{path}:2: ") and says in str(e.value) and "\n" not in str(e.value)


def test_file_batches_weigh_the_assistant_and_resume_exactly(tmp_path, caplog):
  records = [CASES[k][0] for k in ("system_user_assistant", "thinking_multi_turn", "thinking_off")] * 3
  long = {"messages": [{"role": "user", "content": "x " * 40}, {"role": "assistant", "content": "y"}]}
  cfg = sft_config(write_jsonl(tmp_path / "chats.jsonl", records + [long]), max_target_length=64,
                   max_prefill_length=64)
  it = ip.create_data_iterator(cfg, process_index=0, process_count=1)
  assert it.source.corpus.num_documents == len(records)  # the long one dropped
  assert "max_target_length + 1 = 65 tokens: 0 cut after their last assistant turn that fits, 1 dropped" \
      in caplog.text
  batches = [next(it) for _ in range(4)]
  w = np.concatenate([b["weights"] for b in batches])
  assert 0 < w.sum() < 0.5 * w.size  # the prompts weigh nothing
  eos = load_tokenizer(cfg).encode(fmt.EOS)[0]
  targets = np.concatenate([b["targets"] for b in batches])
  assert np.all(w[targets == eos] == 1)  # every closing EOS is the assistant's
  it.set_state({**it.get_state(), "step": 2})
  again = next(it)
  for k in ip.BATCH_KEYS:
    np.testing.assert_array_equal(again[k], batches[2][k], err_msg=k)


def test_parquet_prompt_completion_streams_the_same_weights(tmp_path, tok):
  import pyarrow as pa
  import pyarrow.parquet as pq
  record = {"prompt": "Hi", "completion": "Hello!"}
  pq.write_table(pa.table({k: [v] * 6 for k, v in record.items()}), tmp_path / "chats.parquet")
  cfg = make_config(dataset_type="grain", grain_file_type="parquet", grain_train_files=str(tmp_path / "*.parquet"),
                    grain_worker_count=0, tokenizer_type="hf", tokenizer_path=HF_JSON, use_sft=True,
                    train_data_columns=["prompt", "completion"], max_target_length=32, max_prefill_length=32,
                    global_batch_size=1)
  batch = next(ip.create_data_iterator(cfg, process_index=0, process_count=1))
  doc = encoder(tok, ("prompt", "completion"))(record, "x")  # every record is this one: the order cannot matter
  want, _ = pack_row(lambda j: doc, (0, 0), 1, 32, whole=True, pad_id=cfg.pad_id)  # whole conversations
  assert batch["weights"][0].tolist() == want["weights"].tolist() and batch["weights"].sum() > 0


def test_an_hf_dataset_reads_each_conversation_with_its_tools(tmp_path, tok):
  from MaxText.data.records import open_table
  from MaxText.data.sft import ConversationReader
  records = [CASES[k][0] for k in ("tools_thinking", "system_user_assistant", "thinking_multi_turn")]
  path = write_jsonl(tmp_path / "chats.jsonl", records)
  cfg = make_config(dataset_type="hf", hf_path=str(path), tokenizer_type="hf", tokenizer_path=HF_JSON, use_sft=True,
                    train_data_columns=["messages"], max_target_length=2048)
  read = ConversationReader(open_table(cfg), ConversationEncoder.from_config(cfg, tok))
  for i, record in enumerate(records):  # the row (arrow fills absent fields with None) renders as the record does
    assert [a.tolist() for a in read(i)] == [a.tolist() for a in encoder(tok)(record, "x")]


def test_sft_keys_and_tokenizer_are_checked_in_one_line():
  from MaxText.config.types import ConfigError
  with pytest.raises(ConfigError, match=r"train_data_columns=\['prompt', 'completion'\]: name one column"):
    make_config(train_data_columns=["prompt", "completion"])
  with pytest.raises(ConfigError, match="use_sft=true reads conversations from files"):
    make_config(use_sft=True)  # dataset_type=synthetic
  sp = load_tokenizer(tokenizer_type="sentencepiece", tokenizer_path=HF_JSON.replace(".json", ".model"))
  cfg = make_config(dataset_type="file", use_sft=True)
  with pytest.raises(DataError, match="markers must be single tokens: the tokenizer at .* splits"):
    ConversationEncoder.from_config(cfg, sp)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_jinja_chat_template_weighs_what_the_template_adds_for_each_assistant_message(tmp_path, tok):
  def encoder_of(template):
    (tmp_path / "t.jinja").write_text(template)
    cfg = make_config(dataset_type="file", use_sft=True, train_data_columns=["messages"], tokenizer_type="hf",
                      tokenizer_path=HF_JSON, chat_template_path=str(tmp_path / "t.jinja"), max_target_length=256)
    return ConversationEncoder.from_config(cfg, tok)

  record = CASES["thinking_multi_turn"][0]
  ids, mask = encoder_of(CHATML)(record, "x.jsonl:1")
  assert runs(ids, mask) == [tok.encode("2<|im_end|>\n"), tok.encode("4<|im_end|>\n")]  # content and the closing
  prompt = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in record["messages"][:3])
  assert tok.decode(ids.tolist()) == prompt + "<|im_start|>assistant\n4<|im_end|>\n"
  bad = encoder_of(CHATML.replace("assistant\n{% endif %}", "model\n{% endif %}"))  # the prompt ends unlike a reply
  with pytest.raises(DataError, match=r"x.jsonl:1: the chat template's rendering of messages\[:1\]"):
    bad(record, "x.jsonl:1")


def test_sft_server_and_rl_take_the_chat_format_from_one_decision(tmp_path, tok):
  """A tokenizer_config.json with a chat_template next to tokenizer_path (no chat_template_path): under
  chat_encoding=auto the server and SFT both render with it and RL refuses it in one line; under
  deepseek_v32 all three render DeepSeek-V3.2's format."""
  import shutil

  from MaxText import rl
  from MaxText.config.types import ConfigError
  from MaxText.data.chat_template import chat_format
  shutil.copy(HF_JSON, tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
  keys = dict(dataset_type="file", use_sft=True, train_data_columns=["messages"], tokenizer_type="hf",
              tokenizer_path=str(tmp_path / "tokenizer.json"), max_target_length=32, max_prefill_length=32,
              decode_sampling_strategy="temperature", rl_max_completion_tokens=4)
  auto, v32 = make_config(**keys), make_config(**keys, chat_encoding="deepseek_v32")
  assert chat_format(auto).encoding == "jinja" and ConversationEncoder.from_config(auto, tok).template == CHATML
  with pytest.raises(ConfigError, match="chat_encoding=auto renders with the jinja template"):
    rl.check_config(auto)
  assert chat_format(v32).encoding == "deepseek_v32" and ConversationEncoder.from_config(v32, tok).template is None
  rl.check_config(v32)


def test_chat_thinking_is_the_mode_of_records_without_reasoning_or_thinking(tok):
  msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
  for default in (False, True):
    config = make_config(tokenizer_type="hf", tokenizer_path=HF_JSON, chat_thinking=default,
                         train_data_columns=["messages"])
    enc = ConversationEncoder.from_config(config, tok)
    ids, _ = enc({"messages": msgs}, "x.jsonl:1")
    assert ids.tolist() == tok.encode(fmt.render(msgs, thinking=default))
    ids, _ = enc({"messages": msgs, "thinking": not default}, "x.jsonl:1")  # the record's own word wins
    assert ids.tolist() == tok.encode(fmt.render(msgs, thinking=not default))
