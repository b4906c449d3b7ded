"""The OpenAI server in this process: an app served on a free localhost port in a thread (tests, benchmarks).

    with serve_in_thread(build_app(server)) as (url, thread):
      httpx.get(url + "/health")
"""

from __future__ import annotations

import contextlib
import socket
import threading


@contextlib.contextmanager
def serve_in_thread(app):
  """-> (base url, the server's thread): uvicorn serves `app` on a pre-bound free port until the block ends."""
  import uvicorn
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
  thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", thread
  finally:
    uv.should_exit = True
    thread.join(30)
    sock.close()


__all__ = ["serve_in_thread"]
