"""MaxText/server/vllm_fields.py: vLLM's fields without a meaning here are accepted where they change nothing or
at their off value (`null`, vLLM's default), else one 400 naming the field; a field of the other endpoint only is
left for the model to refuse; and the models apply the split (a bad value is an ApiError naming it)."""

import pytest

from MaxText.inference.scheduler import Request, SamplingParams
from MaxText.server import vllm_fields
from MaxText.server.protocol import ApiError, ChatRequest, CompletionRequest


def test_ignored_and_off_at_default_go_and_the_rest_stays():
  body = {"prompt": "x", "request_id": "r", "use_beam_search": False, "priority": 0, "temperature": 0.5}
  assert vllm_fields.split(body, "completions") == ({"prompt": "x", "temperature": 0.5}, None)


@pytest.mark.parametrize("name,value", [("use_beam_search", True), ("priority", 1), ("priority", False),
                                        ("allowed_token_ids", []), ("thinking_token_budget", 0), ("suffix", ""),
                                        ("logits_processors", ["m.P"])])
def test_an_off_field_at_another_value_is_named(name, value):
  _, bad = vllm_fields.split({name: value}, "completions")
  assert bad[0] == name and name in bad[1] and "docs/sampling.md" in bad[1]


def test_a_field_of_the_other_endpoint_is_left_in():
  assert vllm_fields.split({"suffix": "!"}, "chat") == ({"suffix": "!"}, None)
  assert vllm_fields.split({"chat_template": "t"}, "completions") == ({"chat_template": "t"}, None)
  with pytest.raises(Exception, match="suffix"):  # pydantic: an unknown field of chat's
    ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "suffix": "!"})


def test_the_models_apply_the_split_with_null_as_the_default():
  assert CompletionRequest.model_validate({"prompt": "x", "use_beam_search": None, "request_id": "r"}).prompt == "x"
  with pytest.raises(ApiError) as e:
    CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True})
  assert e.value.status == 400 and e.value.param == "use_beam_search"
  chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True})
  assert not chat.generation_prompt and ChatRequest.model_validate({"messages": []}).generation_prompt


def test_cache_salt_keeps_prefix_pages_apart_per_salt_and_adapter():
  roots = {Request([1], SamplingParams(cache_salt=s, lora_adapter=a)).prefix_root for s in ("", "a", "b") for a in (0, 1)}
  assert len(roots) == 6 and Request([1], SamplingParams()).prefix_root == b""


def test_truncate_prompt_tokens_takes_1_to_max_length_and_minus_1_and_refuses_past_them():
  prompt = list(range(10))
  cut = lambda k, side="left": CompletionRequest.model_validate(  # noqa: E731
      {"prompt": "x", "truncate_prompt_tokens": k, "truncation_side": side}).truncated(prompt, 8)
  assert cut(8) == prompt[2:] and cut(1) == [9] and cut(-1) == prompt[2:] and cut(8, "right") == prompt[:8]
  for k in (0, 9, -2):
    with pytest.raises(ApiError) as e:
      cut(k)
    assert e.value.status == 400 and e.value.param == "truncate_prompt_tokens", k


@pytest.mark.parametrize("name,off,on", [("logits_processors", [], ["my.Processor"]), ("structural_tag", None, "{}")])
def test_vllms_logits_processors_and_chats_structural_tag_are_taken_off_and_named_on(name, off, on):
  """Two names of vLLM's ChatCompletionRequest (logits_processors of CompletionRequest too) that were 422s here:
  at vLLM's off value accepted, at another a 400 naming the field."""
  chat = {"messages": [{"role": "user", "content": "hi"}]}
  assert ChatRequest.model_validate({**chat, name: off}).messages
  with pytest.raises(ApiError) as e:
    ChatRequest.model_validate({**chat, name: on})
  assert e.value.status == 400 and e.value.param == name and "not implemented" in e.value.message
