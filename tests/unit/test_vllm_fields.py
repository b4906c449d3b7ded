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
                                        ("allowed_token_ids", []), ("thinking_token_budget", 0), ("suffix", "")])
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
