"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (plain and streamed as
server-sent events; logprobs and echo: server/logprobs.py), /v1/models, /health, /metrics, and vLLM's
/tokenize, /detokenize and /tokenizer_info, over the engine thread; structured outputs
(response_format, structured_outputs: server/structured.py) on both completion endpoints.

    app = build_app(Server(config, texts, engine_thread, model_id))
    uvicorn.run(app, ...)

A request: the body is validated (a bad field is a 400 naming it), its prompts tokenized, each
prompt submitted to the engine (400 naming the field the engine refuses, 429 past
serve_max_waiting, 503 while compiling); tokens then come back as the engine makes them, are
detokenized incrementally, checked for stop strings, and sent (streamed: one event per piece,
ending with `data: [DONE]`). A client that goes away mid-request has its request aborted (its
pages freed at the engine's next loop). Every failure is OpenAI's error body; none ends the server.
Before any route: the API key (401) and the body's size (413), server/gate.py. A request the engine
ends at serve_request_timeout is a 408 (streamed: the error as its last event, then [DONE]). A request's `model`
picks one of serve_lora_adapters (Server.adapter_slot: its slot travels as SamplingParams.lora_adapter; the
base's name or none picks none) and /v1/models lists the base and each adapter (vLLM's parent / root fields).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from MaxText.config.types import Config
from MaxText.server.chat import chat_turn
from MaxText.server.engine_thread import EngineThread, RequestStream
from MaxText.server.gate import RequestGate, api_key
from MaxText.server.logprobs import (
  DetokenizeRequest,
  TokenizeRequest,
  chat_logprobs,
  completion_logprobs,
  detokenize,
  prompt_logprobs,
  tokenize,
  tokenizer_info,
)
from MaxText.server.metrics import CONTENT_TYPE, ServerMetrics
from MaxText.server.protocol import ApiError, ChatRequest, CompletionRequest, SamplingFields, StopText, Texts
from MaxText.server.structured import compiled, grammar_spec

_DISCONNECT_POLL_S = 0.5  # how often a plain (not streamed) request checks that its client is still there


@dataclasses.dataclass
class Server:
  """What the routes share: the config, the text side, the engine thread and the metrics."""
  config: Config
  texts: Texts
  engine: EngineThread
  model_id: str
  metrics: ServerMetrics = dataclasses.field(default_factory=ServerMetrics)
  grammars: Any = None  # inference.grammar.Grammars: structured outputs (None: refused with a 400)

  def adapter_slot(self, model: str | None) -> int:
    """A request's model field -> its LoRA adapter slot (SamplingParams.lora_adapter): 0 for the base (its name,
    or no model), k for serve_lora_adapters' k-th entry; any other name is a 404 naming the field."""
    names = [name for name, _ in self.config.served_adapters]
    if not model or model == self.model_id:
      return 0
    if model in names:
      return names.index(model) + 1
    raise ApiError(404, f"model={model!r} is not served here: this server serves "
                   f"{', '.join(repr(m) for m in [self.model_id, *names])}", "model", "model_not_found")


@dataclasses.dataclass
class Piece:
  """New text and token ids of one choice; finish_reason set on its last piece."""
  index: int
  text: str
  token_ids: list[int]
  finish_reason: str | None = None
  logprobs: list = dataclasses.field(default_factory=list)  # per token id: its Logprob, when asked


# ---------------------------------------------------------------- requests -> engine streams


async def _submit(server: Server, body: SamplingFields, prompts: Sequence[list[int]],
                  max_tokens: int | None, stop_ids: Sequence[int] = (), grammar=None) -> list[RequestStream]:
  """Every prompt's request, accepted by the engine, or none (ApiError). stop_ids: the chat format's own;
  grammar: the chat format's own (a forced tool call's ForcedCall, its spec for the request's max_tokens),
  applied when the server has grammars."""
  body.check()
  body.check_logprobs(server.config.serve_max_logprobs)
  adapter = server.adapter_slot(body.model)
  prompts = [body.truncated(p, server.config.max_target_length) for p in prompts]
  stop_ids = server.texts.stop_plan(body.stop_strings, [*(body.stop_token_ids or []), *stop_ids],
                                       keep_stop=body.include_stop_str_in_output)
  params = [server.texts.sampling(body, p, max_tokens, stop_ids, server.config.max_target_length) for p in prompts]
  spec = grammar_spec(body)
  if spec is None and grammar is not None and server.grammars is not None:
    spec = grammar.spec(params[0].max_tokens)  # one prompt: a chat turn's
  if spec is not None:
    await compiled(server.grammars, spec)  # a bad schema is a 400 here; the engine then finds it compiled
    params = [dataclasses.replace(p, grammar=spec) for p in params]
  if server.config.serve_request_timeout:
    params = [dataclasses.replace(p, timeout=server.config.serve_request_timeout) for p in params]
  if adapter:
    params = [dataclasses.replace(p, lora_adapter=adapter) for p in params]
  streams: list[RequestStream] = []
  try:
    for p, sp in zip(prompts, params):
      streams.append(await server.engine.submit(p, sp))
  except BaseException:
    for s in streams:
      server.engine.abort(s)
    raise
  return streams


async def _pieces(server: Server, index: int, stream: RequestStream, body: SamplingFields,
                  arrival: float) -> AsyncIterator[Piece]:
  """One request's text as it comes; aborts the request if the caller stops listening. Stop strings
  count from the body's min_tokens-th token on (vLLM's)."""
  detok = server.texts.detokenizer(stream.prompt, body.skip_special_tokens)
  stops = body.stop_strings
  stop = StopText(stops, keep=body.include_stop_str_in_output) if stops else None
  n, first, last, reason = 0, None, None, None
  try:
    async for tok in stream:
      last = time.perf_counter()
      first = first or last
      n += 1
      text, lp = detok.push(tok), stream.logprobs[-1:]
      if stop is not None and n > body.min_tokens:
        text, hit = stop.push(text)
        if hit:
          reason = "stop"
          server.engine.abort(stream)
          yield Piece(index, text, [tok], reason, lp)
          return
      yield Piece(index, text, [tok], logprobs=lp)
    reason = stream.finish_reason
    if reason == "timeout":
      raise _timed_out(server, n)
    tail = detok.flush()
    if stop is not None:
      tail, hit = stop.push(tail)
      tail += "" if hit else stop.flush()
      reason = "stop" if hit else reason
    yield Piece(index, tail, [], reason)
  finally:
    if reason is None:
      server.engine.abort(stream)  # the client went away (or the caller failed): free its pages now
    server.metrics.observe(prompt_tokens=len(stream.prompt), generated=n, finish_reason=reason or "abort",
                           arrival=arrival, first_token=first, last_token=last)


def _timed_out(server: Server, made: int) -> ApiError:
  """A request the engine ended at serve_request_timeout (its pages are already free): a 408 in OpenAI's
  body; streamed, the same body as the last event (the status line is already out)."""
  limit = server.config.serve_request_timeout
  return ApiError(408, f"the request ran past serve_request_timeout={limit:g} s and was ended after {made} "
                  "tokens: ask for fewer max_tokens, or a larger serve_request_timeout", None, "request_timeout")


async def _dropped(gen: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
  """A choice's pieces with their text and tokens dropped (max_tokens=0 with echo: only the prompt)."""
  async for p in gen:
    if p.finish_reason is not None:
      yield Piece(p.index, "", [], "length")


async def _merged(gens: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
  """The pieces of several choices as they come (one choice: its own order)."""
  if len(gens) == 1:
    async for piece in gens[0]:
      yield piece
    return
  q: asyncio.Queue = asyncio.Queue()

  async def pump(gen):
    try:
      async for piece in gen:
        await q.put(piece)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
      await q.put(e)
    finally:
      await q.put(None)

  tasks = [asyncio.ensure_future(pump(g)) for g in gens]
  try:
    left = len(tasks)
    while left:
      item = await q.get()
      if item is None:
        left -= 1
      elif isinstance(item, BaseException):
        raise item
      else:
        yield item
  finally:
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(request: Request, gens: list[AsyncIterator[Piece]]) -> list[Piece]:
  """Every choice whole (a plain response); cancels them when the client disconnects."""
  async def run():
    out = [Piece(i, "", []) for i in range(len(gens))]
    async for p in _merged(gens):
      out[p.index].text += p.text
      out[p.index].token_ids += p.token_ids
      out[p.index].logprobs += p.logprobs
      out[p.index].finish_reason = p.finish_reason or out[p.index].finish_reason
    return out

  task = asyncio.ensure_future(run())
  try:
    while True:
      done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
      if done:
        return task.result()
      if await request.is_disconnected():
        raise ApiError(499, "the client closed the connection")
  finally:
    if not task.done():
      task.cancel()
      with contextlib.suppress(BaseException):
        await task


def _usage(streams: Sequence[RequestStream], pieces_or_counts: Sequence[int]) -> dict:
  prompt = sum(len(s.prompt) for s in streams)
  completion = sum(pieces_or_counts)
  return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _EventStream(StreamingResponse):
  """Server-sent events; when the response ends in any way (done, the client gone, cancelled), every
  request it still runs is aborted (a no-op for those that finished)."""

  def __init__(self, server: Server, streams: Sequence[RequestStream], events: AsyncIterator[str]):
    super().__init__(events, media_type="text/event-stream")
    self._server, self._streams = server, streams

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      for s in self._streams:
        self._server.engine.abort(s)


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _event_stream(streams, gens, chunk, usage_chunk) -> AsyncIterator[str]:
  """SSE: chunk(piece) per piece (none where it is None), then usage_chunk(counts) if asked, then
  [DONE]. An engine error mid-stream is sent as an error event (the status line is already out)."""
  counts = [0] * len(streams)
  try:
    async for piece in _merged(gens):
      counts[piece.index] += len(piece.token_ids)
      if (event := chunk(piece)) is not None:
        yield _sse(event)
    if usage_chunk is not None:
      yield _sse(usage_chunk(_usage(streams, counts)))
  except ApiError as e:
    yield _sse(e.body())
  yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app

def routes(app: FastAPI) -> str:
  """Every route the app serves, "METHOD /path" (what a 404 or 405 lists): read from the app itself, so the
  list has FastAPI's /docs and /openapi.json and cannot fall behind a new route."""
  return ", ".join(f"{m} {r.path}" for r in app.routes for m in sorted(getattr(r, "methods", None) or ()) if m != "HEAD")


def body_error(errors: Sequence[dict]) -> ApiError:
  """FastAPI's validation errors of a body -> one 400 a person reads: a body that is not JSON says where
  it breaks; a field we do not implement says so (docs/sampling.md); else the field and pydantic's word."""
  err = (list(errors) or [{}])[0]
  loc = [str(x) for x in err.get("loc", ()) if x != "body"]
  if err.get("type") == "json_invalid":
    why = (err.get("ctx") or {}).get("error", "not JSON")
    return ApiError(400, f"the request body is not valid JSON ({why} at character {loc[0] if loc else 0}): "
                    "send one JSON object with Content-Type: application/json")
  field, where = (loc[0] if loc else None), ".".join(loc) or "the body"
  if err.get("type") == "extra_forbidden":
    return ApiError(400, f"{where} is not supported by this server (docs/sampling.md lists the fields it "
                    "implements and those it ignores): remove it", field)
  return ApiError(400, f"{where}: {err.get('msg', 'invalid')}", field)


def build_app(server: Server) -> FastAPI:
  @contextlib.asynccontextmanager
  async def lifespan(app):
    server.engine.start()
    try:
      yield
    finally:
      await asyncio.to_thread(server.engine.stop)

  app = FastAPI(title="MaxText DeepSeek-V3.2", lifespan=lifespan)
  app.add_middleware(RequestGate, api_key=api_key(server.config), max_bytes=server.config.serve_max_request_bytes)

  @app.exception_handler(ApiError)
  async def api_error(request: Request, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(RequestValidationError)
  async def bad_body(request: Request, e: RequestValidationError):
    return JSONResponse(body_error(e.errors()).body(), status_code=400)

  @app.exception_handler(StarletteHTTPException)
  async def no_route(request: Request, e: StarletteHTTPException):
    if e.status_code in (404, 405):
      what = (f"{request.method} {request.url.path} is not a route of this server" if e.status_code == 404
              else f"{request.url.path} does not take {request.method}")
      e = ApiError(e.status_code, f"{what}: it serves {routes(app)}", None,
                   "not_found" if e.status_code == 404 else "method_not_allowed")
      return JSONResponse(e.body(), status_code=e.status)
    return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

  @app.exception_handler(Exception)
  async def bug(request: Request, e: Exception):
    return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}").body(), status_code=500)

  @app.get("/health")
  async def health():
    state = server.engine.state
    body = {"status": state} | ({"error": server.engine.failure} if server.engine.failure else {})
    return JSONResponse(body, status_code=200 if server.engine.ready else 503)

  @app.get("/metrics")
  async def metrics():
    return Response(server.metrics.render(server.engine.stats, server.engine.ready), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    card = {"object": "model", "created": 0, "owned_by": "maxtext", "max_model_len": server.config.max_target_length}
    base = {"id": server.model_id, **card, "root": server.model_id, "parent": None}
    return {"object": "list", "data": [base, *({"id": name, **card, "root": path, "parent": server.model_id}
                                               for name, path in server.config.served_adapters)]}

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    prompts = server.texts.prompts(body.prompt, body.add_special_tokens)
    score_only = body.max_tokens == 0  # echo: the prompt scored, the one token made is dropped
    streams = await _submit(server, body, prompts, 1 if score_only else body.max_tokens)
    gens = [_pieces(server, i, s, body, arrival) for i, s in enumerate(streams)]
    if score_only:
      gens = [_dropped(g) for g in gens]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model or server.model_id}

    started: set[int] = set()

    offsets: dict[int, int] = {}  # a choice's characters sent so far (logprobs' text_offset)

    def choice(p: Piece, streamed: bool) -> dict:
      c = {"index": p.index, "text": p.text, "logprobs": None, "finish_reason": p.finish_reason}
      first = p.index not in offsets
      s = streams[p.index]
      ids, entries = p.token_ids, p.logprobs
      if body.echo and first:
        gap = "," if server.texts.tokenizer is None and p.text else ""  # ids joined by commas
        c["text"] = server.texts.text_of(s.prompt, body.skip_special_tokens) + gap + p.text
        ids, entries = s.prompt + ids, (s.prompt_logprobs or [None] * len(s.prompt)) + entries
      if body.logprobs is not None:
        c["logprobs"] = completion_logprobs(server.texts, ids, entries, offsets.get(p.index, 0))
      if body.prompt_logprobs is not None and first:
        c["prompt_logprobs"] = prompt_logprobs(server.texts, s.prompt, s.prompt_logprobs or [None] * len(s.prompt))
      offsets[p.index] = offsets.get(p.index, 0) + len(c["text"])
      if body.return_token_ids:
        c["token_ids"] = p.token_ids
        if streamed and p.index not in started:  # a streamed choice's first chunk carries its prompt's ids
          c["prompt_token_ids"] = streams[p.index].prompt
          started.add(p.index)
      return c

    if body.stream:
      return _EventStream(server, streams, _event_stream(
          streams, gens, lambda p: {**head, "choices": [choice(p, True)], "usage": None},
          (lambda u: {**head, "choices": [], "usage": u}) if body.include_usage else None))
    pieces = await _collect(request, gens)
    out = {**head, "choices": [choice(p, False) for p in pieces],
           "usage": _usage(streams, [len(p.token_ids) for p in pieces])}
    if body.return_token_ids:
      out["prompt_token_ids"] = streams[0].prompt if len(streams) == 1 else [s.prompt for s in streams]
    return out

  @app.post("/v1/chat/completions")
  async def chat(body: ChatRequest, request: Request):
    arrival = time.perf_counter()
    body.check()
    turn = chat_turn(server.texts, body)
    prompt = turn.prompt
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    streams = await _submit(server, body, [prompt], max_tokens, turn.stop_ids, turn.grammar)
    gens = [_pieces(server, 0, streams[0], body, arrival)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": body.model or server.model_id}
    if body.stream:
      first, held = [True], Piece(0, "", [])  # held: the tokens of pieces the parser held back

      def chunk(p: Piece) -> dict | None:
        held.token_ids, held.logprobs = held.token_ids + p.token_ids, held.logprobs + p.logprobs
        delta = turn.delta(p.text, final=p.finish_reason is not None)
        if not (delta or first[0] or p.finish_reason or body.return_token_ids):
          return None  # the parser holds this piece back (a tag may be starting)
        delta = {"role": "assistant", "content": "", **delta} if first[0] else delta
        first[0] = False
        lps = {"content": chat_logprobs(server.texts, held.token_ids, held.logprobs)} if body.logprobs else None
        held.token_ids, held.logprobs = [], []
        c = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": turn.finish_reason(p.finish_reason)}
        if body.return_token_ids:
          c["token_ids"] = p.token_ids
        return {**head, "object": "chat.completion.chunk", "choices": [c], "usage": None}

      return _EventStream(server, streams, _event_stream(
          streams, gens, chunk,
          (lambda u: {**head, "object": "chat.completion.chunk", "choices": [], "usage": u})
          if body.include_usage else None))
    (p,) = await _collect(request, gens)
    lps = {"content": chat_logprobs(server.texts, p.token_ids, p.logprobs)} if body.logprobs else None
    c = {"index": 0, "message": turn.message(p.text), "logprobs": lps,
         "finish_reason": turn.finish_reason(p.finish_reason)}
    out = {**head, "object": "chat.completion", "choices": [c], "usage": _usage(streams, [len(p.token_ids)])}
    if body.return_token_ids:
      c["token_ids"] = p.token_ids
      out["prompt_token_ids"] = streams[0].prompt  # as truncate_prompt_tokens left it
    return out

  @app.post("/tokenize")
  async def tokenize_route(body: TokenizeRequest):
    return tokenize(server.texts, body, lambda chat: chat_turn(server.texts, chat).prompt, server.config.max_target_length)

  @app.post("/detokenize")
  async def detokenize_route(body: DetokenizeRequest):
    return detokenize(server.texts, body)

  @app.get("/tokenizer_info")
  async def tokenizer_info_route():
    return tokenizer_info(server.texts, server.config.max_target_length)

  return app
