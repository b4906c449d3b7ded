"""DeepSeek-V3.2 completions parsed as they are generated: feed text pieces (one token's text at a
time), get back what is safe to send now (reasoning, content, whole tool calls).

    parser = CompletionParser(thinking=True)
    for piece in pieces:
      delta = parser.feed(piece)      # Delta(reasoning_content, content, tool_calls)
    delta = parser.finish()           # the end of the completion: what was held back

Invariants: the concatenation of every delta equals chat_dsv32.parse_completion of the whole text,
however the text is split; no delta ever holds part of </think>, of a function_calls tag or of EOS
(a suffix that may still become one is held back until the next piece decides); a function_calls
block is held whole and sent as tool calls once closed, or as the content it was when it turns out
malformed or the completion ends first. Nothing raises.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from MaxText.data.chat_dsv32 import CALLS_CLOSE, CALLS_OPEN, CALLS_SEP, EOS, THINK_END, new_call_id, parse_tool_block

# What each state must not send half of: a suffix that starts one of these is held back.
_HELD = {"reasoning": (THINK_END, EOS), "content": (CALLS_SEP + CALLS_OPEN, CALLS_OPEN, EOS), "raw": (EOS,)}


@dataclasses.dataclass
class Delta:
  """What one piece adds (empty strings and no tool calls when it only extends a held-back suffix)."""
  reasoning_content: str = ""
  content: str = ""
  tool_calls: list[dict] = dataclasses.field(default_factory=list)

  def __bool__(self) -> bool:
    return bool(self.reasoning_content or self.content or self.tool_calls)


def held_suffix(text: str, tags: tuple[str, ...]) -> int:
  """The length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
  return max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])),
             default=0)


class CompletionParser:
  """One request's incremental parser. States: reasoning (thinking mode, until </think>) -> content
  -> block (inside <function_calls>, held) -> content ...; raw (after a malformed block: all content)."""

  def __init__(self, *, thinking: bool, new_id: Callable[[], str] = new_call_id):
    self.state = "reasoning" if thinking else "content"
    self._pending = ""    # text received, not yet sent
    self._block_raw = ""  # the text a held block started with ("\n\n" if taken, <function_calls>)
    self._new_id = new_id
    self.done = False

  def feed(self, text: str) -> Delta:
    if self.done:
      return Delta()
    self._pending += text
    end = self._pending.find(EOS)
    if end >= 0:  # the completion ends here: nothing after EOS belongs to it
      self._pending = self._pending[:end]
      return self.finish()
    return self._drain(final=False)

  def finish(self) -> Delta:
    """The completion ended: send everything held back (an unclosed block as content)."""
    if self.done:
      return Delta()
    self.done = True
    return self._drain(final=True)

  def _drain(self, final: bool) -> Delta:
    out = Delta()
    while True:
      if self.state == "reasoning" and (i := self._pending.find(THINK_END)) >= 0:
        out.reasoning_content += self._pending[:i]
        self._pending, self.state = self._pending[i + len(THINK_END):], "content"
      elif self.state == "content" and (i := self._pending.find(CALLS_OPEN)) >= 0:
        before = self._pending[:i]
        sep = CALLS_SEP if before.endswith(CALLS_SEP) else ""
        out.content += before[:len(before) - len(sep)]
        self._block_raw, self._pending, self.state = sep + CALLS_OPEN, self._pending[i + len(CALLS_OPEN):], "block"
      elif self.state == "block":
        j = self._pending.find(CALLS_CLOSE)
        calls = parse_tool_block(self._pending[:j], self._new_id) if j >= 0 else None
        if calls is not None:
          out.tool_calls += calls
          self._pending, self.state = self._pending[j + len(CALLS_CLOSE):], "content"
        elif j >= 0 or final:  # malformed, or the completion ended inside it: the block is content
          self._pending, self.state = self._block_raw + self._pending, "raw"
        else:
          return out
      else:  # no tag in what is pending: send it, less a suffix that may start one
        keep = 0 if final else held_suffix(self._pending, _HELD[self.state])
        sent, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        if self.state == "reasoning":
          out.reasoning_content += sent
        else:
          out.content += sent
        return out
