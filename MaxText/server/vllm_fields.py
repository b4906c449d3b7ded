"""vLLM's request fields that this server has no code for, and what each gets.

The contract is vLLM's ChatCompletionRequest, CompletionRequest and TokenizeRequest: a name one of them has
is never refused at its default (vLLM clients send them, often at the default), and a name none of them has
is a 400 (protocol.py, extra="forbid"). The fields this server implements are declared on protocol.py's
models; the others are here, in two kinds:

  IGNORED  accepted with any value: nothing a client can see changes here (the reason beside each);
  OFF      accepted at a value that turns the feature off (vLLM's default, `null` always), any other value is
           a 400 naming the field: silently dropping it would change what the client gets.

docs/sampling.md lists every field by kind. `split(data, endpoint)` takes a request body (a dict) and
returns it without these names, or the one bad field and its message.
"""

from __future__ import annotations

from typing import Any

_BOTH = "both"  # a field of chat and completions alike (and /tokenize's chat form, which takes chat's fields)

# name: (endpoints, why it changes nothing here)
IGNORED: dict[str, tuple[tuple[str, ...], str]] = {
  "request_id": ((_BOTH,), "the response's id is the server's own"),
  "session_id": ((_BOTH,), "a label for routers; one server needs none"),
  "spaces_between_special_tokens": ((_BOTH,), "the tokenizer's own decoder spaces special tokens "
                                    "(vLLM applies it to slow tokenizers only)"),
  "stream_interval": ((_BOTH,), "each token's text is sent as it is made"),
  "return_token_offsets": ((_BOTH,), "vLLM reads it on its /render endpoints only"),
  "return_mm_kwargs": ((_BOTH,), "vLLM reads it on its /render endpoints only"),
  "routed_experts_prompt_start": ((_BOTH,), "no routed-expert data is returned"),
  "mm_processor_kwargs": ((_BOTH,), "text only: no multimodal processor"),
  "media_io_kwargs": ((_BOTH,), "text only: no media"),
  "vllm_xargs": ((_BOTH,), "for vLLM's plugins; this server has none"),
  "length_penalty": ((_BOTH,), "beam search's (use_beam_search is refused)"),
  "guided_decoding_backend": ((_BOTH,), "the one grammar backend is llguidance"),
}

# name: (endpoints, values that are off, what the 400 says)
OFF: dict[str, tuple[tuple[str, ...], tuple[Any, ...], str]] = {
  "use_beam_search": ((_BOTH,), (False,), "beam search is not implemented"),
  "watermarking": ((_BOTH,), (False,), "watermarking is not implemented"),
  "priority": ((_BOTH,), (0,), "requests are served first come, first served (vLLM refuses it too without "
               "--scheduling-policy priority)"),
  "allowed_token_ids": ((_BOTH,), (), "not implemented: use logit_bias, or structured_outputs"),
  "bad_words": ((_BOTH,), ([],), "not implemented: use logit_bias for single-token words"),
  "logprob_token_ids": ((_BOTH,), (), "not implemented: use logprobs / top_logprobs"),
  "return_tokens_as_token_ids": ((_BOTH,), (False,), "not implemented: send return_token_ids for the ids"),
  "repetition_detection": ((_BOTH,), (), "not implemented"),
  "thinking_token_budget": ((_BOTH,), (-1,), "not implemented"),
  "kv_transfer_params": ((_BOTH,), (), "disaggregated serving is not implemented"),
  "ec_transfer_params": ((_BOTH,), (), "disaggregated serving is not implemented"),
  "guided_grammar": ((_BOTH,), (), "not implemented: use guided_regex, guided_json or response_format"),
  "guided_whitespace_pattern": ((_BOTH,), (), "not implemented"),
  "logits_processors": ((_BOTH,), ([],), "custom logits processors are not implemented (vLLM refuses them too "
                        "unless started with --logits-processor-pattern)"),
  "structural_tag": (("chat",), (), "not implemented: use response_format or structured_outputs"),
  "suffix": (("completions",), (), "fill-in-the-middle is not implemented (vLLM refuses it too)"),
  "prompt_embeds": (("completions",), (), "prompts are text or token ids"),
  "prompt_logprobs": (("chat",), (), "not implemented on chat: send the rendered prompt (/tokenize) to "
                      "/v1/completions with prompt_logprobs"),
  "return_prompt_text": (("chat",), (False,), "not implemented: /tokenize's return_token_strs shows the prompt"),
  "chat_template": (("chat",), (), "a request's own template is not rendered (vLLM refuses one too unless "
                    "started with --trust-request-chat-template): set chat_template_path"),
}


def _applies(endpoints: tuple[str, ...], endpoint: str) -> bool:
  return _BOTH in endpoints or endpoint in endpoints


def split(data: dict, endpoint: str) -> tuple[dict, tuple[str, str] | None]:
  """A body (nulls already dropped) -> (the body without IGNORED names and OFF names at an off value,
  None), or (data, (field, message)) for the first OFF field at another value. endpoint: "chat" or
  "completions"; a name of the other endpoint only is left in (the model then refuses it as unknown)."""
  out = dict(data)
  for name, value in data.items():
    if name in IGNORED and _applies(IGNORED[name][0], endpoint):
      del out[name]
    elif name in OFF and _applies(OFF[name][0], endpoint):
      _, off, why = OFF[name]
      if not any(value == v and type(value) is type(v) for v in off):
        return data, (name, f"{name}={value!r} is not supported by this server: {why} (docs/sampling.md lists "
                            "vLLM's fields and what each does here)")
      del out[name]
  return out, None


__all__ = ["IGNORED", "OFF", "split"]
