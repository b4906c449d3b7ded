"""The server's text side (MaxText/server/protocol.py): stop strings found across streamed pieces and
never half sent, one-token stop strings handed to the engine, chat templates from chat_template_path
rendered as transformers renders them, a missing template naming its key, token-id text without a
tokenizer, null request fields taking their defaults, and one BOS before a text prompt."""

import os

import pytest

from MaxText.data.tokenizer import load_tokenizer
from MaxText.server.protocol import ApiError, ChatMessage, CompletionRequest, StopText, Texts, load_chat_template
from tests.conftest import REPO_ROOT

TOKENIZER = os.path.join(REPO_ROOT, "tests", "data", "tokenizer.json")


def _texts(template=None, tokenizer=True):
  tok = load_tokenizer(tokenizer_type="hf", tokenizer_path=TOKENIZER, bos_id=1, eos_id=2, pad_id=0) if tokenizer else None
  return Texts(tok, add_bos=True, vocab_size=512, chat_template=template, chat_template_source="test",
               special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("pieces", [["hello wor", "ld. STOP", " more"], ["hello world. S", "T", "OP more"],
                                    ["h", "e", "l", "l", "o", " world. ", "STO", "P!"]])
def test_stop_text_cuts_before_the_first_stop_string_however_it_is_split(pieces):
  stop, sent, hit = StopText(["STOP", "xyz"]), "", False
  for p in pieces:
    out, hit = stop.push(p)
    sent += out
    assert "STO" not in sent  # never half of a stop string on the wire
    if hit:
      break
  assert hit and sent == "hello world. "


def test_stop_text_without_a_hit_sends_everything_by_the_end():
  stop = StopText(["STOP"])
  sent = "".join(stop.push(p)[0] for p in ["ab", "cST", "O"])
  assert sent == "abc" and stop.flush() == "STO"  # the last 3 characters wait: they may start "STOP"


def test_add_bos_puts_one_bos_before_a_text_prompt_even_one_that_starts_with_it():
  texts = _texts()
  bos, hello = texts.tokenizer.bos_id, texts.tokenizer.encode("hello")
  assert texts.prompts("hello") == [[bos] + hello]
  assert texts.prompts("<s>hello") == [[bos] + hello]  # its own BOS, not a second one
  assert texts.prompts([[bos, bos] + hello]) == [[bos, bos] + hello]  # token ids go as sent
  assert texts.encode("hello", bos=False) == hello


def test_one_token_stop_strings_go_to_the_engine_as_stop_string_ids_never_banned_by_min_tokens():
  texts = _texts()
  tok = texts.tokenizer
  one = next(w for w in (" the", " sea", "the", ".") if len(tok.encode(w)) == 1)
  ids, strings = texts.stop_plan([one, "the sea is"], [7])
  assert ids == (7, tok.encode(one)[0]) and strings == (tok.encode(one)[0],)
  assert texts.stop_plan([one], [tok.encode(one)[0]]) == ((tok.encode(one)[0],), ())  # also a stop token id: banned
  assert texts.stop_plan([one], [], keep_stop=True) == ((), ())  # include_stop_str_in_output: the text check only
  with pytest.raises(ApiError) as e:
    _texts(tokenizer=False).stop_plan(["x"], None)
  assert e.value.param == "stop"


def test_chat_template_from_chat_template_path_renders_like_transformers(tmp_path):
  path = tmp_path / "chat.jinja"
  path.write_text("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                  "{% endif %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]{% endif %}")
  template, where, _ = load_chat_template(str(path), TOKENIZER)
  assert where == f"chat_template_path={path}"
  texts = _texts(template)
  ids = texts.chat_prompt([ChatMessage(role="user", content=[{"type": "text", "text": " hi "}])])
  assert ids == texts.tokenizer.encode("<s>[user] hi\n[assistant]")
  with pytest.raises(ApiError) as e:
    texts.chat_prompt([ChatMessage(role="system", content="x")])
  assert e.value.param == "messages" and "no system" in e.value.message


def test_no_chat_template_is_a_400_naming_chat_template_path():
  template, where, _ = load_chat_template("", TOKENIZER)
  assert template is None
  with pytest.raises(ApiError) as e:
    _texts(None).chat_prompt([ChatMessage(role="user", content="hi")])
  assert e.value.status == 400 and e.value.param == "chat_template_path"


def test_without_a_tokenizer_prompts_are_ids_and_text_is_ids_joined_by_commas():
  texts = _texts(tokenizer=False)
  assert texts.prompts([1, 2, 3]) == [[1, 2, 3]] and texts.prompts([[1], [4, 5]]) == [[1], [4, 5]]
  with pytest.raises(ApiError) as e:
    texts.prompts("hello")
  assert e.value.param == "prompt"
  detok = texts.detokenizer([1, 2])
  assert "".join(detok.push(t) for t in (7, 8, 9)) + detok.flush() == "7,8,9"


def test_null_fields_take_their_defaults_and_n_above_1_is_refused():
  body = CompletionRequest.model_validate({"prompt": "x", "temperature": None, "top_p": None, "max_tokens": None})
  assert body.temperature == 1.0 and body.top_p == 1.0 and body.max_tokens == 16
  with pytest.raises(ApiError) as e:
    CompletionRequest(prompt="x", n=3).check()
  assert e.value.param == "n"


def test_the_detokenizer_flushes_text_held_back_at_the_end():
  texts = _texts()
  tok = texts.tokenizer
  ids = tok.encode("sea \u4e2d")  # a 3-byte character: byte tokens that decode alone to U+FFFD
  cut = ids[:-1]  # the sequence ends inside the character
  detok = texts.detokenizer([1])
  sent = "".join(detok.push(t) for t in cut)
  assert "\ufffd" not in sent  # held back while the character may still complete
  assert sent + detok.flush() == tok.decode(cut) and tok.decode(cut).endswith("\ufffd")
