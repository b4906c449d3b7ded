"""What every HTTP request passes before a route sees it: the API key, then the body's size.

    app.add_middleware(RequestGate, api_key=api_key(config), max_bytes=config.serve_max_request_bytes)

The key: `serve_api_key`, else the environment variable MAXTEXT_API_KEY (a deployment's secret store
sets it: no key in a config file or a process list); the config key wins when both are set, as
vLLM's --api-key wins over VLLM_API_KEY. With a key, every route but /health and /metrics (a load
balancer's probe and Prometheus' scrape stay open) needs `Authorization: Bearer <key>`; a missing or
wrong one is a 401 in OpenAI's error body (code invalid_api_key). The comparison is constant-time
(hmac.compare_digest over SHA-256 digests: neither the content nor the length leaks through timing),
and the key is never printed, logged or echoed back.

The size: a body longer than max_bytes is a 413 in OpenAI's error body before any of it is parsed,
by its Content-Length alone when it has one, else as soon as the bytes read pass the bound (a
chunked body); at most max_bytes are ever held. A body within the bound is handed on whole to the
route, and every later receive() (the disconnect a route polls for) goes to the client as before.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: that one wraps streamed responses and
the disconnect a route waits for, which the abort paths in app.py rely on.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from fastapi.responses import JSONResponse

from MaxText.config.types import Config
from MaxText.server.protocol import ApiError

API_KEY_ENV = "MAXTEXT_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})


def api_key(config: Config, environ=os.environ) -> str | None:
  """The key requests must carry: serve_api_key, else $MAXTEXT_API_KEY, else None (no key: open)."""
  return config.serve_api_key.get_secret_value() or environ.get(API_KEY_ENV) or None


def describe(config: Config, environ=os.environ) -> str:
  """Where the key comes from, for the start-up line (never the key itself)."""
  if config.serve_api_key.get_secret_value():
    return "API key required (serve_api_key)"
  if api_key(config, environ):
    return f"API key required (${API_KEY_ENV})"
  return f"no API key (anyone who reaches the port can use it; set ${API_KEY_ENV} or serve_api_key)"


def _digest(text: bytes) -> bytes:
  return hashlib.sha256(text).digest()


class RequestGate:
  def __init__(self, app, *, api_key: str | None, max_bytes: int):
    self.app, self.max_bytes = app, max_bytes
    self._key = None if api_key is None else _digest(api_key.encode())

  def authorized(self, headers: dict[bytes, bytes]) -> bool:
    """Whether the Authorization header is `Bearer <key>` (scheme in any case), compared in constant time."""
    scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
    ok = hmac.compare_digest(_digest(given.strip()), self._key)
    return ok and scheme.lower() == b"bearer"

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    if self._key is not None and scope["path"] not in OPEN_PATHS and not self.authorized(headers):
      given = b"authorization" in headers
      error = ApiError(401, "the API key is wrong: send Authorization: Bearer <serve_api_key>" if given else
                       "no API key: send the header Authorization: Bearer <serve_api_key>", None, "invalid_api_key")
      return await _refuse(error, scope, receive, send, {"WWW-Authenticate": "Bearer"})
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > self.max_bytes:
      return await _refuse(self._too_large(int(length)), scope, receive, send)
    if scope["method"] not in ("POST", "PUT", "PATCH"):
      return await self.app(scope, receive, send)
    body, more, first = b"", True, None
    while more:
      message = await receive()
      if message["type"] != "http.request":
        first = message  # the client left before its body ended: the route sees that at once
        break
      body += message.get("body", b"")
      more = message.get("more_body", False)
      if len(body) > self.max_bytes:
        return await _refuse(self._too_large(None), scope, receive, send)
    replayed = False

    async def replay():
      nonlocal replayed
      if not replayed:
        replayed = True
        return first or {"type": "http.request", "body": body, "more_body": False}
      return await receive()

    return await self.app(scope, replay, send)

  def _too_large(self, length: int | None) -> ApiError:
    size = f"{length} bytes" if length is not None else f"more than {self.max_bytes} bytes"
    return ApiError(413, f"the request body is {size}: at most serve_max_request_bytes={self.max_bytes} are accepted",
                    None, "request_too_large")


async def _refuse(error: ApiError, scope, receive, send, headers: dict | None = None) -> None:
  await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
