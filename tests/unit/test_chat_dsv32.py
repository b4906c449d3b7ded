"""DeepSeek-V3.2's conversation format (MaxText/data/chat_dsv32.py, chat_dsv32_stream.py): every message
kind rendered to the exact text of the release's encoder, parse(render(message)) == message, the
streaming parser equal to the whole parse at every split point of every test completion, malformed
or truncated DSML kept as content character for character, bad tools and tool messages named."""

import itertools
import json

import pytest

from MaxText.data.chat_dsv32 import ChatFormatError, check_tools, parse_completion, render
from MaxText.data.chat_dsv32_stream import CompletionParser

BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2, "units": ["C"]})}}
CALL_DSML = (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
             f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
             f'<{D}parameter name="units" string="false">["C"]</{D}parameter>\n'
             f'</{D}invoke>\n</{D}function_calls>')


def _ids():
  counter = itertools.count()
  return lambda: f"call_{next(counter)}"


# ---------------------------------------------------------------- rendering


def test_system_and_user_turns_put_think_after_the_last_user_turn_only_in_thinking_mode():
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"}, {"role": "user", "content": "Why?"}]
  earlier = f"{BOS}Be brief.{U}Hi{A}</think>Hello!{EOS}{U}Why?{A}"  # earlier reasoning dropped
  assert render(msgs, thinking=True) == earlier + "<think>"
  assert render(msgs, thinking=False) == earlier + "</think>"


def test_a_tool_loop_keeps_its_reasoning_and_results_have_no_user_token():
  msgs = [{"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": "Looking.", "reasoning_content": "need a tool", "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
  assert render(msgs, thinking=True) == (
      f"{BOS}{U}Weather?{A}<think>need a tool</think>Looking.\n\n{CALL_DSML}{EOS}"
      "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>")
  assert render(msgs, thinking=False) == (
      f"{BOS}{U}Weather?{A}</think>Looking.\n\n{CALL_DSML}{EOS}"
      "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>")


def test_tool_results_before_a_later_user_turn_close_with_think_end_in_thinking_mode():
  """Only what follows the last user turn thinks: earlier results close with </think>, the last user's <think>."""
  msgs = [{"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": "Looking.", "reasoning_content": "need a tool", "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}, {"role": "user", "content": "Thanks"}]
  assert render(msgs, thinking=True) == (
      f"{BOS}{U}Weather?{A}</think>Looking.\n\n{CALL_DSML}{EOS}"
      f"\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>{U}Thanks{A}<think>")


def test_tools_and_response_format_go_into_the_system_prompt_and_developer_is_a_user_turn():
  text = render([{"role": "user", "content": "Hi"}], thinking=False, tools=[TOOL],
                response_format={"type": "json_object"})
  head, _, tail = text.partition("<functions>\n")
  assert head.startswith(f"{BOS}\n\n## Tools\nYou have access to a set of tools")  # empty system, no role token
  assert f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>' in head
  assert head.endswith("Here are the functions available in JSONSchema format:\n")
  assert tail == (json.dumps(TOOL["function"]) + "\n</functions>\n\n\n## Response Format:\n\nYou MUST strictly adhere "
                  'to the following schema to reply:\n{"type": "json_object"}' + f"{U}Hi{A}</think>")
  dev = render([{"role": "developer", "content": "Do X"}], thinking=True, bos=False)
  assert dev == f"{U}\n\n# The user's message is: Do X{A}<think>"


@pytest.mark.parametrize("message", [
    {"reasoning_content": "Let me think.\nDone", "content": "The answer is 4.", "tool_calls": []},
    {"reasoning_content": "", "content": "", "tool_calls": [CALL]},
    {"reasoning_content": "r", "content": "Two calls:\n", "tool_calls": [
        CALL, {"id": "call_1", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": json.dumps(
            {"s": "a <b> \"q\"\n", "o": {"k": [1, 2.5, None]}, "t": True}, ensure_ascii=False)}}]},
])
@pytest.mark.parametrize("thinking", [True, False])
def test_parse_of_a_rendered_assistant_message_gives_the_message_back(message, thinking):
  prompt = render([{"role": "user", "content": "q"}], thinking=thinking)
  full = render([{"role": "user", "content": "q"}, {"role": "assistant", **message}], thinking=thinking)
  got = parse_completion(full[len(prompt):], thinking=thinking, new_id=_ids())
  assert got.reasoning_content == (message["reasoning_content"] if thinking else None)
  assert (got.content, got.tool_calls) == (message["content"], message["tool_calls"])


def test_bad_tools_and_tool_messages_name_the_field():
  cases = [([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
           ([TOOL, {"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[1].function.parameters"),
           ([{"type": "retrieval"}], "tools[0].type")]
  for tools, field in cases:
    with pytest.raises(ChatFormatError) as e:
      check_tools(tools)
    assert e.value.field == field
  assert check_tools([TOOL]) == [TOOL]
  for msgs, field in [([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}],
                       "messages[1].tool_call_id"),
                      ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "nope"}],
                       "messages[1].tool_call_id"),
                      ([{"role": "assistant", "tool_calls": [CALL, CALL]}, {"role": "tool", "tool_call_id": "call_0"},
                        {"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "call_0"}],
                       "messages[3].tool_call_id"),  # a user turn ends the calls a result may answer
                      ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
                       "messages[0].tool_calls[0].function.arguments"),
                      ([{"role": "narrator", "content": "x"}], "messages[0].role")]:
    with pytest.raises(ChatFormatError) as e:
      render(msgs, thinking=False, tools=[TOOL])  # the system message it puts first is not counted
    assert e.value.field == field


# ---------------------------------------------------------------- parsing, whole and streamed


COMPLETIONS = [  # (text, thinking)
    ("plain answer, no tags" + EOS, False),
    ("why</think>because" + EOS, True),
    ("still thinking when max_tokens hit </thi", True),
    (f"r</think>Sure.\n\n{CALL_DSML}{EOS}", True),
    (f"\n\n{CALL_DSML}\n\n{CALL_DSML}", False),
    (f"a\n\n\n{CALL_DSML} trailing", False),
    (f"no newlines before{CALL_DSML}", False),
    (f"r</think>\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" str", True),
    (f"x\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"n\" string=\"false\">not json"
     f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls> then {CALL_DSML}", False),
    (f"<{D}function_calls>\ngarbage\n</{D}function_calls>{EOS}ignored", False),
    (f"dup\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"a\" string=\"true\">1</{D}parameter>\n"
     f"<{D}parameter name=\"a\" string=\"true\">2</{D}parameter>\n</{D}invoke>\n</{D}function_calls>", False),
    ("a </think> in chat mode, a <｜DS and \n\n< and <｜end▁of", False),
    ("reasoning the end cuts" + EOS + "ignored", True),  # EOS in the reasoning state: held back as it comes
]


def _streamed(pieces, thinking):
  parser, out = CompletionParser(thinking=thinking, new_id=_ids()), []
  for p in pieces:
    out.append(parser.feed(p))
  out.append(parser.finish())
  reasoning = "".join(d.reasoning_content for d in out)
  return reasoning if thinking else None, "".join(d.content for d in out), [c for d in out for c in d.tool_calls]


@pytest.mark.parametrize("text,thinking", COMPLETIONS)
def test_the_streaming_parser_equals_the_whole_parse_at_every_split_point(text, thinking):
  whole = parse_completion(text, thinking=thinking, new_id=_ids())
  expected = (whole.reasoning_content, whole.content, whole.tool_calls)
  for k in range(len(text) + 1):
    assert _streamed([text[:k], text[k:]], thinking) == expected, k
  # One character at a time (a sent piece is never taken back, so equality means no part of a tag
  # that the whole parse removes was ever sent as content or reasoning).
  assert _streamed(list(text), thinking) == expected


def test_a_partial_eos_is_held_back_in_every_state():
  for thinking, state in ((True, "reasoning_content"), (False, "content")):
    parser = CompletionParser(thinking=thinking)
    assert getattr(parser.feed("so <｜end▁of"), state) == "so "  # may still become EOS: not sent
    assert not parser.feed("▁sentence｜>more") and parser.done  # it was EOS: nothing of it, nothing after


@pytest.mark.parametrize("text", [COMPLETIONS[8][0], COMPLETIONS[10][0],
                                  f"<{D}function_calls>\ngarbage\n</{D}function_calls>",
                                  f"<{D}function_calls>\n<{D}invoke name=\"f\">",
                                  f"\n\n<{D}function_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>"])
def test_malformed_or_truncated_dsml_comes_back_as_content_character_for_character(text):
  got = parse_completion(text, thinking=False)
  assert (got.content, got.tool_calls) == (text, [])


def test_the_test_tokenizer_holds_each_marker_as_one_token_and_decodes_it_back_as_text():
  from MaxText.data.chat_dsv32 import SPECIAL_TOKENS
  from MaxText.data.tokenizer import load_tokenizer
  from tests.conftest import REPO_ROOT
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=f"{REPO_ROOT}/tests/data/tokenizer.json")
  assert [tok.encode(t) for t in SPECIAL_TOKENS] == [[i] for i in range(384, 391)]
  text = render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "reasoning_content": "r",
                                                     "tool_calls": [CALL]}], thinking=True)
  ids = tok.encode(text)
  assert tok.decode(ids) == text and tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text  # only <s>, </s> dropped
