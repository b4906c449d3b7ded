"""The RL side: rewards (post_train/rewards.py), prompts (post_train/prompts.py), rollouts -> loss arrays
(post_train/rollout_batch.py assemble), config rules, and a run killed after a checkpoint that resumes the same run."""

import json
import os
import sys
import types

import jax
import numpy as np
import pytest

from MaxText import rl
from MaxText.checkpoint import hf_export, orbax_state
from MaxText.config.types import ConfigError
from MaxText.data.records import DataError
from MaxText.data.tokenizer import load_tokenizer
from MaxText.inference.rollout import Rollout
from MaxText.inference.scheduler import Request, SamplingParams
from MaxText.layers import lora
from MaxText.post_train import prompts, rewards, rollout_batch
from MaxText.runtime.cli import RunError
from tests.conftest import make_config

HF_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tokenizer.json")
RL_KEYS = dict(tokenizer_type="hf", tokenizer_path=HF_JSON, decode_sampling_strategy="temperature",
               max_target_length=32, max_prefill_length=32, rl_max_completion_tokens=4, chat_thinking=False)


def _records(path, n=6):
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) + "\n")
  return str(path)


def test_exact_match_reads_the_reply_content_against_the_column():
  fn = rewards.exact_match("answer", thinking=True)
  assert fn("1 and 1 make 2</think> 2 <｜end▁of▁sentence｜>", {"answer": 2}) == 1.0
  assert fn("2", {"answer": 2}) == 0.0  # thinking mode: all of it is reasoning until </think>
  assert rewards.exact_match("answer", thinking=False)("2", {"answer": "2"}) == 1.0


def test_exact_match_parses_in_the_mode_the_record_was_rendered_in(tmp_path):
  """A record's own `thinking` beats chat_thinking for the prompt and for the parse alike: the right answer
  scores 1 whichever way the two disagree."""
  path = tmp_path / "t.jsonl"
  path.write_text(json.dumps({"prompt": "3+4=?", "answer": "7", "thinking": False}) + "\n"
                  + json.dumps({"prompt": "3+4=?", "answer": "7", "thinking": True}) + "\n")
  for default in (True, False):
    config = make_config(**dict(RL_KEYS, chat_thinking=default), dataset_type="file", dataset_path=str(path))
    source = prompts.PromptSource(config, load_tokenizer(config))
    reward = rewards.load_reward(config)
    (_, off), (_, on) = source.records
    assert source.tokenizer.decode(source.ids(0)).endswith("</think>")  # rendered with the record's False
    assert source.tokenizer.decode(source.ids(1)).endswith("<think>")
    np.testing.assert_array_equal(reward(["7", "so 7</think>7"], [off, on], ["a", "b"]), [1.0, 1.0])
    np.testing.assert_array_equal(reward(["so 7</think>8", "7"], [off, on], ["a", "b"]), [0.0, 0.0])


def test_a_reward_that_raises_is_one_line_naming_it_and_the_record(monkeypatch):
  mod = types.ModuleType("rl_test_rewards")
  mod.broken = lambda text, record: {}["missing"]
  mod.nan = lambda text, record: float("nan")
  mod.length = lambda text, record: float(len(text))
  monkeypatch.setitem(sys.modules, "rl_test_rewards", mod)
  reward = rewards.load_reward(make_config(rl_reward="rl_test_rewards:broken"))
  with pytest.raises(RunError) as e:
    reward(["hi"], [{"a": 1}], ["data.jsonl:7"])
  msg = str(e.value)
  assert "rl_reward=rl_test_rewards:broken raised KeyError" in msg and "data.jsonl:7" in msg and "\n" not in msg
  with pytest.raises(RunError, match="returned nan for record x.jsonl:1"):
    rewards.load_reward(make_config(rl_reward="rl_test_rewards:nan"))(["hi"], [{}], ["x.jsonl:1"])
  np.testing.assert_array_equal(rewards.load_reward(make_config(rl_reward="rl_test_rewards:length"))(
      ["ab", "abc"], [{}, {}], ["a", "b"]), [2.0, 3.0])
  for spec, said in (("nope", "a built-in"), ("no_such_module_xyz:f", "cannot import module"),
                     ("rl_test_rewards:absent", "has no function 'absent'")):
    with pytest.raises(ConfigError, match=said):
      rewards.load_reward(make_config(rl_reward=spec))


def test_prompts_render_once_per_record_and_each_step_is_a_function_of_seed_and_step(tmp_path):
  config = make_config(**RL_KEYS, dataset_type="file", dataset_path=_records(tmp_path / "p.jsonl"),
                       rl_prompts_per_step=4)
  tok = load_tokenizer(config)
  source = prompts.PromptSource(config, tok)
  again = prompts.PromptSource(config, tok)
  assert [source.indices(s) for s in (1, 2, 3)] == [again.indices(s) for s in (1, 2, 3)]  # a resume's prompts
  first_epoch = source.indices(1) + source.indices(2)[:2]
  assert sorted(first_epoch) == list(range(6))  # every record once per epoch
  where, record, ids = source.step(1)[0]
  assert tok.decode(ids).endswith("<｜Assistant｜></think>") and record["prompt"] in tok.decode(ids)
  msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  assert prompts.prompt_messages({"messages": msgs}, "w") == msgs[:1]  # an SFT record's answer left out
  with pytest.raises(DataError, match="w: an RL record needs 'prompt'"):
    prompts.prompt_messages({"question": "q"}, "w")


def test_a_prompt_ending_with_a_tool_call_and_its_results_keeps_them(tmp_path):
  """messages ending [assistant tool call, tool result]: the prompt is all of them (the model answers the
  results), rendered with the function_results block; a trailing assistant answer is left out."""
  call = {"role": "assistant", "content": "", "tool_calls": [
      {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}
  msgs = [{"role": "user", "content": "3+4?"}, call, {"role": "tool", "content": "7"}]
  assert prompts.prompt_messages({"messages": msgs}, "w") == msgs
  assert prompts.prompt_messages({"messages": msgs + [{"role": "assistant", "content": "7"}]}, "w") == msgs
  path = tmp_path / "tools.jsonl"
  path.write_text(json.dumps({"messages": msgs, "answer": "7"}) + "\n")
  keys = dict(RL_KEYS, dataset_type="file", dataset_path=str(path))
  fit = lambda n: dict(keys, max_target_length=n, max_prefill_length=n)  # noqa: E731
  source = prompts.PromptSource(make_config(**fit(512)), load_tokenizer(make_config(**keys)))
  text = source.tokenizer.decode(source.ids(0))
  assert "<result>7</result>" in text and text.endswith("</function_results>\n\n</think>")
  n = len(source.ids(0))  # prompt + rl_max_completion_tokens (4) fits max_target_length exactly, one more does not
  assert prompts.PromptSource(make_config(**fit(n + 4)), source.tokenizer).ids(0) == source.ids(0)
  with pytest.raises(DataError, match=f"the prompt is {n} tokens"):
    prompts.PromptSource(make_config(**fit(n + 3)), source.tokenizer).ids(0)


def test_assemble_scores_the_sampled_tokens_with_group_advantages_and_the_switches():
  keys = dict(RL_KEYS, rl_num_generations=2, rl_prompts_per_step=1)
  L, k = make_config(**keys).num_moe_layers, make_config(**keys).num_experts_per_tok

  def request(out, stop, lps):  # out: the output; a stop token (7) ends it when `stop`
    r = Request([1, 2, 3], SamplingParams(rollout=True), output=out, finish_reason="stop" if stop else "length")
    toks = out + ([7] if stop else [])
    r.rollout = Rollout(np.arange(3 + len(toks))[:, None, None] * np.ones((1, L, k), np.int32), toks, lps,
                        [5] * len(toks))
    return r

  reqs = [request([4, 5], True, [-0.1, -0.2, -0.3]), request([6, 6, 6, 6], False, [-1.0] * 4)]
  batch = rollout_batch.assemble(make_config(**keys), reqs, np.array([1.0, 0.0], np.float32))
  a = batch.arrays
  np.testing.assert_array_equal(a["tokens"][0, :7], [1, 2, 3, 4, 5, 7, 0])  # the stop token is trained on
  np.testing.assert_array_equal(a["mask"][0, :8], [0, 0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(a["mask"][1, :8], [0, 0, 0, 1, 1, 1, 1, 0])
  np.testing.assert_allclose(a["logp_old"][0, :7], [0, 0, 0, -0.1, -0.2, -0.3, 0])
  np.testing.assert_allclose(a["advantages"], [0.5, -0.5])
  assert batch.generated == 7 and a["kept"][0, 3] == 5 and a["routed_experts"][0, 4, 0, 0] == 4
  off = rollout_batch.assemble(make_config(**keys, rl_keep_routing=False, rl_keep_sampling_mask=False), reqs,
                               np.array([1.0, 0.0], np.float32))
  assert "kept" not in off.arrays and "routed_experts" not in off.arrays
  assert off.routed_experts[0, 4, 0, 0] == 4  # still there for the routing agreement


def test_routing_agreement_counts_computed_real_positions_whose_expert_sets_match():
  """[1 sequence, 4 positions, 2 layers, k 2]: the model's own routing against the recorded one; order within a
  set does not matter, -1 (not computed) and padding (segment 0) are left out: 3 of 4 counted pairs agree."""
  own = np.array([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]], [[5, 6], [7, 0]]]], np.int32)  # [1,4,2,2]
  recorded = own[..., ::-1].copy()  # the same sets in another order
  recorded[0, 1, 1] = [6, 1]  # position 1, layer 1: another set
  recorded[0, 2] = -1  # position 2: not computed
  arrays = {"tokens": np.zeros((1, 4), np.int32), "positions": np.arange(4)[None], "segment_ids": np.array([[1, 1, 1, 0]])}
  model = lambda tokens, positions, segment_ids: (None, {"routed_experts": own})  # noqa: E731
  assert float(rollout_batch.routing_agreement(model, arrays, recorded)) == 3 / 4  # positions 0 and 1, 2 layers


def test_config_rules_are_one_line_naming_the_key():
  for keys, said in ((dict(decode_sampling_strategy="greedy"), "decode_sampling_strategy=greedy"),
                     (dict(rl_max_completion_tokens=32), "rl_max_completion_tokens=32"),
                     (dict(gradient_accumulation_steps=3, global_batch_size=3), "gradient_accumulation_steps=3"),
                     (dict(weight_quantization="fp8_block"), r"weight_quantization=fp8_block: .* \(lora_rank=N\)"),
                     (dict(ici_pipeline_parallelism=2, num_devices=2, num_decoder_layers=3), "= 2 stages: RL reads")):
    with pytest.raises(ConfigError, match=said) as e:
      rl.check_config(make_config(**{**RL_KEYS, **keys}))
    assert "\n" not in str(e.value)
  rl.check_config(make_config(**RL_KEYS, weight_quantization="fp8_block", lora_rank=4))  # adapters over an fp8 base


def _loop_keys(tmp_path, monkeypatch, **kw) -> dict:
  """A tiny RL run (1 prompt x 2 samples a step, 2 layers, no indexer) whose rewards differ within a group."""
  mod = types.ModuleType("rl_test_length")
  mod.length = lambda text, record: float(len(text) % 3)  # rewards that differ within a group: a gradient
  mod.checksum = lambda text, record: float(sum(map(ord, text)) % 3)  # where the lengths do not differ
  monkeypatch.setitem(sys.modules, "rl_test_length", mod)
  return dict(dict(RL_KEYS, dataset_type="file", dataset_path=_records(tmp_path / "p.jsonl"), steps=2,
              rl_prompts_per_step=1, rl_num_generations=2, rl_beta=0.1, checkpoint_period=1,
              async_checkpointing=False, base_output_directory=str(tmp_path), run_name="r", serve_max_num_seqs=2,
              serve_width_buckets=1, serve_context_buckets=1, mtp_num_layers=0, enable_tensorboard=False,
              learning_rate=1e-2, warmup_steps=0, num_decoder_layers=2, use_indexer=False,
              rl_reward="rl_test_length:length"), **kw)


def _killed_and_resumed(keys: dict, monkeypatch, capsys) -> tuple[list[dict], list[dict], list[dict]]:
  """Runs `keys` until the last step ran and before its checkpoint (the kill), then the same again: (the
  killed run's logged metrics per step, the resumed run's, its history). The resumed run must run only the last step."""
  logged = []
  monkeypatch.setattr(rl, "_log", lambda logger, config, step, m: logged.append(dict(m)))
  save = rl.orbax_state.save
  last = keys["steps"]

  def dies_at_last(manager, step, *a):
    if step == last:
      raise KeyboardInterrupt  # the kill, after the last step ran and before it was saved
    save(manager, step, *a)

  monkeypatch.setattr(rl.orbax_state, "save", dies_at_last)
  with pytest.raises(KeyboardInterrupt):
    rl.rl(make_config(**keys))
  killed = list(logged)
  monkeypatch.setattr(rl.orbax_state, "save", save)
  logged.clear()
  capsys.readouterr()
  history = rl.rl(make_config(**keys))
  assert [h["step"] for h in history] == [last] and [m["step"] for m in logged] == [last]
  for k in ("reward_mean", "completion_tokens", "loss", "kl", "grad_norm", "param_norm"):
    assert logged[0][k] == pytest.approx(killed[-1][k], rel=1e-5, abs=1e-7), k
  return killed, logged, history


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_a_run_killed_after_a_checkpoint_resumes_the_same_run(tmp_path, monkeypatch, capsys):
  """Step 2 dies before its checkpoint; run again: it resumes from step 1 and step 2 samples and trains
  exactly as the killed run did (same prompts, seeds, weights)."""
  killed, _, history = _killed_and_resumed(_loop_keys(tmp_path, monkeypatch), monkeypatch, capsys)
  last = capsys.readouterr().out.strip().splitlines()[-1]  # the closing line, as train.py's
  assert last.startswith("done: RL steps 2-2 of 2 in ") and f"reward_mean {history[0]['reward_mean']:.4f}" in last
  assert last.endswith(f"weights: load_parameters_path={tmp_path}/r/checkpoints")
  assert killed[1]["kl"] > 0  # step 1 moved the policy away from the reference


@pytest.mark.slow  # over 5 s of CPU (the fast lane leaves it out: README.md, Tests)
def test_grpo_with_lora_moves_only_the_adapters_swaps_them_in_without_recompiling_and_resumes(
    tmp_path, monkeypatch, capsys):
  """lora_rank > 0: at step 1 (B = 0) the policy is the reference (KL exactly 0); the engine gets the new
  adapters after each update over the same base bits, with no step program compiled by the swap (those after
  update 2 are those after update 1); checkpoints hold the adapters and their moments; a kill resumes exactly."""
  loads, programs = [], []  # the weights each engine.load_weights is given (numpy); step programs after each generate

  class Recording(rl.ServingEngine):
    def load_weights(self, params, buffers):
      loads.append(jax.tree.map(np.array, (params, buffers)))
      super().load_weights(params, buffers)

    def generate(self, *a, **kw):
      out = super().generate(*a, **kw)
      programs.append(self.step_programs())
      return out

  monkeypatch.setattr(rl, "ServingEngine", Recording)
  keys = _loop_keys(tmp_path, monkeypatch, lora_rank=4, steps=3, rl_reward="rl_test_length:checksum")
  killed, _, _ = _killed_and_resumed(keys, monkeypatch, capsys)
  out = capsys.readouterr().out
  assert "reference policy: the base with the adapters off (no copy" in out
  assert out.strip().splitlines()[-1].endswith(f"weights: LoRA adapters (rank 4) in {tmp_path}/r/checkpoints, over the "
                                               "base load_parameters_path=(random init)")
  w1, _, w3 = loads[:3]  # before steps 1, 2, 3 of the killed run
  assert programs[2] == programs[1] == programs[0] > 0  # the rollouts after updates 1 and 2 compiled nothing
  assert [m["kl"] for m in killed][0] == 0.0 and killed[1]["kl"] > 0  # step 1 on-policy over B = 0: the reference
  # step 2 samples with the adapters of update 1: the trainer's pi_theta of its tokens is the engine's pi_old
  assert killed[1]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  (a1, base1), (a3, base3) = w1, w3  # (the adapters, the frozen base + buffers)
  assert jax.tree.leaves(a1) and all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(a1))
  jax.tree.map(np.testing.assert_array_equal, base1, base3)  # the base's bits, after two updates
  lora_b = lambda tree: [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if p[-1].key == "lora_b"]  # noqa: E731
  assert not any(b.any() for b in lora_b(a1)) and all(b.any() for b in lora_b(a3))  # B: zeros, then trained
  assert not any(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a1), jax.tree.leaves(a3)))  # A and B moved
  stored = orbax_state._stored_tree(os.path.join(tmp_path, "r", "checkpoints", "3", "state"))
  assert set(stored) == {"params", "buffers", "opt_state", "step"} and not jax.tree.leaves(stored["buffers"])
  assert all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored["params"]))
  # a new RL run from run r's adapters (lora_restore_path): its first rollout's policy holds them bit for bit over
  # the same base, and its reference is still the base with the adapters off (step 1's KL is no longer 0)
  loads.clear()
  logged = []
  monkeypatch.setattr(rl, "_log", lambda logger, config, step, m: logged.append(dict(m)))
  rl.rl(make_config(**dict(keys, run_name="r2", steps=1, lora_restore_path=str(tmp_path / "r"))))
  (a_new, base_new), = loads[:1]
  jax.tree.map(np.testing.assert_array_equal, base_new, base1)
  saved = hf_export.restore_raw(os.path.join(tmp_path, "r", "checkpoints", "3", "state"))["params"]
  for x, y in zip(jax.tree.leaves(a_new), jax.tree.leaves(saved)):
    assert x.tobytes() == y.tobytes()
  assert logged[0]["kl"] > 0 and "LoRA adapters from lora_restore_path=" in capsys.readouterr().out


def test_the_rl_demo_writes_disjoint_sets_and_its_keys_are_a_valid_rl_config(tmp_path):
  # demos/rl_demo.py (not run in CI: minutes): its data and its RL command, without compiling anything
  from demos import rl_demo
  from MaxText.config import pyconfig
  args, extra = rl_demo.parser().parse_known_args(["--work", str(tmp_path), "--eval", "20"])
  data = tmp_path / "data"
  counts = rl_demo.write_data(args, str(data))
  read = lambda name: [json.loads(line) for line in open(data / name)]  # noqa: E731
  train, held = {r["prompt"] for r in read("rl.jsonl")}, {r["prompt"] for r in read("eval.jsonl")}
  assert len(held) == counts["eval_problems"] == 20 and not train & held
  sft = read("train.jsonl")  # every pair (sft_eval_pairs=include), a share in the long style
  assert len(sft) == len(train) + len(held) and 0 < counts["sft_long_replies"] < len(sft)
  assert sum(r["messages"][1]["content"].startswith("The sum of") for r in sft) == counts["sft_long_replies"]
  config = pyconfig.initialize(rl_demo.rl_argv(args, str(data), HF_JSON, 512, extra or ["mtp_num_layers=0"]))
  rl.check_config(config)
  assert config.rl_num_generations == args.generations and config.eval_dataset_path.endswith("eval.jsonl")
  # the LoRA keys go to RL only (SFT trains the base); the default model keys stay when only they are given
  assert rl_demo.split_keys(["lora_rank=16", "lora_alpha=32"]) == (list(rl_demo.DEFAULT_KEYS), ["lora_rank=16", "lora_alpha=32"])
  assert rl_demo.split_keys(["use_indexer=false", "lora_rank=8"]) == (["use_indexer=false"], ["lora_rank=8"])


def test_prompts_warn_once_when_their_mode_is_not_the_one_the_starting_run_trained(tmp_path, capsys):
  run = tmp_path / "sft"
  (run / "checkpoints" / "10").mkdir(parents=True)
  (run / "config.yml").write_text("use_sft: true\nchat_thinking: false\n")
  data = _records(tmp_path / "p.jsonl")
  for start in (str(run / "checkpoints"), str(run / "checkpoints" / "10")):
    config = make_config(**{**RL_KEYS, "chat_thinking": True}, dataset_type="file", dataset_path=data,
                         rl_prompts_per_step=4, load_parameters_path=start)
    source = prompts.PromptSource(config, load_tokenizer(config))
    source.step(1), source.step(2)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "trained chat_thinking=false" in err and str(run / "config.yml") in err
  same = make_config(**RL_KEYS, dataset_type="file", dataset_path=data, load_parameters_path=str(run / "checkpoints"))
  prompts.PromptSource(same, load_tokenizer(same)).step(1)  # chat_thinking false, as trained
  untold = make_config(**{**RL_KEYS, "chat_thinking": True}, dataset_type="file", dataset_path=data,
                       load_parameters_path=str(tmp_path / "converted"))  # a converter output says nothing
  prompts.PromptSource(untold, load_tokenizer(untold)).step(1)
  assert "warning:" not in capsys.readouterr().err
