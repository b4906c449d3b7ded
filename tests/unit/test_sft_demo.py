"""demos/sft_demo.py's plumbing (the demo itself trains and serves for minutes: not run here): its data, tokenizer,
train commands, the base it trains first for LoRA and the model width that makes the adapters a small state."""

import json
import os

import pytest

from demos import sft_demo
from MaxText.config import pyconfig
from MaxText.data import chat_dsv32 as fmt
from MaxText.data.sft import ConversationEncoder
from MaxText.data.tokenizer import load_tokenizer


def demo_args(tmp_path, *argv):
  """The demo's (flags, model keys) for `argv` after --work, as main settles them."""
  return sft_demo.settle(*sft_demo.parse_args(sft_demo.parser(), ["--work", str(tmp_path), *argv], ()))


def test_the_demos_tokenizer_and_training_config_hold_its_conversations_whole_in_short_rows(tmp_path):
  """The BPE tokenizer the demo trains (on the task's and the base's conversations) keeps V3.2's markers and every
  digit one token each, its train.py command is a valid config whose vocab holds the tokenizer, and every
  conversation of both sets (a tool one is ~1050 bytes-tokens) fits a max_target_length=256 row, neither cut nor
  dropped."""
  args, keys = demo_args(tmp_path, "--train", "200", "--eval", "20", "--base", "trained")
  data, base_data = str(tmp_path / "data"), str(tmp_path / "base_data")
  sft_demo.write_sets(args, data)
  sft_demo.write_base_sets(args, base_data)
  path, vocab_size = sft_demo.demo_tokenizer(args, data, base_data)
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=path)
  assert all(len(tok.encode(m)) == 1 for m in fmt.SPECIAL_TOKENS)
  cmd = sft_demo.train_command(args, data, path, vocab_size, keys)
  cfg = pyconfig.initialize(cmd[2:], num_devices=1, ici_data_parallelism=1)
  assert cfg.use_sft and cfg.steps == args.steps and cfg.max_target_length == 256 and cfg.emb_dim == 64
  assert cfg.learning_rate == sft_demo.LEARNING_RATE["full"] and tok.vocab_size <= cfg.vocab_size
  enc = ConversationEncoder.from_config(cfg, tok)
  for folder in (data, base_data):
    for split in ("train", "eval"):
      for n, line in enumerate(open(os.path.join(folder, f"{split}.jsonl"))):
        ids, _ = enc(json.loads(line), f"{split}.jsonl:{n + 1}")
        texts = [tok.decode([i]) for i in ids.tolist()]
        assert all(len(t) == 1 for t in texts if any(c.isdigit() for c in t)), texts  # a digit is a token alone
  assert (enc.cut, enc.dropped) == (0, 0)


def test_the_base_task_asks_no_addition_and_calls_only_mul(tmp_path):
  """The base knows the format and the tool-call syntax but not the task: products and differences (a >= b), the
  tool conversations products calling `mul`; never a "+" question nor the `add` tool (the "before" score's
  honesty). The task's set is additions calling `add`."""
  args, _ = demo_args(tmp_path, "--train", "300", "--eval", "10", "lora_rank=16")
  sft_demo.write_base_sets(args, str(tmp_path / "base"))
  sft_demo.write_sets(args, str(tmp_path / "task"))
  ops, tools = set(), set()
  for line in open(tmp_path / "base" / "train.jsonl"):
    r = json.loads(line)
    q = r["messages"][0]["content"]
    a, op, b = q[0], q[1], q[2:-2]
    ops.add(op)
    assert op != "-" or int(a) >= int(b), q
    tools |= {t["function"]["name"] for t in r.get("tools", [])}
    calls = [c["function"]["name"] for m in r["messages"] for c in m.get("tool_calls", [])]
    assert calls == (["mul"] if "tools" in r else []) and ("tools" not in r or op == "*"), r
    assert r["messages"][-1]["content"] == str(int(a) * int(b) if op == "*" else int(a) - int(b))
  assert ops == {"*", "-"} and tools == {"mul"}
  task = [json.loads(line) for line in open(tmp_path / "task" / "train.jsonl")]
  assert {r["messages"][0]["content"][1] for r in task} == {"+"}
  assert {t["function"]["name"] for r in task for t in r.get("tools", [])} == {"add"}


def test_lora_defaults_to_a_trained_wide_base_whose_adapters_are_at_most_5_percent_of_the_full_state(tmp_path):
  args, keys = demo_args(tmp_path, "lora_rank=16")
  assert (args.base, args.width, args.learning_rate, args.steps) == ("trained", "wide", sft_demo.LEARNING_RATE["lora"],
                                                                    sft_demo.STEPS["lora"])
  assert keys == [*sft_demo.DEFAULT_KEYS, *sft_demo.WIDE_KEYS, "lora_rank=16"]
  base = sft_demo.base_command(args, "tok.json", 1024, [*keys, "lora_alpha=32", "lora_module_path=.*/wo"])
  assert "run_name=base" in base and f"dataset_path={tmp_path}/base_data/train.jsonl" in base
  assert f"steps={args.base_steps}" in base and f"learning_rate={sft_demo.LEARNING_RATE['full']}" in base
  assert not [k for k in base if k.startswith("lora_")]  # the base trains every weight
  cfg = sft_demo.demo_config(sft_demo.train_command(args, "d", "tok.json", 1024, keys)[3:])
  lora, full = sft_demo.checkpoint_bytes(cfg), sft_demo.checkpoint_bytes(cfg.model_copy(update={"lora_rank": 0}))
  assert 0.03 < lora / full <= 0.05, (lora, full)
  full_args, full_keys = demo_args(tmp_path)
  assert (full_args.base, full_args.width, full_args.steps) == ("init", "tiny", sft_demo.STEPS["full"])
  assert full_keys == list(sft_demo.DEFAULT_KEYS) and demo_args(tmp_path, "--quick")[0].steps == sft_demo.QUICK["steps"]


def test_the_base_is_trained_once_and_again_only_for_another_command_or_tokenizer(tmp_path, monkeypatch):
  ran = []

  def fake_run(cmd, env, log):
    ran.append(cmd)
    os.makedirs(tmp_path / "base" / "checkpoints", exist_ok=True)
    (tmp_path / "base" / "checkpoints" / "trained").write_text(str(len(ran)))

  monkeypatch.setattr(sft_demo, "run", fake_run)
  tok = tmp_path / "tokenizer.json"
  tok.write_text("v1")
  cmd = ["python", "-m", "MaxText.train", "steps=300"]
  first = sft_demo.train_base(cmd, str(tok), {}, str(tmp_path))
  assert first == (str(tmp_path / "base" / "checkpoints"), False) and len(ran) == 1
  assert sft_demo.train_base(cmd, str(tok), {}, str(tmp_path)) == (first[0], True) and len(ran) == 1
  assert not sft_demo.train_base([*cmd[:-1], "steps=400"], str(tok), {}, str(tmp_path))[1] and len(ran) == 2
  tok.write_text("v2")
  assert not sft_demo.train_base([*cmd[:-1], "steps=400"], str(tok), {}, str(tmp_path))[1] and len(ran) == 3
  assert (tmp_path / "base" / "checkpoints" / "trained").read_text() == "3"


def test_the_demos_pass_model_keys_on_and_refuse_anything_else_in_one_line(tmp_path, capsys):
  args, keys = sft_demo.parse_args(sft_demo.parser(), ["--work", "w", "lora_rank=16"], ["mtp_num_layers=0"])
  assert args.work == "w" and keys == ["mtp_num_layers=0", "lora_rank=16"]  # given keys after (over) the defaults
  assert sft_demo.lora_rank_of(keys) == 16 and sft_demo.lora_rank_of(["mtp_num_layers=0"]) == 0
  assert sft_demo.parse_args(sft_demo.parser(), ["--work", "w"], ("mtp_num_layers=0",))[1] == ["mtp_num_layers=0"]
  with pytest.raises(SystemExit) as e:
    sft_demo.parse_args(sft_demo.parser(), ["--work", "w", "lora_rank"], [])
  assert e.value.code == 2 and "unknown argument 'lora_rank'" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    demo_args(tmp_path, "--base", "init", "lora_rank=16")
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count("\n") == 1 and "lora_rank=16 with --base init" in err
